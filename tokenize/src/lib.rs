//! Tokenizes prompts exactly as vLLM does, so block keys computed outside the engine equal its own.
//!
//! A model folder (Hugging Face layout) holds `tokenizer.json` and `tokenizer_config.json` (bos/eos
//! tokens and the Jinja chat template, or a separate `chat_template.jinja`). [`ModelTokenizer`]
//! loads it once — the tokenizer is parsed and the template compiled at load — and then:
//!
//! - [`ModelTokenizer::encode_prompt`]: what vLLM does for `/v1/completions` and `/tokenize
//!   {"prompt"}` (`add_special_tokens=true` by default, so a Llama-style post-processor adds bos);
//! - [`ModelTokenizer::encode_chat`]: what vLLM does for `/v1/chat/completions` and `/tokenize
//!   {"messages"}`: text content parts joined with `"\n"`, the chat template rendered with the
//!   context `transformers` gives it (`messages`, `add_generation_prompt`, the special tokens,
//!   `raise_exception`, a Python-style `tojson`, Python string methods), then encoded with
//!   `add_special_tokens=false` (the template writes bos itself).
//!
//! ```
//! # fn main() -> Result<(), kvroute_tokenize::TokenizeError> {
//! let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/fixtures/tiny-model");
//! let tokenizer = kvroute_tokenize::ModelTokenizer::from_dir(dir)?;
//! let prompt = tokenizer.encode_prompt("Hello world", true)?;
//! assert_eq!(prompt[0], 0); // <s>
//! let messages = serde_json::json!([{"role": "user", "content": "Hello world"}]);
//! let chat = tokenizer.encode_chat(&messages, true)?;
//! assert_eq!(chat[0], 0);
//! # Ok(())
//! # }
//! ```
#![deny(missing_docs)]

mod chat;
mod error;

use std::path::{Path, PathBuf};

pub use chat::ChatTemplate;
pub use error::TokenizeError;

/// A model's tokenizer and chat template, loaded once and shared (`Send + Sync`, `&self` calls).
#[derive(Debug)]
pub struct ModelTokenizer {
    tokenizer: tokenizers::Tokenizer,
    chat: Option<ChatTemplate>,
    eos_token_id: Option<u32>,
}

impl ModelTokenizer {
    /// Loads `tokenizer.json` and `tokenizer_config.json` (plus `chat_template.jinja` when the
    /// config has no template) from a Hugging Face model folder.
    pub fn from_dir(dir: impl AsRef<Path>) -> Result<Self, TokenizeError> {
        let dir = dir.as_ref();
        let tokenizer_json = read(&dir.join("tokenizer.json"))?;
        let config_path = dir.join("tokenizer_config.json");
        let config = match std::fs::read_to_string(&config_path) {
            Ok(text) => text,
            // Some folders ship only tokenizer.json: no template, no named special tokens.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => "{}".to_owned(),
            Err(source) => {
                return Err(TokenizeError::Io {
                    path: config_path,
                    source,
                });
            }
        };
        let template_path = dir.join("chat_template.jinja");
        let template_file = match std::fs::read_to_string(&template_path) {
            Ok(text) => Some(text),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(source) => {
                return Err(TokenizeError::Io {
                    path: template_path,
                    source,
                });
            }
        };
        Self::from_parts(&tokenizer_json, &config, template_file.as_deref())
    }

