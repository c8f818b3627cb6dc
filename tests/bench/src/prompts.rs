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

    /// A new conversation's first turn as a stream request (its prompt's tokens and keys computed).
    pub(crate) fn unique_request(&self, tokens: usize) -> anyhow::Result<StreamRequest> {
        let messages = self.conversation(tokens).first;
        let (prompt, keys) = self.block_keys(&messages)?;
        Ok(StreamRequest {
            body: Self::body(&messages),
            turn: 1,
            tokens: prompt,
            keys,
        })
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

/// One request of a [`PromptSource::chat_stream`].
pub(crate) struct StreamRequest {
    /// The `/v1/chat/completions` body.
    pub(crate) body: Bytes,
    /// 1 for a conversation's first turn.
    pub(crate) turn: usize,
    /// The prompt's tokens and full blocks' keys, as the engine computes them (for its events).
    pub(crate) tokens: Vec<u32>,
    pub(crate) keys: Vec<u64>,
}

/// Applications a chat stream's conversations belong to; each has its own system prompt and
/// tool definitions, shared by all of its conversations.
const STREAM_APPS: usize = 4;
/// Conversations under way at once in a chat stream (requests interleave among them).
const STREAM_LIVE: usize = 8;
/// Turns of each conversation in a chat stream.
const STREAM_TURNS: usize = 3;

impl PromptSource {
    /// `count` chat requests with the reuse a chat fleet sees, averaging about `tokens` tokens:
    /// each of [`STREAM_APPS`] applications has a system prompt of about `tokens / 8` tokens and
    /// six tool definitions, shared by its conversations; a conversation's first turn is about
    /// `⅞ tokens` (its user message whatever the shared part leaves) and each of its
    /// [`STREAM_TURNS`] turns adds an answer and a user message of about `tokens / 16` each (turns
    /// of about ⅞, 1 and 1⅛ of `tokens`). [`STREAM_LIVE`] conversations interleave, the next
    /// request drawn among them by a seeded generator, so about a third of the requests open a new
    /// conversation (its application's prefix already seen) and two thirds resume one seen a few
    /// requests earlier. Every message's text is new.
    pub(crate) fn chat_stream(
        &self,
        tokens: usize,
        count: usize,
    ) -> anyhow::Result<Vec<StreamRequest>> {
        let apps: Vec<(serde_json::Value, serde_json::Value)> = (0..STREAM_APPS)
            .map(|app| {
                let system = format!(
                    "You are assistant {app} of a support team. {SYSTEM_PROMPT} Reference material follows.\n{}",
                    self.user_text(tokens / 8)
                );
                (serde_json::json!({"role": "system", "content": system}), app_tools(app))
            })
            .collect();
        // The shared part's tokens: a first user message fills the first turn up to ⅞ of `tokens`.
        let shared = self
            .tokenizer
            .encode_chat_with(
                &serde_json::json!([apps[0].0]),
                &kvroute_tokenize::ChatOptions {
                    tools: Some(std::sync::Arc::new(apps[0].1.clone())),
                    ..kvroute_tokenize::ChatOptions::default()
                },
            )?
            .len();
        let opening = (tokens * 7 / 8).saturating_sub(shared).max(tokens / 16);
        let mut live: Vec<Option<(usize, serde_json::Value, usize)>> = vec![None; STREAM_LIVE];
        // A fixed, seeded sequence, the same in every run.
        let mut rng = kvroute_tokenize::testing::Rng::new(PROMPT_SEED);
        let mut draw = |bound: usize| rng.below(bound);
        let mut requests = Vec::with_capacity(count);
        while requests.len() < count {
            let slot = &mut live[draw(STREAM_LIVE)];
            let (app, messages, turn) = match slot.take() {
                None => {
                    let app = draw(STREAM_APPS);
                    let messages = serde_json::json!([
                        apps[app].0,
                        {"role": "user", "content": self.user_text(opening)},
                    ]);
                    (app, messages, 1)
                }
                Some((app, mut messages, turn)) => {
                    if let Some(messages) = messages.as_array_mut() {
                        messages.push(serde_json::json!({"role": "assistant", "content": self.user_text(tokens / 16)}));
                        messages.push(serde_json::json!({"role": "user", "content": self.user_text(tokens / 16)}));
                    }
                    (app, messages, turn + 1)
                }
            };
            let tools = &apps[app].1;
            let body = serde_json::json!({"model": MODEL, "messages": messages, "tools": tools, "max_tokens": 1});
            let options = kvroute_tokenize::ChatOptions {
                tools: Some(std::sync::Arc::new(tools.clone())),
                ..kvroute_tokenize::ChatOptions::default()
            };
            let prompt = self.tokenizer.encode_chat_with(&messages, &options)?;
            let pool = self.keys.pools.first().context("no pool")?;
            let keys = pool.prompt_keys(&prompt, None, None)?;
            requests.push(StreamRequest {
                body: Bytes::from(body.to_string()),
                turn,
                tokens: prompt,
                keys,
            });
            if turn < STREAM_TURNS {
                *slot = Some((app, messages, turn));
            }
        }
        Ok(requests)
    }
}

/// Six function tools of application `app`, in the OpenAI chat format: names, descriptions and
/// JSON-schema parameters of the size agent applications send.
fn app_tools(app: usize) -> serde_json::Value {
    /// A parameter: name, JSON type, description.
    type Parameter = (&'static str, &'static str, &'static str);
    const TOOLS: [(&str, &str, &[Parameter]); 6] = [
        (
            "search_documents",
            "Search the knowledge base and return the most relevant passages.",
            &[
                (
                    "query",
                    "string",
                    "What to search for, in the user's words.",
                ),
                (
                    "limit",
                    "integer",
                    "How many passages to return, at most 20.",
                ),
            ],
        ),
        (
            "read_ticket",
            "Read a support ticket with its whole history of messages.",
            &[(
                "ticket_id",
                "string",
                "The ticket's identifier, as shown to the customer.",
            )],
        ),
        (
            "update_ticket",
            "Change a ticket's status, priority or assignee.",
            &[
                ("ticket_id", "string", "The ticket's identifier."),
                (
                    "status",
                    "string",
                    "One of open, pending, solved or closed.",
                ),
                ("priority", "string", "One of low, normal, high or urgent."),
                (
                    "assignee",
                    "string",
                    "The e-mail address of the agent to assign.",
                ),
            ],
        ),
        (
            "run_sql",
            "Run a read-only SQL query against the analytics warehouse.",
            &[
                ("sql", "string", "A single SELECT statement."),
                ("timeout_seconds", "integer", "How long the query may run."),
            ],
        ),
        (
            "send_email",
            "Send an e-mail to a customer on behalf of the support team.",
            &[
                ("to", "string", "The recipient's e-mail address."),
                ("subject", "string", "The subject line."),
                ("body", "string", "The message, in plain text."),
            ],
        ),
        (
            "get_weather",
            "Current weather and the forecast for the next three days in a city.",
            &[
                ("city", "string", "The city's name."),
                ("units", "string", "metric or imperial."),
            ],
        ),
    ];
    let tools: Vec<serde_json::Value> = TOOLS
        .iter()
        .map(|(name, description, parameters)| {
            let properties: serde_json::Map<String, serde_json::Value> = parameters
                .iter()
                .map(|(parameter, kind, about)| {
                    (
                        (*parameter).to_owned(),
                        serde_json::json!({"type": kind, "description": about}),
                    )
                })
                .collect();
            let required: Vec<&str> = parameters.iter().take(1).map(|(p, ..)| *p).collect();
            serde_json::json!({"type": "function", "function": {
                "name": format!("{name}_{app}"),
                "description": description,
                "parameters": {"type": "object", "properties": properties, "required": required},
            }})
        })
        .collect();
    serde_json::Value::Array(tools)
}
