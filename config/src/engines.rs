//! Engine families: one vocabulary for every config that names what serves a replica (ext-proc's
//! pools and replicas, the index's and the agent's event sources) and for discovery (the pod
//! annotation `kvroute.io/engine`).
//!
//! The family decides how a replica's KV-cache events are encoded (vLLM's or SGLang's wire
//! format), which block hash it publishes, and which metric names carry its load.

/// The inference engine serving a replica: its KV events' wire format and hashing differ, so the
/// decoder is chosen by configuration, never guessed per message.
#[derive(
    Debug,
    Clone,
    Copy,
    Default,
    PartialEq,
    Eq,
    Hash,
    serde::Deserialize,
    serde::Serialize,
    schemars::JsonSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum Engine {
    /// vLLM (and its derivatives publishing vLLM's events and metrics).
    #[default]
    Vllm,
    /// SGLang (`--kv-events-config '{"publisher": "zmq", ...}'`, `--enable-metrics`).
    Sglang,
}

impl Engine {
    /// Config value and metric label.
    pub fn as_label(self) -> &'static str {
        match self {
            Self::Vllm => "vllm",
            Self::Sglang => "sglang",
        }
    }

    /// The family a pod annotation names (`vllm`, `sglang`); `None` for anything else, which
    /// refuses the pod rather than guessing its wire format.
    pub fn from_annotation(value: &str) -> Option<Self> {
        match value.trim() {
            "vllm" => Some(Self::Vllm),
            "sglang" => Some(Self::Sglang),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn annotation_values_name_a_family_or_nothing() {
        assert_eq!(Engine::from_annotation("sglang"), Some(Engine::Sglang));
        assert_eq!(Engine::from_annotation(" vllm "), Some(Engine::Vllm));
        assert_eq!(Engine::from_annotation("trtllm"), None);
        assert_eq!(Engine::default().as_label(), "vllm");
    }
}