    /// Builds from file contents: `tokenizer.json` bytes, `tokenizer_config.json` text and an
    /// optional separate chat template (used only when the config has none).
    pub fn from_parts(
        tokenizer_json: &[u8],
        tokenizer_config: &str,
        chat_template_file: Option<&str>,
    ) -> Result<Self, TokenizeError> {
        let tokenizer = tokenizers::Tokenizer::from_bytes(tokenizer_json)
            .map_err(|source| TokenizeError::TokenizerJson { source })?;
        let config: serde_json::Value =
            serde_json::from_str(tokenizer_config).map_err(|e| TokenizeError::Config {
                field: "tokenizer_config.json",
                reason: e.to_string(),
            })?;
        let special = |name: &str| special_token(&config, name);
        let eos_token = special("eos_token");
        let eos_token_id = eos_token.as_deref().and_then(|t| tokenizer.token_to_id(t));
        let template_source =
            chat_template_source(&config)?.or(chat_template_file.map(str::to_owned));
        let chat = template_source
            .map(|source| {
                ChatTemplate::new(
                    source,
                    chat::SpecialTokens {
                        bos_token: special("bos_token"),
                        eos_token,
                        pad_token: special("pad_token"),
                        unk_token: special("unk_token"),
                    },
                )
            })
            .transpose()?;
        Ok(Self {
            tokenizer,
            chat,
            eos_token_id,
        })
    }

    /// Token ids of a completion prompt; `add_special_tokens` is vLLM's flag of the same name
    /// (default true for completions and `/tokenize {"prompt"}`).
    pub fn encode_prompt(
        &self,
        text: &str,
        add_special_tokens: bool,
    ) -> Result<Vec<u32>, TokenizeError> {
        let encoding = self
            .tokenizer
            .encode_fast(text, add_special_tokens)
            .map_err(|source| TokenizeError::Encode { source })?;
        Ok(encoding.get_ids().to_vec())
    }

    /// Renders OpenAI `messages` (a JSON array) with the chat template, as text.
    pub fn render_chat(
        &self,
        messages: &serde_json::Value,
        add_generation_prompt: bool,
    ) -> Result<String, TokenizeError> {
        let chat = self.chat.as_ref().ok_or(TokenizeError::NoChatTemplate)?;
        chat.render(messages, add_generation_prompt)
    }

    /// Token ids of a chat prompt: the rendered template encoded without special tokens.
    pub fn encode_chat(
        &self,
        messages: &serde_json::Value,
        add_generation_prompt: bool,
    ) -> Result<Vec<u32>, TokenizeError> {
        let text = self.render_chat(messages, add_generation_prompt)?;
        self.encode_prompt(&text, false)
    }

    /// Text of token ids (`skip_special_tokens` as in vLLM's sampling params).
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String, TokenizeError> {
        self.tokenizer
            .decode(ids, skip_special_tokens)
            .map_err(|source| TokenizeError::Decode { source })
    }

    /// The string of one token id (its vocabulary form, e.g. `Ġthe` for byte-level BPE).
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.tokenizer.id_to_token(id)
    }

    /// Vocabulary size including added tokens.
    pub fn vocab_size(&self) -> usize {
        self.tokenizer.get_vocab_size(true)
    }

    /// Id of the eos token named in `tokenizer_config.json`, if any.
    pub fn eos_token_id(&self) -> Option<u32> {
        self.eos_token_id
    }

    /// Whether the model has a chat template (chat requests fail without one, as in vLLM).
    pub fn has_chat_template(&self) -> bool {
        self.chat.is_some()
    }
}

fn read(path: &Path) -> Result<Vec<u8>, TokenizeError> {
    std::fs::read(path).map_err(|source| TokenizeError::Io {
        path: PathBuf::from(path),
        source,
    })
}

/// A special token from the config: a plain string or an `AddedToken` object with `content`.
fn special_token(config: &serde_json::Value, name: &str) -> Option<String> {
    match config.get(name)? {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Object(token) => token.get("content")?.as_str().map(str::to_owned),
        _ => None,
    }
}

/// `chat_template` is a string, or a list of `{name, template}` of which vLLM uses `default`.
fn chat_template_source(config: &serde_json::Value) -> Result<Option<String>, TokenizeError> {
    match config.get("chat_template") {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(serde_json::Value::String(s)) => Ok(Some(s.clone())),
        Some(serde_json::Value::Array(named)) => Ok(named
            .iter()
            .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
            .and_then(|t| t.get("template")?.as_str().map(str::to_owned))),
        Some(_) => Err(TokenizeError::Config {
            field: "chat_template",
            reason: "expected a string or a list of {name, template}".to_owned(),
        }),
    }
}

#[cfg(test)]
mod tests;
