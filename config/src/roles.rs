//! Replica roles in prefill/decode disaggregation: one vocabulary for static config (ext-proc's
//! `replicas[].role`) and discovery (llm-d's `llm-d.ai/role` pod label).

/// A replica's part in prefill/decode disaggregation (llm-d's `llm-d.ai/role` pod label).
#[derive(
    Debug,
    Clone,
    Copy,
    Default,
    PartialEq,
    Eq,
    serde::Deserialize,
    serde::Serialize,
    schemars::JsonSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// Serves whole requests, and either leg of a split one.
    #[default]
    Both,
    /// Only computes prompts for decode replicas (never a request's destination).
    Prefill,
    /// Serves requests, pulling a split prompt's KV from a prefill replica.
    Decode,
}

impl Role {
    /// Config value and label.
    pub fn as_label(self) -> &'static str {
        match self {
            Self::Both => "both",
            Self::Prefill => "prefill",
            Self::Decode => "decode",
        }
    }

    /// Whether a request may be sent here (every role but `prefill`).
    pub fn decodes(self) -> bool {
        self != Self::Prefill
    }

    /// Whether a split request's prompt may be computed here (every role but `decode`).
    pub fn prefills(self) -> bool {
        self != Self::Decode
    }
}

impl Role {
    /// The role a pod's `llm-d.ai/role` label names (llm-d's values: `prefill`, `decode`,
    /// `prefill-decode`; `both` too); `None` for a value that is none of them (llm-d's
    /// `encode` pods, a typo): such a pod is no replica kvroute routes to.
    pub fn from_pod_label(value: &str) -> Option<Self> {
        match value.trim() {
            "prefill" => Some(Self::Prefill),
            "decode" => Some(Self::Decode),
            "prefill-decode" | "both" => Some(Self::Both),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pod_labels_name_llm_ds_roles() {
        assert_eq!(Role::from_pod_label("prefill"), Some(Role::Prefill));
        assert_eq!(Role::from_pod_label("decode"), Some(Role::Decode));
        assert_eq!(Role::from_pod_label("prefill-decode"), Some(Role::Both));
        assert_eq!(Role::from_pod_label("encode"), None);
        assert!(Role::Both.decodes() && Role::Both.prefills());
        assert!(!Role::Prefill.decodes() && !Role::Decode.prefills());
    }
}
