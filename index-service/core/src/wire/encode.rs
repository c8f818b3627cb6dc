//! Domain [`EventBatch`] → the msgpack bytes a given vLLM release publishes.
//!
//! For the engine simulator and tests: the output is byte-identical to `msgspec.msgpack.Encoder`
//! on vLLM's structs (checked against every payload of `golden_vectors.json` and a real 0.32
//! capture). msgspec's choices that matter: smallest int encoding (uint markers for
//! non-negative values), `float64` for `ts`, `str8` from 32 bytes, arrays for `array_like`
//! structs with every field present, maps with `None`-default fields left out and a `map16`
//! header whenever the struct has more than 15 possible keys.
//!
//! The domain types do not carry every wire field, so the encoder fills them the way vLLM's GPU
//! block pool does: `kv_cache_spec_kind` is the event's `cache_kind`, or `"full_attention"` when
//! only `group_idx` is set; the sliding window is the event's; `locality`, `ownership`,
//! `session_id` and `lookahead_token_ids` are nil.

use kvroute_block_keys::HashValue;

use crate::event::{BlockRemoved, BlockStored, EngineHash, EventBatch, KvEvent, Medium};

/// The struct layout of a vLLM release range (spec §2.2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Schema {
    /// 0.9.0: tagged arrays, batch `[ts, events]`.
    S1,
    /// 0.9.1–0.10.1: + batch `data_parallel_rank`.
    S2,
    /// 0.10.2–0.13: + `medium`.
    S3,
    /// 0.14–0.16: + `lora_name`.
    S4,
    /// 0.17–0.19: + `extra_keys`.
    S5,
    /// 0.20–0.21: + `group_idx`.
    S6,
    /// 0.22–0.23: + `kv_cache_spec_kind`, `kv_cache_spec_sliding_window`.
    S7,
    /// 0.24–0.25: S7's fields as maps keyed by `"type"`.
    S8,
    /// 0.26–0.28: + `locality`.
    S9,
    /// 0.29: + `ownership`.
    S10,
    /// 0.30–0.32: + `session_id`.
    S11,
    /// 0.33: + `lookahead_token_ids`.
    S12,
}

impl Schema {
    /// Every schema, oldest first.
    pub const ALL: [Schema; 12] = [
        Schema::S1,
        Schema::S2,
        Schema::S3,
        Schema::S4,
        Schema::S5,
        Schema::S6,
        Schema::S7,
        Schema::S8,
        Schema::S9,
        Schema::S10,
        Schema::S11,
        Schema::S12,
    ];

    /// Events are maps (0.24+) rather than tagged arrays.
    pub fn uses_maps(self) -> bool {
        self >= Schema::S8
    }
}

/// How block hashes are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum HashForm {
    /// u64 as msgpack uint (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`, the default).
    Uint,
    /// The u64 reinterpreted as i64 (Python `hash()` values before 0.10.2; may be negative).
    SignedInt,
    /// The full digest as msgpack bin (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`). Events without
    /// digests (`block_digests`/`parent_digest` unset) fall back to [`HashForm::Uint`].
    Bytes,
}

/// Which vLLM output to reproduce.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Encoding {
    /// Struct layout.
    pub schema: Schema,
    /// Block hash representation.
    pub hashes: HashForm,
}

impl Encoding {
    /// vLLM 0.30–0.32 defaults: map events, u64 hashes.
    pub const V0_32: Encoding = Encoding {
        schema: Schema::S11,
        hashes: HashForm::Uint,
    };
}

/// Whether a struct field has a default (`= None`): maps leave such fields out when they are nil.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Presence {
    Required,
    DefaultNone,
}

/// `(name, first schema with it, presence)` of BlockStored's fields in declaration order.
const STORED_FIELDS: [(&str, Schema, Presence); 15] = [
    ("block_hashes", Schema::S1, Presence::Required),
    ("parent_block_hash", Schema::S1, Presence::Required),
    ("token_ids", Schema::S1, Presence::Required),
    ("block_size", Schema::S1, Presence::Required),
    ("lora_id", Schema::S1, Presence::Required),
    ("medium", Schema::S3, Presence::Required),
    ("lora_name", Schema::S4, Presence::Required),
    ("extra_keys", Schema::S5, Presence::DefaultNone),
    ("group_idx", Schema::S6, Presence::DefaultNone),
    ("kv_cache_spec_kind", Schema::S7, Presence::DefaultNone),
    (
        "kv_cache_spec_sliding_window",
        Schema::S7,
        Presence::DefaultNone,
    ),
    ("locality", Schema::S9, Presence::DefaultNone),
    ("ownership", Schema::S10, Presence::DefaultNone),
    ("session_id", Schema::S11, Presence::DefaultNone),
    ("lookahead_token_ids", Schema::S12, Presence::DefaultNone),
];

