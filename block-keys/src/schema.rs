//! The pool key settings as configuration files write them: one schema and one set of defaults
//! for every kvroute component (ext-proc, kvroute-index), so a pool's `block_size` and
//! `key_scheme` pasted into either config mean the same keys (reference:
//! `docs/configuration.md`).

use std::fmt;

use serde::Deserialize;
use serde::de::{self, MapAccess, Visitor};

use crate::{ExtraKeysEra, HashAlgo, KeyScheme, SglangHasher, VllmHasher};

/// vLLM's default block size on GPUs (`block_size` when a pool does not say).
pub const DEFAULT_BLOCK_SIZE: u32 = 16;
/// Largest block size accepted (vLLM's are 16..=256 in practice).
pub const MAX_BLOCK_SIZE: u32 = 4096;
/// vLLM's default `--prefix-caching-hash-algo` (0.10.2 and later, 0.32 included).
pub const DEFAULT_HASH_ALGO: HashAlgo = HashAlgo::Sha256;
/// `key_scheme.kind` when a pool does not say: keys are the engines' own block hashes.
pub const DEFAULT_KEY_SCHEME_KIND: &str = "vllm-exact";
/// vLLM release assumed for extra-key shapes when a pool does not say: the one kvroute is tested
/// against.
pub const DEFAULT_VLLM_VERSION: &str = "0.32.0";

/// `key_scheme:` as written: a mapping (unknown keys rejected). The older index spelling
/// `key_scheme: vllm-exact` (a bare string) is rejected with the new form in the message.
#[derive(Debug, Default, Clone, PartialEq, Eq, schemars::JsonSchema)]
#[schemars(deny_unknown_fields)]
pub struct RawKeyScheme {
    /// `vllm-exact` (keys are vLLM engines' own block hashes), `sglang-exact` (SGLang engines'
    /// own page hashes; the pool's `block_size` is their `--page-size`; LoRA requests are not
    /// reproduced, use token-chain for pools with adapters) or `token-chain`
    /// (kvroute's engine-agnostic keys computed from token ids, for either engine).
    #[schemars(extend("default" = DEFAULT_KEY_SCHEME_KIND))]
    pub kind: Option<String>,
    /// vllm-exact: the engines' `--prefix-caching-hash-algo` (`sha256`, `sha256_cbor`,
    /// `sha256_cbor_64bit`, `xxhash`, `xxhash_cbor`).
    #[schemars(extend("default" = DEFAULT_HASH_ALGO.as_str()))]
    pub hash_algo: Option<String>,
    /// vllm-exact: the engines' `PYTHONHASHSEED`, as text; omit it when unset (required with
    /// the xxhash algorithms, which vLLM seeds randomly otherwise).
    pub seed: Option<String>,
    /// vllm-exact: the engines' vLLM release, e.g. `0.32.0`: how LoRA and `cache_salt` enter
    /// keys.
    #[schemars(extend("default" = DEFAULT_VLLM_VERSION))]
    pub vllm_version: Option<String>,
    /// sglang-exact: the engines' `--kv-events-config` `format`: `default`, or `dynamo`
    /// (SGLang 0.5.22+), which also namespaces a salted request's hashes by its salt.
    #[schemars(extend("default" = "default"))]
    pub kv_events_format: Option<String>,
    /// sglang-exact: the engines run EAGLE-family speculative decoding, so SGLang keys its cache
    /// by token pairs (a page then also hashes the token after it).
    #[schemars(extend("default" = false))]
    pub bigram_keys: Option<bool>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct KeySchemeFields {
    #[serde(default)]
    kind: Option<String>,
    #[serde(default)]
    hash_algo: Option<String>,
    #[serde(default)]
    seed: Option<String>,
    #[serde(default)]
    vllm_version: Option<String>,
    #[serde(default)]
    kv_events_format: Option<String>,
    #[serde(default)]
    bigram_keys: Option<bool>,
}

impl<'de> Deserialize<'de> for RawKeyScheme {
    fn deserialize<D: de::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct SchemeVisitor;

        impl<'de> Visitor<'de> for SchemeVisitor {
            type Value = RawKeyScheme;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(
                    "a mapping {kind, hash_algo, seed, vllm_version, kv_events_format, bigram_keys}",
                )
            }

            fn visit_str<E: de::Error>(self, kind: &str) -> Result<Self::Value, E> {
                Err(E::custom(format!(
                    "`key_scheme: {kind}` is now `key_scheme: {{kind: {kind}}}` \
                     (with hash_algo, seed and vllm_version beside kind)"
                )))
            }

            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
                let fields =
                    KeySchemeFields::deserialize(de::value::MapAccessDeserializer::new(map))?;
                Ok(RawKeyScheme {
                    kind: fields.kind,
                    hash_algo: fields.hash_algo,
                    seed: fields.seed,
                    vllm_version: fields.vllm_version,
                    kv_events_format: fields.kv_events_format,
                    bigram_keys: fields.bigram_keys,
                })
            }
        }

        deserializer.deserialize_any(SchemeVisitor)
    }
}

