//! The operator's check: what kvroute computes for one request body (`kvroute-check`).
//!
//! [`check`] runs a body through the same code a decision does — [`request::parse`], the pool
//! lookup ([`Config::pool_for_model`]), the tokenizer a pool's source builds
//! ([`tokenizer::from_source`]), the token cache's path to it ([`TokenCache::tokens`], with a
//! fresh cache so the whole prompt is tokenized) and the pool's block keys
//! ([`Pool::prompt_keys`], LoRA and `cache_salt` extras included) — and returns a [`Report`]
//! to diff against an engine's `/tokenize` or `/render` and its KV events. It stops before the
//! index: nothing is asked of any replica.
//!
//! The pool comes from an ext-proc config ([`Target::Config`]) or, for a bare model folder, from
//! a one-pool config built from ext-proc's own pool keys and defaults ([`ModelDirPool`]).
//!
//! [`cli`] is the `kvroute-check` command around it.
//!
//! [`request::parse`]: crate::request::parse
//! [`Pool::prompt_keys`]: crate::config::Pool::prompt_keys

pub mod cli;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use kvroute_block_keys::{KeyError, KeyScheme};
use serde::Serialize;
use tokio_util::task::TaskTracker;

use crate::config::{Config, TokenizerSource};
use crate::error::{RequestError, TokenizeError};
use crate::request::{self, Endpoint};
use crate::tokenizer::{self, TokenCache, TokenLimits, TokenSource, TokenizerMode};
use kvroute_config::ConfigError;

/// How long the check waits for tokens. Far above a decision's budget: the check reports the
/// tokens and how long they took (against `budgets.tokenize`) rather than falling back.
pub const CHECK_TOKENIZE_BUDGET: Duration = Duration::from_secs(120);
/// Block size of a [`ModelDirPool`] when none is given (vLLM's default).
pub const DEFAULT_CHECK_BLOCK_SIZE: u32 = 16;

/// Name of the pool a [`ModelDirPool`] builds.
const MODEL_DIR_POOL: &str = "model-dir";

/// Where the check takes its pool from.
#[derive(Debug, Clone, Copy)]
pub enum Target<'a> {
    /// An ext-proc config: the pool serving the model, as ext-proc finds it.
    Config(&'a Config),
    /// A model folder with the pool settings given on the command line.
    ModelDir(&'a ModelDirPool),
}

/// A pool served from one HF model folder, in ext-proc's `pools[]` terms.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelDirPool {
    /// The folder (`tokenizer.json`, `tokenizer_config.json`).
    pub model_dir: PathBuf,
    /// `block_size`.
    pub block_size: u32,
    /// `key_scheme.kind` (`vllm-exact` when `None`).
    pub key_kind: Option<String>,
    /// `key_scheme.hash_algo` (vLLM's default `sha256` when `None`).
    pub hash_algo: Option<String>,
    /// `key_scheme.seed`, the engines' `PYTHONHASHSEED`.
    pub seed: Option<String>,
    /// `key_scheme.vllm_version`.
    pub vllm_version: Option<String>,
}

impl ModelDirPool {
    /// A validated ext-proc config with one pool serving `model` from the folder, built by
    /// [`Config::from_yaml`] so every key is checked and defaulted as ext-proc does. Its one
    /// replica is a placeholder the check never contacts.
    pub fn config(&self, model: &str) -> Result<Config, ConfigError> {
        let mut key_scheme = serde_json::Map::new();
        for (key, value) in [
            ("kind", &self.key_kind),
            ("hash_algo", &self.hash_algo),
            ("seed", &self.seed),
            ("vllm_version", &self.vllm_version),
        ] {
            if let Some(value) = value {
                key_scheme.insert(key.to_owned(), value.clone().into());
            }
        }
        // JSON is YAML: no quoting of paths or names to get wrong.
        let yaml = serde_json::json!({
            "pools": [{
                "name": MODEL_DIR_POOL,
                "models": [model],
                "block_size": self.block_size,
                "key_scheme": key_scheme,
                "tokenizer": {"model_dir": self.model_dir},
            }],
            "replicas": [{"id": "check", "pool": MODEL_DIR_POOL, "address": "127.0.0.1:9"}],
        });
        Config::from_yaml(&yaml.to_string())
    }
}