/// The same for BlockRemoved.
const REMOVED_FIELDS: [(&str, Schema, Presence); 5] = [
    ("block_hashes", Schema::S1, Presence::Required),
    ("medium", Schema::S3, Presence::Required),
    ("group_idx", Schema::S6, Presence::DefaultNone),
    ("locality", Schema::S9, Presence::DefaultNone),
    ("ownership", Schema::S10, Presence::DefaultNone),
];

/// msgspec switches from fixmap to map16 when a struct has more possible keys than this.
const FIXMAP_MAX_KEYS: usize = 15;

/// The attention kind vLLM's GPU block pool reports for single-group models (0.22+).
const FULL_ATTENTION: &str = "full_attention";

/// Encodes `batch` exactly as the chosen vLLM release would publish it.
pub fn encode_batch(batch: &EventBatch, encoding: Encoding) -> Vec<u8> {
    encode_batch_with_digests(batch, encoding, |_| None)
}

/// [`encode_batch`] for [`HashForm::Bytes`] with digests the events do not carry:
/// `digest_of(hash)` supplies the raw digest of a published u64 (needed for `BlockRemoved`,
/// whose domain type keeps only u64s, and for `BlockStored` events without `block_digests`).
/// Hashes it returns `None` for are written as uint.
pub fn encode_batch_with_digests(
    batch: &EventBatch,
    encoding: Encoding,
    digest_of: impl Fn(EngineHash) -> Option<Vec<u8>>,
) -> Vec<u8> {
    let digest_of: &dyn Fn(EngineHash) -> Option<Vec<u8>> = &digest_of;
    let mut out = Vec::with_capacity(64 + batch.events.len() * 128);
    let with_rank = encoding.schema >= Schema::S2;
    write_array_len(&mut out, if with_rank { 3 } else { 2 });
    write_f64(&mut out, batch.ts);
    write_array_len(&mut out, batch.events.len());
    for event in &batch.events {
        match event {
            KvEvent::BlockStored(stored) => {
                write_event(
                    &mut out,
                    encoding,
                    "BlockStored",
                    &STORED_FIELDS,
                    |out, name| stored_field(out, stored, name, encoding.hashes, digest_of),
                );
            }
            KvEvent::BlockRemoved(removed) => {
                write_event(
                    &mut out,
                    encoding,
                    "BlockRemoved",
                    &REMOVED_FIELDS,
                    |out, name| removed_field(out, removed, name, encoding.hashes, digest_of),
                );
            }
            KvEvent::AllBlocksCleared => {
                write_event(&mut out, encoding, "AllBlocksCleared", &[], |_, _| false);
            }
        }
    }
    if with_rank {
        match batch.dp_rank {
            Some(rank) => write_uint(&mut out, u64::from(rank)),
            None => write_nil(&mut out),
        }
    }
    out
}

/// Writes one tagged event. `write_field(out, name)` writes the field's value and returns true,
/// or writes nothing and returns false when the value is nil.
fn write_event(
    out: &mut Vec<u8>,
    encoding: Encoding,
    tag: &str,
    fields: &[(&str, Schema, Presence)],
    mut write_field: impl FnMut(&mut Vec<u8>, &str) -> bool,
) {
    let fields: Vec<_> = fields
        .iter()
        .filter(|(_, since, _)| *since <= encoding.schema)
        .collect();
    if !encoding.schema.uses_maps() {
        write_array_len(out, 1 + fields.len());
        write_str(out, tag);
        for (name, _, _) in fields {
            if !write_field(out, name) {
                write_nil(out);
            }
        }
        return;
    }
    // Maps: encode the present fields first, since the header must state their count.
    let mut body = Vec::new();
    let mut present = 0;
    for (name, _, presence) in &fields {
        let mark = body.len();
        write_str(&mut body, name);
        if write_field(&mut body, name) {
            present += 1;
        } else if *presence == Presence::Required {
            write_nil(&mut body);
            present += 1;
        } else {
            body.truncate(mark);
        }
    }
    write_map_len(out, 1 + present, 1 + fields.len() > FIXMAP_MAX_KEYS);
    write_str(out, "type");
    write_str(out, tag);
    out.extend_from_slice(&body);
}

/// SGLang's event layouts (research `engines.md` §1.1–1.2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SglangLayout {
    /// Up to 0.5.19: tagged arrays; a salted store carries a `{cache_salt}` map eighth.
    Positional,
    /// 0.5.20 on: maps keyed by `"type"`, `None` defaults left out (`lora_id` and the parent
    /// are always written), `cache_salt` when salted.
    Maps,
}

