//! What the install tests share: the Helm chart rendered by Helm's own engine, and the rendered
//! stream read back as typed Kubernetes objects.
//!
//! The renderer is `scripts/helm-template.py` (Helm v4's Go SDK through the `helm-python-sdk`
//! wheel that `scripts/setup.sh` installs into the project's virtualenv), so what is checked is
//! what `helm install` would apply. Each document is deserialized into the type its
//! `apiVersion`/`kind` names — `k8s-openapi`'s for built-in kinds, [`crd`]'s for the
//! InferencePool and the Gateway API routes — and serialized again: a field the type does not
//! know (a misspelled key) is missing from the round trip, and [`parse_stream`] names it.
//!
//! ```no_run
//! let python = kvroute_install_tests::renderer().expect("helm engine");
//! let stream = kvroute_install_tests::render(&python, &["deploy/helm/examples/istio.yaml"]).unwrap();
//! for doc in kvroute_install_tests::parse_stream(&stream).unwrap() {
//!     println!("{} {}", doc.kind(), doc.name());
//! }
//! ```

pub mod crd;

use std::path::{Path, PathBuf};
use std::process::Command;

use k8s_openapi::api::apps::v1::{DaemonSet, Deployment, StatefulSet};
use k8s_openapi::api::core::v1::{ConfigMap, Secret, Service, ServiceAccount};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use serde::Serialize;
use serde::de::DeserializeOwned;

/// The chart, relative to the repository root.
pub const CHART: &str = "deploy/helm/kvroute";
/// The release name and namespace the tests render with.
pub const RELEASE: &str = "kvroute";
/// See [`RELEASE`].
pub const NAMESPACE: &str = "llm";

/// The repository root (two levels above this crate).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// A Python with Helm's engine (`helm_python`): `KVROUTE_PYTHON` (set by `scripts/setup.sh`,
/// which `scripts/test.sh` runs), else the repository's `.venv`. `None` when neither has it;
/// under CI (`CI` set) that is a failure, since CI's setup installs it.
pub fn renderer() -> Option<PathBuf> {
    let candidates = std::env::var_os("KVROUTE_PYTHON")
        .map(PathBuf::from)
        .into_iter()
        .chain([repo_root().join(".venv/bin/python")]);
    for python in candidates {
        let works = Command::new(&python)
            .args(["-c", "import helm_python"])
            .output()
            .is_ok_and(|out| out.status.success());
        if works {
            return Some(python);
        }
    }
    assert!(
        std::env::var_os("CI").is_none(),
        "CI: no Python with helm_python (scripts/setup.sh installs helm-python-sdk)"
    );
    None
}