/// Why a body could not be checked.
#[derive(Debug, thiserror::Error)]
pub enum CheckError {
    /// The path is not an endpoint kvroute tokenizes.
    #[error(
        "{path}: kvroute does not tokenize this endpoint (only /v1/completions, /v1/chat/completions, /v1/responses and /v1/messages); it routes such requests on load"
    )]
    UnsupportedEndpoint {
        /// The path as given.
        path: String,
    },
    /// The body is not a request ext-proc accepts.
    #[error("the request body is refused")]
    Body(#[source] RequestError),
    /// The config (or the pool built for a model folder) is invalid.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// No pool serves the model.
    #[error("no pool serves model {model:?} (neither a model nor an adapter of any pool)")]
    UnknownModel {
        /// The model name.
        model: String,
    },
    /// The model's pool has no tokenizer: ext-proc routes its requests on load.
    #[error("pool {pool:?} has no tokenizer: its requests route on load")]
    NoTokenizer {
        /// The pool name.
        pool: String,
    },
    /// Tokenization failed (ext-proc falls back to load for this request).
    #[error("tokenization failed; ext-proc routes this request on load")]
    Tokenize(#[source] TokenizeError),
    /// The block keys could not be computed (ext-proc falls back to load).
    #[error("block keys failed; ext-proc routes this request on load")]
    Keys(#[source] KeyError),
}

impl CheckError {
    /// Log label.
    pub fn as_label(&self) -> &'static str {
        match self {
            Self::UnsupportedEndpoint { .. } => "unsupported_endpoint",
            Self::Body(_) => "body",
            Self::Config(_) => "config",
            Self::UnknownModel { .. } => "unknown_model",
            Self::NoTokenizer { .. } => "no_tokenizer",
            Self::Tokenize(_) => "tokenize",
            Self::Keys(_) => "keys",
        }
    }

    /// Whether the command line (path, config, model) is at fault rather than the body or
    /// the tokenizer.
    pub fn is_usage(&self) -> bool {
        matches!(
            self,
            Self::UnsupportedEndpoint { .. }
                | Self::Config(_)
                | Self::UnknownModel { .. }
                | Self::NoTokenizer { .. }
        )
    }
}

/// What kvroute computes for a request.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// `completions` or `chat_completions`.
    pub endpoint: &'static str,
    /// The model name the pool was found by.
    pub model: String,
    /// The pool's name.
    pub pool: String,
    /// The LoRA adapter, when the model names one.
    pub adapter: Option<AdapterReport>,
    /// The tokenizer used.
    pub tokenizer: TokenizerReport,
    /// `tokenizer`, or `client` when the request carried token ids.
    pub token_source: &'static str,
    /// Number of prompt tokens.
    pub token_count: usize,
    /// The prompt token ids.
    pub token_ids: Vec<u32>,
    /// The pool's KV block size.
    pub block_size: u32,
    /// How the block keys are hashed.
    pub key_scheme: KeySchemeReport,
    /// The request's `cache_salt` (an extra key of the first block).
    pub cache_salt: Option<String>,
    /// Number of full blocks (`token_count / block_size`): only they have keys.
    pub full_blocks: usize,
    /// The key of each full block, as the engine publishes it and the index stores it.
    pub block_keys: Vec<u64>,
}

/// A LoRA adapter as its extra keys use it.
#[derive(Debug, Clone, Serialize)]
pub struct AdapterReport {
    /// `lora_name`.
    pub name: String,
    /// `lora_int_id`.
    pub id: Option<i64>,
    /// `lora_path`.
    pub path: Option<String>,
}

/// The tokenizer a check used.
#[derive(Debug, Clone, Serialize)]
pub struct TokenizerReport {
    /// `in_process`, `remote`, or `none` (client token ids on a pool without a tokenizer).
    pub mode: &'static str,
    /// In process: `fast-byte-bpe` or `fast-sentencepiece-bpe` (kvroute's exact encoders) or `hf`
    /// (`tokenizers`).
    pub encoder: Option<&'static str>,
    /// In process: the model folder.
    pub model_dir: Option<PathBuf>,
    /// Remote: the `/tokenize` URL.
    pub url: Option<String>,
    /// How long tokenizing took (includes a remote call; excludes loading the folder).
    pub elapsed_ms: f64,
    /// ext-proc's `budgets.tokenize`: a decision taking longer routes on load.
    pub budget_ms: f64,
}

