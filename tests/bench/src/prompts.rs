//! The bench's prompts: unique chat conversations of a given token length, and the tokens and
//! block keys kvroute-ext-proc computes for them.

use super::*;

/// Unique chat conversations of a given token length, cut from seeded mixed text
/// (`kvroute_tokenize::testing::mixed_text`: prose, code, JSON, several scripts, emoji), with the
/// model whose tokens and block keys kvroute-ext-proc computes.
pub(crate) struct PromptSource {
    /// The mixed text twice over, so a prompt can start anywhere in the first copy.
    pub(crate) text: String,
    /// Length of one copy.
    period: usize,
    pub(crate) bytes_per_token: f64,
    pub(crate) model_dir: std::path::PathBuf,
    pub(crate) block_size: u32,
    pub(crate) tokenizer: ModelTokenizer,
    /// kvroute-ext-proc's config for this model: its pool computes the block keys an engine
    /// reports for a served turn.
    pub(crate) keys: kvroute_ext_proc::Config,
    pub(crate) next: std::sync::atomic::AtomicU64,
}

/// A conversation's first turn and its next turn (the first plus an answer and a follow-up).
pub(crate) struct Conversation {
    pub(crate) first: serde_json::Value,
    pub(crate) next: serde_json::Value,
}

/// Seed of the mixed text every prompt is cut from.
const PROMPT_SEED: u64 = 0x006b_7672_6f75_7465;
/// Bytes of mixed text generated; more than the longest prompt measured.
const MIXED_TEXT_BYTES: usize = 4 << 20;
/// The system message of every conversation.
const SYSTEM_PROMPT: &str = "You are a careful assistant. Answer from the material the user gives.";
/// The user's second message.
const FOLLOW_UP: &str = "Thanks. Now list the three points of the text above that matter most, one line each, and say why.";

impl PromptSource {
    pub(crate) fn load(model_dir: &std::path::Path, block_size: u32) -> anyhow::Result<Self> {
        let mixed = kvroute_tokenize::testing::mixed_text(PROMPT_SEED, MIXED_TEXT_BYTES, &[]);
        let tokenizer = ModelTokenizer::from_dir(model_dir)
            .with_context(|| format!("loading {}", model_dir.display()))?;
        ensure!(
            tokenizer.has_chat_template(),
            "{} has no chat template",
            model_dir.display()
        );
        let sample = &mixed[..mixed.floor_char_boundary(256 << 10)];
        let tokens = tokenizer.encode_prompt(sample, false)?.len();
        ensure!(tokens > 0, "empty sample");
        let bytes_per_token = sample.len() as f64 / tokens as f64;
        let longest = (STAGE_SIZES[STAGE_SIZES.len() - 1] as f64 * bytes_per_token * 1.1) as usize;
        ensure!(
            longest < mixed.len(),
            "{} bytes of mixed text cannot hold a {longest}-byte prompt",
            mixed.len()
        );
        let keys = kvroute_ext_proc::Config::from_yaml(&ext_proc_config(
            &["127.0.0.1:1".parse()?],
            &IndexMode::None,
            model_dir,
            block_size,
        ))?;
        Ok(Self {
            period: mixed.len(),
            text: mixed.repeat(2),
            bytes_per_token,
            model_dir: model_dir.to_owned(),
            block_size,
            tokenizer,
            keys,
            next: std::sync::atomic::AtomicU64::new(0),
        })
    }

    /// User text of about `tokens` tokens that no earlier prompt shares a prefix with.
    fn user_text(&self, tokens: usize) -> String {
        let n = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let len = (tokens as f64 * self.bytes_per_token) as usize;
        let start = self
            .text
            .floor_char_boundary((n as usize).wrapping_mul(7919) % self.period);
        let end = self.text.floor_char_boundary(start + len);
        format!("request {n}: {}", &self.text[start..end])
    }

    /// A new conversation whose first turn is about `tokens` tokens.
    pub(crate) fn conversation(&self, tokens: usize) -> Conversation {
        let first = serde_json::json!([
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": self.user_text(tokens)},
        ]);
        let mut next = first.clone();
        if let Some(messages) = next.as_array_mut() {
            messages.push(serde_json::json!({"role": "assistant", "content": self.user_text(60)}));
            messages.push(serde_json::json!({"role": "user", "content": FOLLOW_UP}));
        }
        Conversation { first, next }
    }

    /// A `/v1/chat/completions` body for `messages`.
    pub(crate) fn body(messages: &serde_json::Value) -> Bytes {
        let body = serde_json::json!({"model": MODEL, "messages": messages, "max_tokens": 1});
        Bytes::from(body.to_string())
    }

    /// A new conversation's first turn, as a body.
    pub(crate) fn miss_body(&self, tokens: usize) -> Bytes {
        Self::body(&self.conversation(tokens).first)
    }

    /// The prompt tokens vLLM computes for `messages` (the request's defaults).
    pub(crate) fn chat_tokens(&self, messages: &serde_json::Value) -> anyhow::Result<Vec<u32>> {
        Ok(self
            .tokenizer
            .encode_chat_with(messages, &kvroute_tokenize::ChatOptions::default())?)
    }

    /// The block keys an engine publishes for the full blocks of `messages`' prompt.
    pub(crate) fn block_keys(
        &self,
        messages: &serde_json::Value,
    ) -> anyhow::Result<(Vec<u32>, Vec<u64>)> {
        let tokens = self.chat_tokens(messages)?;
        let pool = self.keys.pools.first().context("no pool")?;
        let keys = pool.prompt_keys(&tokens, None, None)?;
        Ok((tokens, keys))
    }
}