/// Renders the chart with these values files (relative to the repository root), as
/// `helm template kvroute deploy/helm/kvroute -n llm -f …` would.
pub fn render(python: &Path, values: &[&str]) -> Result<String, String> {
    let root = repo_root();
    let mut command = Command::new(python);
    command
        .current_dir(&root)
        .arg("scripts/helm-template.py")
        .arg(CHART)
        .args(["--name", RELEASE, "--namespace", NAMESPACE]);
    for file in values {
        command.arg("-f").arg(file);
    }
    let out = command
        .output()
        .map_err(|e| format!("cannot run {}: {e}", python.display()))?;
    if !out.status.success() {
        return Err(format!(
            "helm-template.py {values:?} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    String::from_utf8(out.stdout).map_err(|e| e.to_string())
}

/// One rendered document: its template, the document as written, and the typed object.
#[derive(Debug, Clone)]
pub struct Doc {
    /// The template it came from (`# Source:`), or where else it was read.
    pub source: String,
    /// The document as written, as JSON.
    pub value: serde_json::Value,
    /// The same document, typed.
    pub object: Object,
}

impl Doc {
    /// `kind` as written.
    pub fn kind(&self) -> &str {
        self.value["kind"].as_str().unwrap_or_default()
    }

    /// `metadata.name` as written.
    pub fn name(&self) -> &str {
        self.value["metadata"]["name"].as_str().unwrap_or_default()
    }
}

/// Every kind the install contains.
#[derive(Debug, Clone)]
#[allow(missing_docs)]
pub enum Object {
    ServiceAccount(Box<ServiceAccount>),
    Secret(Box<Secret>),
    ConfigMap(Box<ConfigMap>),
    Service(Box<Service>),
    Role(Box<Role>),
    RoleBinding(Box<RoleBinding>),
    Deployment(Box<Deployment>),
    StatefulSet(Box<StatefulSet>),
    DaemonSet(Box<DaemonSet>),
    PodDisruptionBudget(Box<PodDisruptionBudget>),
    InferencePool(Box<crd::InferencePool>),
    HttpRoute(Box<crd::HttpRoute>),
    AiGatewayRoute(Box<crd::AiGatewayRoute>),
}

/// Reads a YAML stream (`---`-separated, `# Source:` comments as `helm template` writes them):
/// every document typed and round-tripped, or an error naming the document and the fields lost.
pub fn parse_stream(text: &str) -> Result<Vec<Doc>, String> {
    let mut docs = Vec::new();
    for (i, part) in text.split("\n---").enumerate() {
        let part = part.trim_start_matches("---");
        if part
            .lines()
            .all(|l| l.trim().is_empty() || l.trim_start().starts_with('#'))
        {
            continue;
        }
        let source = part
            .lines()
            .find_map(|l| l.strip_prefix("# Source: "))
            .map_or_else(|| format!("document {i}"), str::to_owned);
        let value: serde_json::Value =
            serde_yaml::from_str(part).map_err(|e| format!("{source}: not YAML: {e}"))?;
        let object = typed(&value).map_err(|e| format!("{source}: {e}"))?;
        docs.push(Doc {
            source,
            value,
            object,
        });
    }
    Ok(docs)
}

/// The document as the type its `apiVersion`/`kind` names.
pub fn typed(value: &serde_json::Value) -> Result<Object, String> {
    let api_version = value["apiVersion"].as_str().unwrap_or_default();
    let kind = value["kind"].as_str().unwrap_or_default();
    Ok(match (api_version, kind) {
        ("v1", "ServiceAccount") => Object::ServiceAccount(round_trip(value)?),
        ("v1", "Secret") => Object::Secret(round_trip(value)?),
        ("v1", "ConfigMap") => Object::ConfigMap(round_trip(value)?),
        ("v1", "Service") => Object::Service(round_trip(value)?),
        ("rbac.authorization.k8s.io/v1", "Role") => Object::Role(round_trip(value)?),
        ("rbac.authorization.k8s.io/v1", "RoleBinding") => Object::RoleBinding(round_trip(value)?),
        ("apps/v1", "Deployment") => Object::Deployment(round_trip(value)?),
        ("apps/v1", "StatefulSet") => Object::StatefulSet(round_trip(value)?),
        ("apps/v1", "DaemonSet") => Object::DaemonSet(round_trip(value)?),
        ("policy/v1", "PodDisruptionBudget") => Object::PodDisruptionBudget(round_trip(value)?),
        (crd::INFERENCE_POOL_API_VERSION, "InferencePool") => {
            Object::InferencePool(round_trip(value)?)
        }
        (crd::GATEWAY_API_VERSION, "HTTPRoute") => Object::HttpRoute(round_trip(value)?),
        (crd::AI_GATEWAY_API_VERSION, "AIGatewayRoute") => {
            Object::AiGatewayRoute(round_trip(value)?)
        }
        _ => {
            return Err(format!(
                "no type for apiVersion {api_version:?} kind {kind:?}"
            ));
        }
    })
}

/// Deserializes into `T` and back; every difference between the two is an error.
fn round_trip<T: DeserializeOwned + Serialize>(
    value: &serde_json::Value,
) -> Result<Box<T>, String> {
    let typed: T = serde_json::from_value(value.clone()).map_err(|e| e.to_string())?;
    let back = serde_json::to_value(&typed).map_err(|e| e.to_string())?;
    let mut differences = Vec::new();
    diff(value, &back, String::new(), &mut differences);
    if differences.is_empty() {
        Ok(Box::new(typed))
    } else {
        Err(format!(
            "fields the type does not keep (misspelled or misplaced?): {}",
            differences.join(", ")
        ))
    }
}

/// JSON-pointer paths where `written` and `kept` differ.
fn diff(
    written: &serde_json::Value,
    kept: &serde_json::Value,
    path: String,
    out: &mut Vec<String>,
) {
    use serde_json::Value;
    match (written, kept) {
        (Value::Object(a), Value::Object(b)) => {
            for (key, value) in a {
                let here = format!("{path}/{key}");
                match b.get(key) {
                    Some(other) => diff(value, other, here, out),
                    None => out.push(format!("{here} (lost)")),
                }
            }
            for key in b.keys().filter(|k| !a.contains_key(*k)) {
                out.push(format!("{path}/{key} (added)"));
            }
        }
        (Value::Array(a), Value::Array(b)) if a.len() == b.len() => {
            for (i, (x, y)) in a.iter().zip(b).enumerate() {
                diff(x, y, format!("{path}/{i}"), out);
            }
        }
        (a, b) if a == b => {}
        // A number written as a float that the type holds as an integer is the same number.
        (Value::Number(a), Value::Number(b)) if a.as_f64() == b.as_f64() => {}
        (a, b) => out.push(format!("{path} ({a} became {b})")),
    }
}