/// A pool's key scheme.
#[derive(Debug, Clone, Serialize)]
pub struct KeySchemeReport {
    /// `vllm-exact`, `sglang-exact` or `token-chain`.
    pub kind: &'static str,
    /// vLLM's `--prefix-caching-hash-algo`.
    pub hash_algo: Option<&'static str>,
    /// The `PYTHONHASHSEED` hashed into the root (vLLM's default when the pool names none).
    pub seed: Option<String>,
    /// Which vLLM releases' extra-key shapes (LoRA, `cache_salt`) apply.
    pub extra_keys_era: Option<String>,
}

impl KeySchemeReport {
    fn new(scheme: &KeyScheme) -> Self {
        match scheme {
            KeyScheme::VllmExact { hasher, era } => Self {
                kind: "vllm-exact",
                hash_algo: Some(hasher.algo().as_str()),
                seed: Some(hasher.seed().to_owned()),
                extra_keys_era: Some(format!("{era:?}")),
            },
            KeyScheme::SglangExact(_) => Self {
                kind: "sglang-exact",
                hash_algo: None,
                seed: None,
                extra_keys_era: None,
            },
            KeyScheme::TokenChain => Self {
                kind: "token-chain",
                hash_algo: None,
                seed: None,
                extra_keys_era: None,
            },
        }
    }
}

