//! Where kvroute's tests find their data (feature `test-util`, for dev-dependencies only).
//!
//! Two sources:
//! - the project's own fixtures under `tests/fixtures/` ([`fixture`]): committed, always there;
//! - third-party data in the shared folder beside the workspace ([`shared_file`]): llm-d's
//!   published captures, the synthetic trace, the reference golden vectors. It is never copied
//!   into the repository, so a clone alone lacks it. `KVROUTE_SHARED` names the folder (a path
//!   that does not exist means "absent"); unset, it is `<workspace>/../shared`.
//!
//! A test that needs shared data returns early when it is absent, saying so on stderr:
//!
//! ```no_run
//! let Some(path) = kvroute_block_keys::testing::shared_file("my_test", "vllm/golden_vectors.json")
//! else {
//!     return;
//! };
//! # let _ = path;
//! ```

use std::path::{Path, PathBuf};

/// The environment variable naming the shared folder.
pub const SHARED_ENV: &str = "KVROUTE_SHARED";

/// The workspace root (this crate lives one level below it).
pub fn workspace_root() -> PathBuf {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    manifest.parent().unwrap_or(manifest).to_path_buf()
}

/// A file of the project's own fixtures: `tests/fixtures/<rel>`.
pub fn fixture(rel: &str) -> PathBuf {
    workspace_root().join("tests/fixtures").join(rel)
}

/// The shared folder, when it exists: `$KVROUTE_SHARED`, else `<workspace>/../shared`.
pub fn shared_dir() -> Option<PathBuf> {
    let dir = std::env::var_os(SHARED_ENV)
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            let root = workspace_root();
            root.parent().unwrap_or(&root).join("shared")
        });
    dir.is_dir().then_some(dir)
}

/// `<shared>/<rel>` when it exists; otherwise prints
/// `SKIP <test>: <rel> not found (...)` to stderr and returns `None`, and the caller returns.
pub fn shared_file(test: &str, rel: &str) -> Option<PathBuf> {
    let path = shared_dir().map(|dir| dir.join(rel)).filter(|p| p.exists());
    if path.is_none() {
        #[allow(
            clippy::print_stderr,
            reason = "the skip notice is for the person running the tests"
        )]
        {
            eprintln!(
                "SKIP {test}: {rel} not found (third-party data from ../shared; set {SHARED_ENV})"
            );
        }
    }
    path
}