/// Encodes `batch` as SGLang's `ZmqEventPublisher` publishes it in `layout` (msgspec: the batch
/// is always `[ts, events, attn_dp_rank]`, hashes signed i64, media SGLang's names). For the
/// engine simulator and tests; byte-identical to SGLang's own output for what the domain types
/// carry (`tests`: every store, remove and clear of the project's SGLang captures with plain
/// tokens). Tokens are written as the domain's u32 ids: bigram pairs and ids past u32 are not
/// produced.
pub fn encode_sglang_batch(batch: &EventBatch, layout: SglangLayout) -> Vec<u8> {
    let mut out = Vec::with_capacity(64 + batch.events.len() * 128);
    write_array_len(&mut out, 3);
    write_f64(&mut out, batch.ts);
    write_array_len(&mut out, batch.events.len());
    for event in &batch.events {
        match (event, layout) {
            (KvEvent::BlockStored(stored), SglangLayout::Positional) => {
                let salt = stored
                    .sglang
                    .as_ref()
                    .and_then(|run| run.cache_salt.as_deref());
                write_array_len(&mut out, if salt.is_some() { 8 } else { 7 });
                write_str(&mut out, "BlockStored");
                write_sglang_stored_core(&mut out, stored);
                write_str(&mut out, sglang_medium_name(stored.medium));
                if let Some(salt) = salt {
                    write_map_len(&mut out, 1, false);
                    write_str(&mut out, "cache_salt");
                    write_str(&mut out, salt);
                }
            }
            (KvEvent::BlockStored(stored), SglangLayout::Maps) => {
                let salt = stored
                    .sglang
                    .as_ref()
                    .and_then(|run| run.cache_salt.as_deref());
                let lora_name = stored.lora_name.as_deref();
                let pairs = 7 + usize::from(salt.is_some()) + usize::from(lora_name.is_some());
                write_map_len(&mut out, pairs, false);
                write_str(&mut out, "type");
                write_str(&mut out, "BlockStored");
                for (i, name) in [
                    "block_hashes",
                    "parent_block_hash",
                    "token_ids",
                    "block_size",
                    "lora_id",
                ]
                .into_iter()
                .enumerate()
                {
                    write_str(&mut out, name);
                    write_sglang_stored_field(&mut out, stored, i);
                }
                write_str(&mut out, "medium");
                write_str(&mut out, sglang_medium_name(stored.medium));
                if let Some(salt) = salt {
                    write_str(&mut out, "cache_salt");
                    write_str(&mut out, salt);
                }
                if let Some(name) = lora_name {
                    write_str(&mut out, "lora_name");
                    write_str(&mut out, name);
                }
            }
            (KvEvent::BlockRemoved(removed), layout) => {
                if layout == SglangLayout::Positional {
                    write_array_len(&mut out, 3);
                } else {
                    write_map_len(&mut out, 3, false);
                    write_str(&mut out, "type");
                }
                write_str(&mut out, "BlockRemoved");
                if layout == SglangLayout::Maps {
                    write_str(&mut out, "block_hashes");
                }
                write_signed_hashes(&mut out, &removed.block_hashes);
                if layout == SglangLayout::Maps {
                    write_str(&mut out, "medium");
                }
                write_str(&mut out, sglang_medium_name(removed.medium));
            }
            (KvEvent::AllBlocksCleared, SglangLayout::Positional) => {
                write_array_len(&mut out, 1);
                write_str(&mut out, "AllBlocksCleared");
            }
            (KvEvent::AllBlocksCleared, SglangLayout::Maps) => {
                write_map_len(&mut out, 1, false);
                write_str(&mut out, "type");
                write_str(&mut out, "AllBlocksCleared");
            }
        }
    }
    match batch.dp_rank {
        Some(rank) => write_uint(&mut out, u64::from(rank)),
        None => write_nil(&mut out),
    }
    out
}

/// A store's first five positional fields.
fn write_sglang_stored_core(out: &mut Vec<u8>, stored: &BlockStored) {
    for i in 0..5 {
        write_sglang_stored_field(out, stored, i);
    }
}

