//! The token cache's keys: a hash of the pool and of everything that changes the prompt's
//! tokens, for the whole prompt and, for conversations, for every prefix of it.

use kvroute_tokenize::ApiKind;
use serde_json::value::RawValue;
use xxhash_rust::xxh3::Xxh3;

use super::ChatInputFields;
use crate::request::Prompt;

/// Cache keys of `prompt` in `pool` with the byte sizes of what each covers: one for a
/// completion, one per conversation prefix for a chat or an API request (last = the whole
/// prompt); none for token ids or no prompt.
pub(super) fn prompt_keys(pool: usize, prompt: &Prompt<'_>) -> Vec<(u128, usize)> {
    match prompt {
        Prompt::Tokens(_) | Prompt::Absent => Vec::new(),
        Prompt::Text {
            text,
            add_special_tokens,
            ..
        } => {
            vec![(
                cache_key(pool, b"text", *add_special_tokens, &[text.as_bytes()]),
                text.len(),
            )]
        }
        Prompt::Api {
            api, items, fields, ..
        } => api_keys(pool, *api, items, fields),
        Prompt::Chat {
            messages,
            add_generation_prompt,
            fields,
            ..
        } => conversation_keys(
            pool,
            messages,
            *add_generation_prompt,
            &ChatInputFields::from_request(fields),
        ),
    }
}

/// Cache keys of a Responses or Messages request's conversation items `0..k` for every k, like
/// [`conversation_keys`]: every other prompt-changing field is part of each key.
pub(super) fn api_keys(
    pool: usize,
    api: ApiKind,
    items: &[&str],
    fields: &[(&'static str, &RawValue)],
) -> Vec<(u128, usize)> {
    let mut hasher = Xxh3::new();
    hasher.update(&(pool as u64).to_le_bytes());
    hasher.update(match api {
        ApiKind::Responses => b"responses",
        ApiKind::Messages => b"messages\0",
    });
    for (name, raw) in fields {
        if matches!(*name, "input" | "messages") {
            continue;
        }
        hasher.update(name.as_bytes());
        hash_optional(&mut hasher, Some(raw.get().as_bytes()));
    }
    let mut bytes = 0;
    items
        .iter()
        .map(|item| {
            hasher.update(&(item.len() as u64).to_le_bytes());
            hasher.update(item.as_bytes());
            bytes += item.len();
            (hasher.digest128(), bytes)
        })
        .collect()
}

fn cache_key(pool: usize, kind: &[u8], flag: bool, parts: &[&[u8]]) -> u128 {
    let mut hasher = Xxh3::new();
    hasher.update(&(pool as u64).to_le_bytes());
    hasher.update(kind);
    hasher.update(&[u8::from(flag)]);
    for part in parts {
        hasher.update(&(part.len() as u64).to_le_bytes());
        hasher.update(part);
    }
    hasher.digest128()
}

/// Cache keys of messages `0..k` for every k (last = whole conversation), with their byte sizes;
/// every prompt-changing field of the request is part of each key.
pub(super) fn conversation_keys(
    pool: usize,
    messages: &[&str],
    add_generation_prompt: bool,
    fields: &ChatInputFields,
) -> Vec<(u128, usize)> {
    let mut hasher = Xxh3::new();
    hasher.update(&(pool as u64).to_le_bytes());
    hasher.update(b"chat");
    hasher.update(&[u8::from(add_generation_prompt)]);
    hash_chat_fields(&mut hasher, fields);
    let mut bytes = 0;
    messages
        .iter()
        .map(|m| {
            hasher.update(&(m.len() as u64).to_le_bytes());
            hasher.update(m.as_bytes());
            bytes += m.len();
            (hasher.digest128(), bytes)
        })
        .collect()
}

/// Feeds every field of a chat request besides `messages` into a cache key.
fn hash_chat_fields(hasher: &mut Xxh3, fields: &ChatInputFields) {
    hasher.update(&[
        u8::from(fields.continue_final_message),
        u8::from(fields.add_special_tokens),
        u8::from(fields.request_template),
    ]);
    let [mm_processor_kwargs, media_io_kwargs] = &fields.media_kwargs;
    let raw = [
        &fields.tools,
        &fields.documents,
        &fields.chat_template_kwargs,
        mm_processor_kwargs,
        media_io_kwargs,
        &fields.tool_choice,
    ];
    for part in raw {
        hash_optional(hasher, part.as_ref().map(|r| r.get().as_bytes()));
    }
    hash_optional(
        hasher,
        fields.reasoning_effort.as_deref().map(str::as_bytes),
    );
}

fn hash_optional(hasher: &mut Xxh3, part: Option<&[u8]>) {
    match part {
        None => hasher.update(&[0]),
        Some(bytes) => {
            hasher.update(&[1]);
            hasher.update(&(bytes.len() as u64).to_le_bytes());
            hasher.update(bytes);
        }
    }
}
