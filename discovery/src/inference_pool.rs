//! The Gateway API Inference Extension's `InferencePool` (group `inference.networking.k8s.io`,
//! version `v1`), as far as discovery reads it: `spec.selector.matchLabels` and
//! `spec.targetPorts[].number`. Every other field (`endpointPickerRef`, `status`) is ignored, so
//! a pool written for any EPP is read unchanged.

use std::borrow::Cow;
use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::core::NamespaceResourceScope;
use serde::{Deserialize, Serialize};

/// API group.
pub const GROUP: &str = "inference.networking.k8s.io";
/// API version.
pub const VERSION: &str = "v1";
/// Kind.
pub const KIND: &str = "InferencePool";
/// Resource (plural).
pub const PLURAL: &str = "inferencepools";

/// An InferencePool object.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct InferencePool {
    /// Standard object metadata.
    #[serde(default)]
    pub metadata: ObjectMeta,
    /// The spec (absent on a malformed object: then it selects nothing).
    #[serde(default)]
    pub spec: Option<InferencePoolSpec>,
}

/// `spec`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct InferencePoolSpec {
    /// Which pods are members (same namespace).
    #[serde(default)]
    pub selector: LabelSelector,
    /// The ports of each member pod, one per data-parallel rank.
    #[serde(default)]
    pub target_ports: Vec<Port>,
}

/// GIE's `LabelSelector`: `matchLabels` only (Service-selector compatible by design).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LabelSelector {
    /// Labels a member must carry.
    #[serde(default)]
    pub match_labels: BTreeMap<String, String>,
}

/// One of `targetPorts`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Port {
    /// The port number (1–65535; anything else makes the pool invalid).
    #[serde(default)]
    pub number: i64,
}

impl kube::Resource for InferencePool {
    type DynamicType = ();
    type Scope = NamespaceResourceScope;

    fn kind(_: &()) -> Cow<'_, str> {
        KIND.into()
    }

    fn group(_: &()) -> Cow<'_, str> {
        GROUP.into()
    }

    fn version(_: &()) -> Cow<'_, str> {
        VERSION.into()
    }

    fn plural(_: &()) -> Cow<'_, str> {
        PLURAL.into()
    }

    fn meta(&self) -> &ObjectMeta {
        &self.metadata
    }

    fn meta_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

/// What discovery takes from a pool: its selector and ports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PoolSelection {
    pub(crate) labels: BTreeMap<String, String>,
    pub(crate) ports: Vec<u16>,
}

/// Why a pool's spec selects nothing (a metric label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum InvalidPool {
    NoSpec,
    EmptySelector,
    NoTargetPorts,
    BadPort,
}

impl InvalidPool {
    pub(crate) fn as_label(self) -> &'static str {
        match self {
            Self::NoSpec => "no_spec",
            Self::EmptySelector => "empty_selector",
            Self::NoTargetPorts => "no_target_ports",
            Self::BadPort => "bad_port",
        }
    }
}

impl InferencePool {
    /// The selector and ports, or why the pool is unusable.
    pub(crate) fn selection(&self) -> Result<PoolSelection, InvalidPool> {
        let spec = self.spec.as_ref().ok_or(InvalidPool::NoSpec)?;
        if spec.selector.match_labels.is_empty() {
            return Err(InvalidPool::EmptySelector);
        }
        if spec.target_ports.is_empty() {
            return Err(InvalidPool::NoTargetPorts);
        }
        let ports = spec
            .target_ports
            .iter()
            .map(|p| u16::try_from(p.number).ok().filter(|&n| n != 0))
            .collect::<Option<Vec<u16>>>()
            .ok_or(InvalidPool::BadPort)?;
        Ok(PoolSelection {
            labels: spec.selector.match_labels.clone(),
            ports,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_a_gie_v1_pool_and_ignores_the_rest() {
        let pool: InferencePool = serde_json::from_value(serde_json::json!({
            "apiVersion": "inference.networking.k8s.io/v1",
            "kind": "InferencePool",
            "metadata": {"name": "llama", "namespace": "llm", "resourceVersion": "7"},
            "spec": {
                "selector": {"matchLabels": {"app": "vllm-llama"}},
                "targetPorts": [{"number": 8000}, {"number": 8001}],
                "endpointPickerRef": {"name": "kvroute-ext-proc", "portNumber": 9002, "failureMode": "FailOpen"}
            },
            "status": {"parents": []}
        }))
        .unwrap();
        let selection = pool.selection().unwrap();
        assert_eq!(selection.ports, vec![8000, 8001]);
        assert_eq!(selection.labels["app"], "vllm-llama");
        assert_eq!(
            <InferencePool as kube::Resource>::url_path(&(), Some("llm")),
            "/apis/inference.networking.k8s.io/v1/namespaces/llm/inferencepools"
        );
    }

    #[test]
    fn an_unusable_spec_says_why() {
        let pool = |spec: serde_json::Value| -> InferencePool {
            serde_json::from_value(serde_json::json!({"metadata": {"name": "p"}, "spec": spec}))
                .unwrap()
        };
        assert_eq!(
            pool(serde_json::json!({"targetPorts": [{"number": 1}]})).selection(),
            Err(InvalidPool::EmptySelector)
        );
        assert_eq!(
            pool(serde_json::json!({"selector": {"matchLabels": {"a": "b"}}})).selection(),
            Err(InvalidPool::NoTargetPorts)
        );
        assert_eq!(
            pool(serde_json::json!({"selector": {"matchLabels": {"a": "b"}}, "targetPorts": [{"number": 70000}]}))
                .selection(),
            Err(InvalidPool::BadPort)
        );
    }
}