/// Field `i` of `block_hashes, parent_block_hash, token_ids, block_size, lora_id`.
fn write_sglang_stored_field(out: &mut Vec<u8>, stored: &BlockStored, i: usize) {
    match i {
        0 => write_signed_hashes(out, &stored.block_hashes),
        1 => match stored.parent_block_hash {
            Some(hash) => write_int(out, hash as i64),
            None => write_nil(out),
        },
        2 => {
            write_array_len(out, stored.token_ids.len());
            for &token in &stored.token_ids {
                write_uint(out, u64::from(token));
            }
        }
        3 => write_uint(out, u64::from(stored.block_size)),
        _ => match stored.lora_id {
            Some(id) => write_int(out, id),
            None => write_nil(out),
        },
    }
}

fn write_signed_hashes(out: &mut Vec<u8>, hashes: &[EngineHash]) {
    write_array_len(out, hashes.len());
    for &hash in hashes {
        write_int(out, hash as i64);
    }
}

/// SGLang's `StorageMedium` names.
fn sglang_medium_name(medium: Medium) -> &'static str {
    match medium {
        Medium::Gpu => "GPU",
        Medium::Cpu => "CPU_PINNED",
        Medium::Storage => "DISK",
        Medium::Other => "EXTERNAL",
    }
}

/// Looks up digests for [`HashForm::Bytes`].
type DigestOf<'a> = &'a dyn Fn(EngineHash) -> Option<Vec<u8>>;

fn stored_field(
    out: &mut Vec<u8>,
    event: &BlockStored,
    name: &str,
    form: HashForm,
    digest_of: DigestOf<'_>,
) -> bool {
    match name {
        "block_hashes" => write_hashes(
            out,
            &event.block_hashes,
            event.block_digests.as_deref(),
            form,
            digest_of,
        ),
        "parent_block_hash" => match event.parent_block_hash {
            Some(hash) => {
                let digest = match form {
                    HashForm::Bytes => event.parent_digest.clone().or_else(|| digest_of(hash)),
                    HashForm::Uint | HashForm::SignedInt => None,
                };
                write_hash(out, hash, digest.as_deref(), form)
            }
            None => return false,
        },
        "token_ids" => {
            write_array_len(out, event.token_ids.len());
            for &token in &event.token_ids {
                write_uint(out, u64::from(token));
            }
        }
        "block_size" => write_uint(out, u64::from(event.block_size)),
        "lora_id" => match event.lora_id {
            Some(id) => write_int(out, id),
            None => return false,
        },
        "medium" => write_str(out, medium_wire_name(event.medium)),
        "lora_name" => match &event.lora_name {
            Some(name) => write_str(out, name),
            None => return false,
        },
        "extra_keys" => match &event.extra_keys {
            Some(keys) => {
                write_array_len(out, keys.len());
                for key in keys {
                    match key {
                        Some(value) => write_hash_value(out, value),
                        None => write_nil(out),
                    }
                }
            }
            None => return false,
        },
        "group_idx" => match event.group_idx {
            Some(group) => write_uint(out, u64::from(group)),
            None => return false,
        },
        "kv_cache_spec_kind" => match (event.cache_kind, event.group_idx) {
            (Some(kind), _) => write_str(out, kind.as_label()),
            (None, Some(_)) => write_str(out, FULL_ATTENTION),
            (None, None) => return false,
        },
        "kv_cache_spec_sliding_window" => match event.sliding_window {
            Some(window) => write_uint(out, u64::from(window)),
            None => return false,
        },
        _ => return false,
    }
    true
}

fn removed_field(
    out: &mut Vec<u8>,
    event: &BlockRemoved,
    name: &str,
    form: HashForm,
    digest_of: DigestOf<'_>,
) -> bool {
    match name {
        "block_hashes" => write_hashes(out, &event.block_hashes, None, form, digest_of),
        "medium" => write_str(out, medium_wire_name(event.medium)),
        "group_idx" => match event.group_idx {
            Some(group) => write_uint(out, u64::from(group)),
            None => return false,
        },
        _ => return false,
    }
    true
}

fn medium_wire_name(medium: Medium) -> &'static str {
    match medium {
        Medium::Gpu => "GPU",
        Medium::Cpu => "CPU",
        Medium::Storage => "STORAGE",
        Medium::Other => "OTHER",
    }
}

fn write_hashes(
    out: &mut Vec<u8>,
    hashes: &[EngineHash],
    digests: Option<&[Vec<u8>]>,
    form: HashForm,
    digest_of: DigestOf<'_>,
) {
    write_array_len(out, hashes.len());
    let digests = digests.filter(|d| d.len() == hashes.len());
    for (i, &hash) in hashes.iter().enumerate() {
        match digests.and_then(|d| d.get(i)) {
            Some(digest) => write_hash(out, hash, Some(digest), form),
            None if form == HashForm::Bytes => {
                write_hash(out, hash, digest_of(hash).as_deref(), form)
            }
            None => write_hash(out, hash, None, form),
        }
    }
}