/// Checks `body`, sent to `path`, against `target`'s pool. `model` replaces the body's `model`
/// as the name the pool (and adapter) is found by. Tokenizer work runs on `tasks`.
pub async fn check(
    target: Target<'_>,
    path: &str,
    body: &[u8],
    model: Option<&str>,
    tasks: &TaskTracker,
) -> Result<Report, CheckError> {
    let endpoint = match Endpoint::from_path(path) {
        Endpoint::Other => {
            return Err(CheckError::UnsupportedEndpoint {
                path: path.to_owned(),
            });
        }
        endpoint => endpoint,
    };
    let parsed = request::parse(body, endpoint).map_err(CheckError::Body)?;
    let model = model.unwrap_or(parsed.model.as_ref());
    let built;
    let config = match target {
        Target::Config(config) => config,
        Target::ModelDir(pool) => {
            built = pool.config(model)?;
            &built
        }
    };
    let (pool_index, adapter) =
        config
            .pool_for_model(model)
            .ok_or_else(|| CheckError::UnknownModel {
                model: model.to_owned(),
            })?;
    let pool = &config.pools[pool_index];
    // A request naming no model is the pool's base model, as in a decision.
    let model = if model.is_empty() {
        pool.base_model(model)
    } else {
        model
    };
    // Client token ids need no tokenizer, as in a decision.
    let tokenizer = tokenizer::from_source(&pool.tokenizer, pool.engine, pool_index, tasks)?;
    let started = Instant::now();
    let tokens = TokenCache::new(TokenLimits::from_config(config), tasks.clone())
        .tokens(
            pool_index,
            model,
            &parsed.prompt,
            tokenizer.as_ref(),
            CHECK_TOKENIZE_BUDGET,
        )
        .await
        .map_err(|e| match e {
            TokenizeError::NotConfigured { .. } => CheckError::NoTokenizer {
                pool: pool.name.clone(),
            },
            e => CheckError::Tokenize(e),
        })?;
    let elapsed = started.elapsed();
    let cache_salt = parsed.cache_salt.as_deref();
    let block_keys = pool
        .media_prompt_keys(
            &tokens.tokens,
            adapter,
            cache_salt,
            &tokenizer::block_key_items(tokens.multimodal.as_deref()),
        )
        .map_err(CheckError::Keys)?;
    let mode = tokenizer.as_ref().map(|t| t.mode());
    let (model_dir, url) = match &pool.tokenizer {
        TokenizerSource::ModelDir(dir) => (Some(dir.clone()), None),
        TokenizerSource::Remote { url, .. } | TokenizerSource::Render { url, .. } => {
            (None, Some(url.to_string()))
        }
        TokenizerSource::None => (None, None),
    };
    Ok(Report {
        endpoint: match endpoint {
            Endpoint::ChatCompletions => "chat_completions",
            Endpoint::Responses => "responses",
            Endpoint::Messages => "messages",
            _ => "completions",
        },
        model: model.to_owned(),
        pool: pool.name.clone(),
        adapter: adapter.map(|a| AdapterReport {
            name: a.name.clone(),
            id: a.id,
            path: a.path.clone(),
        }),
        tokenizer: TokenizerReport {
            mode: mode.map_or("none", TokenizerMode::location),
            encoder: mode.and_then(TokenizerMode::encoder),
            model_dir,
            url,
            elapsed_ms: elapsed.as_secs_f64() * 1e3,
            budget_ms: config.tokenize_budget.as_secs_f64() * 1e3,
        },
        token_source: match tokens.source {
            TokenSource::Client => "client",
            _ => "tokenizer",
        },
        token_count: tokens.tokens.len(),
        token_ids: tokens.tokens.to_vec(),
        block_size: pool.block_size,
        key_scheme: KeySchemeReport::new(&pool.key_scheme),
        cache_salt: cache_salt.map(str::to_owned),
        full_blocks: block_keys.len(),
        block_keys,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const TINY: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/fixtures/tiny-model");

    fn tiny(block_size: u32) -> ModelDirPool {
        ModelDirPool {
            model_dir: TINY.into(),
            block_size,
            key_kind: None,
            hash_algo: None,
            seed: Some("0".to_owned()),
            vllm_version: None,
        }
    }

    #[tokio::test]
    async fn responses_and_messages_are_checked_as_their_chat() {
        let mut reports = Vec::new();
        for (path, body) in [
            ("/v1/responses", &br#"{"model":"m","instructions":"s","input":"hi"}"#[..]),
            (
                "/v1/messages",
                br#"{"model":"m","max_tokens":4,"system":"s","messages":[{"role":"user","content":"hi"}]}"#,
            ),
            (
                "/v1/chat/completions",
                br#"{"model":"m","messages":[{"role":"system","content":"s"},{"role":"user","content":"hi"}]}"#,
            ),
            // vLLM encodes a Responses prompt with add_special_tokens (a chat's default is off).
            (
                "/v1/chat/completions",
                br#"{"model":"m","add_special_tokens":true,"messages":[{"role":"system","content":"s"},{"role":"user","content":"hi"}]}"#,
            ),
        ] {
            let report = check(Target::ModelDir(&tiny(4)), path, body, None, &TaskTracker::new())
                .await
                .unwrap();
            reports.push((report.endpoint, report.token_ids));
        }
        assert_eq!(reports[0].0, "responses");
        assert_eq!(reports[1].0, "messages");
        assert_eq!(reports[0].1, reports[3].1);
        assert_eq!(reports[1].1, reports[2].1);
    }

    #[tokio::test]
    async fn other_endpoints_are_refused_by_name() {
        let error = check(
            Target::ModelDir(&tiny(4)),
            "/v1/embeddings",
            br#"{"model":"m","input":"hi"}"#,
            None,
            &TaskTracker::new(),
        )
        .await
        .unwrap_err();
        assert!(error.is_usage(), "{error}");
        assert!(error.to_string().contains("/v1/embeddings"), "{error}");
    }

    #[tokio::test]
    async fn a_bad_model_dir_pool_names_the_field() {
        let mut pool = tiny(4);
        pool.hash_algo = Some("md5".to_owned());
        let error = check(
            Target::ModelDir(&pool),
            "/v1/completions",
            br#"{"model":"m","prompt":"hi"}"#,
            None,
            &TaskTracker::new(),
        )
        .await
        .unwrap_err();
        assert!(
            error.to_string().contains("key_scheme.hash_algo"),
            "{error}"
        );
    }

    #[tokio::test]
    async fn client_token_ids_are_keyed_as_sent() {
        let report = check(
            Target::ModelDir(&tiny(2)),
            "/v1/completions",
            br#"{"model":"m","prompt":[5,6,7,8,9]}"#,
            None,
            &TaskTracker::new(),
        )
        .await
        .unwrap();
        assert_eq!(report.token_ids, [5, 6, 7, 8, 9]);
        assert_eq!(report.token_source, "client");
        assert_eq!(report.full_blocks, 2);
        assert_eq!(report.block_keys.len(), 2);
        assert_eq!(report.key_scheme.hash_algo, Some("sha256"));
    }
}