/// A pool key setting that cannot be used. `field` is relative to the pool (`block_size`,
/// `key_scheme.seed`, …); each component prefixes its own path (`pools[2].`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid value for `{field}`: {value:?}: {reason}")]
pub struct SchemeConfigError {
    /// The key at fault, relative to the pool.
    pub field: &'static str,
    /// The value as written (`<unset>` when absent).
    pub value: String,
    /// Why it is rejected.
    pub reason: String,
}

impl SchemeConfigError {
    fn new(field: &'static str, value: impl ToString, reason: impl ToString) -> Self {
        Self {
            field,
            value: value.to_string(),
            reason: reason.to_string(),
        }
    }
}

/// A pool's validated key settings: what every component computes and stores keys with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolKeySettings {
    /// Tokens per block (the engines' `--block-size`).
    pub block_size: u32,
    /// How prompts become keys.
    pub scheme: KeyScheme,
}

impl PoolKeySettings {
    /// Validates a pool's `block_size` and `key_scheme`, filling in the defaults.
    ///
    /// A vllm-exact scheme that cannot reproduce the engines' hashes is refused here (e.g.
    /// `xxhash` without a seed: vLLM then seeds each process randomly), rather than flagging
    /// every replica later.
    pub fn from_raw(
        block_size: Option<u32>,
        raw: &RawKeyScheme,
    ) -> Result<Self, SchemeConfigError> {
        let block_size = block_size.unwrap_or(DEFAULT_BLOCK_SIZE);
        if block_size == 0 || block_size > MAX_BLOCK_SIZE {
            return Err(SchemeConfigError::new(
                "block_size",
                block_size,
                format!("expected 1..={MAX_BLOCK_SIZE}"),
            ));
        }
        let vllm_fields = [
            ("key_scheme.hash_algo", &raw.hash_algo),
            ("key_scheme.seed", &raw.seed),
            ("key_scheme.vllm_version", &raw.vllm_version),
        ];
        let sglang_fields = [
            ("key_scheme.kv_events_format", &raw.kv_events_format),
            (
                "key_scheme.bigram_keys",
                &raw.bigram_keys.map(|b| b.to_string()),
            ),
        ];
        // Settings of another kind are a mistake, not something to ignore.
        let refuse_others = |fields: &[(&'static str, &Option<String>)], kind: &str| {
            fields
                .iter()
                .find_map(|(field, value)| value.as_ref().map(|value| (*field, value)))
                .map_or(Ok(()), |(field, value)| {
                    Err(SchemeConfigError::new(
                        field,
                        value,
                        format!("not used with `kind: {kind}`"),
                    ))
                })
        };
        let scheme = match raw.kind.as_deref() {
            None => {
                refuse_others(&sglang_fields, DEFAULT_KEY_SCHEME_KIND)?;
                Self::vllm_exact(raw)?
            }
            Some(kind) if kind == DEFAULT_KEY_SCHEME_KIND => {
                refuse_others(&sglang_fields, kind)?;
                Self::vllm_exact(raw)?
            }
            Some(kind @ "sglang-exact") => {
                refuse_others(&vllm_fields, kind)?;
                let dynamo_format = match raw.kv_events_format.as_deref() {
                    None | Some("default") => false,
                    Some("dynamo") => true,
                    Some(other) => {
                        return Err(SchemeConfigError::new(
                            "key_scheme.kv_events_format",
                            other,
                            "expected `default` or `dynamo`",
                        ));
                    }
                };
                KeyScheme::SglangExact(SglangHasher {
                    bigram: raw.bigram_keys.unwrap_or(false),
                    dynamo_format,
                })
            }
            Some(kind @ "token-chain") => {
                refuse_others(&vllm_fields, kind)?;
                refuse_others(&sglang_fields, kind)?;
                KeyScheme::TokenChain
            }
            Some(other) => {
                return Err(SchemeConfigError::new(
                    "key_scheme.kind",
                    other,
                    "expected `vllm-exact`, `sglang-exact` or `token-chain`",
                ));
            }
        };
        Ok(Self { block_size, scheme })
    }

    fn vllm_exact(raw: &RawKeyScheme) -> Result<KeyScheme, SchemeConfigError> {
        let algo = match raw.hash_algo.as_deref() {
            None => DEFAULT_HASH_ALGO,
            Some(name) => name.parse::<HashAlgo>().map_err(|error| {
                SchemeConfigError::new(
                    "key_scheme.hash_algo",
                    name,
                    format!(
                        "{error}; expected one of sha256, sha256_cbor, xxhash, xxhash_cbor, \
                         sha256_cbor_64bit, sha256_legacy_int"
                    ),
                )
            })?,
        };
        let hasher = VllmHasher::new(algo, raw.seed.as_deref()).map_err(|error| {
            SchemeConfigError::new(
                "key_scheme.seed",
                raw.seed.as_deref().unwrap_or("<unset>"),
                error,
            )
        })?;
        let version = raw.vllm_version.as_deref().unwrap_or(DEFAULT_VLLM_VERSION);
        let era = ExtraKeysEra::for_vllm_version(version).map_err(|_| {
            SchemeConfigError::new(
                "key_scheme.vllm_version",
                version,
                "expected a vLLM version such as 0.32.0",
            )
        })?;
        Ok(KeyScheme::VllmExact { hasher, era })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(yaml: &str) -> Result<PoolKeySettings, String> {
        #[derive(Deserialize)]
        #[serde(deny_unknown_fields)]
        struct Pool {
            block_size: Option<u32>,
            #[serde(default)]
            key_scheme: RawKeyScheme,
        }
        let pool: Pool = serde_json::from_str(yaml).map_err(|e| e.to_string())?;
        PoolKeySettings::from_raw(pool.block_size, &pool.key_scheme).map_err(|e| e.to_string())
    }

    #[test]
    fn defaults_are_vllm_0_32s() {
        let settings = parse("{}").unwrap();
        assert_eq!(settings.block_size, 16);
        let KeyScheme::VllmExact { hasher, era } = settings.scheme else {
            panic!("default kind is vllm-exact");
        };
        assert_eq!(hasher.algo(), HashAlgo::Sha256);
        // PYTHONHASHSEED unset: vLLM 0.29+'s fixed root for sha256.
        assert_eq!(hasher.seed(), crate::DEFAULT_NONE_HASH_SEED);
        assert_eq!(era, ExtraKeysEra::From0_31);
    }

    #[test]
    fn sglang_exact_reads_its_format_and_bigram_keys() {
        let plain = parse(r#"{"block_size": 32, "key_scheme": {"kind": "sglang-exact"}}"#).unwrap();
        assert_eq!(plain.block_size, 32);
        assert_eq!(
            plain.scheme,
            KeyScheme::SglangExact(SglangHasher::default())
        );
        let eagle = parse(
            r#"{"key_scheme": {"kind": "sglang-exact", "kv_events_format": "dynamo", "bigram_keys": true}}"#,
        )
        .unwrap();
        assert_eq!(
            eagle.scheme,
            KeyScheme::SglangExact(SglangHasher {
                bigram: true,
                dynamo_format: true,
            })
        );
    }

    #[test]
    fn bad_settings_name_their_key() {
        for (json, field) in [
            (r#"{"block_size": 0}"#, "`block_size`"),
            (r#"{"key_scheme": {"kind": "exact"}}"#, "`key_scheme.kind`"),
            (
                r#"{"key_scheme": {"hash_algo": "md5"}}"#,
                "`key_scheme.hash_algo`",
            ),
            (
                r#"{"key_scheme": {"hash_algo": "xxhash"}}"#,
                "`key_scheme.seed`",
            ),
            (
                r#"{"key_scheme": {"vllm_version": "banana"}}"#,
                "`key_scheme.vllm_version`",
            ),
            (
                r#"{"key_scheme": {"kind": "token-chain", "seed": "0"}}"#,
                "`key_scheme.seed`",
            ),
            (r#"{"key_scheme": {"hash_seed": "0"}}"#, "hash_seed"),
            (
                r#"{"key_scheme": {"kind": "sglang-exact", "seed": "0"}}"#,
                "`key_scheme.seed`",
            ),
            (
                r#"{"key_scheme": {"kind": "sglang-exact", "kv_events_format": "x"}}"#,
                "`key_scheme.kv_events_format`",
            ),
            (
                r#"{"key_scheme": {"bigram_keys": true}}"#,
                "`key_scheme.bigram_keys`",
            ),
            (
                r#"{"key_scheme": {"kind": "token-chain", "kv_events_format": "dynamo"}}"#,
                "`key_scheme.kv_events_format`",
            ),
            (
                r#"{"key_scheme": "vllm-exact"}"#,
                "is now `key_scheme: {kind: vllm-exact}`",
            ),
        ] {
            let error = parse(json).unwrap_err();
            assert!(error.contains(field), "{json}: {error}");
        }
    }
}