fn write_hash(out: &mut Vec<u8>, hash: EngineHash, digest: Option<&[u8]>, form: HashForm) {
    match (form, digest) {
        (HashForm::Bytes, Some(digest)) => write_bin(out, digest),
        (HashForm::SignedInt, _) => write_int(out, hash as i64),
        (HashForm::Uint | HashForm::Bytes, _) => write_uint(out, hash),
    }
}

fn write_hash_value(out: &mut Vec<u8>, value: &HashValue) {
    match value {
        HashValue::None => write_nil(out),
        HashValue::Int(v) => write_int(out, *v),
        HashValue::Str(s) => write_str(out, s),
        HashValue::Bytes(b) => write_bin(out, b),
        HashValue::Tuple(items) => {
            write_array_len(out, items.len());
            for item in items {
                write_hash_value(out, item);
            }
        }
    }
}

// msgpack primitives, with msgspec's (smallest-width) header choices.

fn write_nil(out: &mut Vec<u8>) {
    out.push(0xc0);
}

fn write_f64(out: &mut Vec<u8>, value: f64) {
    out.push(0xcb);
    out.extend_from_slice(&value.to_be_bytes());
}

fn write_uint(out: &mut Vec<u8>, value: u64) {
    if let Ok(v) = u8::try_from(value) {
        if v < 0x80 {
            out.push(v);
        } else {
            out.extend_from_slice(&[0xcc, v]);
        }
    } else if let Ok(v) = u16::try_from(value) {
        out.push(0xcd);
        out.extend_from_slice(&v.to_be_bytes());
    } else if let Ok(v) = u32::try_from(value) {
        out.push(0xce);
        out.extend_from_slice(&v.to_be_bytes());
    } else {
        out.push(0xcf);
        out.extend_from_slice(&value.to_be_bytes());
    }
}

fn write_int(out: &mut Vec<u8>, value: i64) {
    if let Ok(v) = u64::try_from(value) {
        return write_uint(out, v);
    }
    if value >= -32 {
        out.push(value as u8);
    } else if let Ok(v) = i8::try_from(value) {
        out.extend_from_slice(&[0xd0, v as u8]);
    } else if let Ok(v) = i16::try_from(value) {
        out.push(0xd1);
        out.extend_from_slice(&v.to_be_bytes());
    } else if let Ok(v) = i32::try_from(value) {
        out.push(0xd2);
        out.extend_from_slice(&v.to_be_bytes());
    } else {
        out.push(0xd3);
        out.extend_from_slice(&value.to_be_bytes());
    }
}

/// Writes a length header: `fix` (OR-ed with the length) below `fix_limit`, else the 8-bit
/// (if `marker8` is given), 16-bit or 32-bit form.
fn write_len(
    out: &mut Vec<u8>,
    len: usize,
    fix: Option<(u8, usize)>,
    marker8: Option<u8>,
    marker16: u8,
    marker32: u8,
) {
    match fix {
        Some((fix_marker, fix_limit)) if len < fix_limit => out.push(fix_marker | len as u8),
        _ => match (marker8, u8::try_from(len), u16::try_from(len)) {
            (Some(marker8), Ok(len8), _) => out.extend_from_slice(&[marker8, len8]),
            (_, _, Ok(len16)) => {
                out.push(marker16);
                out.extend_from_slice(&len16.to_be_bytes());
            }
            _ => {
                out.push(marker32);
                // Python payloads never exceed 4 GiB; saturating keeps this infallible.
                out.extend_from_slice(&u32::try_from(len).unwrap_or(u32::MAX).to_be_bytes());
            }
        },
    }
}

fn write_str(out: &mut Vec<u8>, value: &str) {
    write_len(out, value.len(), Some((0xa0, 32)), Some(0xd9), 0xda, 0xdb);
    out.extend_from_slice(value.as_bytes());
}

fn write_bin(out: &mut Vec<u8>, value: &[u8]) {
    write_len(out, value.len(), None, Some(0xc4), 0xc5, 0xc6);
    out.extend_from_slice(value);
}

fn write_array_len(out: &mut Vec<u8>, len: usize) {
    write_len(out, len, Some((0x90, 16)), None, 0xdc, 0xdd);
}

/// `wide` forces map16 for small maps (msgspec does so for structs with over 15 possible keys).
fn write_map_len(out: &mut Vec<u8>, len: usize, wide: bool) {
    let fix = if wide { None } else { Some((0x80, 16)) };
    write_len(out, len, fix, None, 0xde, 0xdf);
}
