//! msgpack `KVEventBatch` → domain [`EventBatch`], for every vLLM release (schemas S1..S12) and
//! every SGLang release.
//!
//! Recipe (spec §2.3): the batch is an array `[ts, events]` or `[ts, events, dp_rank]`. An event
//! is a tagged array (`[tag, field, ...]`, fields by position, vLLM 0.9–0.23, SGLang up to
//! 0.5.19) or a map keyed by `"type"` (vLLM 0.24+, SGLang 0.5.20+). Missing fields are nil, extra
//! elements and unknown keys are ignored, and an unknown tag skips that event only.
//!
//! The engine family is the feed's, from configuration ([`Engine`]), never guessed per message:
//! the two place different fields at position 7 of a positional `BlockStored` (vLLM's
//! `lora_name`, SGLang's `{cache_salt}` metadata map), and only SGLang publishes `cache_salt`,
//! token pairs (EAGLE) and tokens past u32 (0.5.23 multimodal pads).

use kvroute_block_keys::HashValue;

use super::reader::{Container, Hash, Reader};
use super::{
    DecodedBatch, IgnoredFields, MAX_BLOCKS_PER_EVENT, MAX_EVENTS_PER_BATCH, MAX_TOKENS_PER_EVENT,
    WireError,
};
use crate::event::{
    BlockRemoved, BlockStored, CacheKind, Engine, EngineHash, EventBatch, KvEvent, Medium,
    SglangRun, TokenLayout,
};

/// Smallest encoding of a real event (`["BlockRemoved",[h]]` is 16 bytes); bounds how many
/// events are preallocated from a declared count.
const MIN_EVENT_BYTES: usize = 16;

/// Decodes one vLLM msgpack `KVEventBatch` payload (the third frame of a live message).
pub fn decode_batch(payload: &[u8]) -> Result<DecodedBatch, WireError> {
    decode_engine_batch(Engine::Vllm, payload)
}

/// Decodes one msgpack `KVEventBatch` payload published by an engine of the family `engine`.
pub fn decode_engine_batch(engine: Engine, payload: &[u8]) -> Result<DecodedBatch, WireError> {
    let mut r = Reader::new(payload);
    let len = r.array_len("batch")?;
    if len < 2 {
        let field = if len == 0 { "ts" } else { "events" };
        return Err(WireError::MissingField {
            field,
            context: "batch",
        });
    }
    let ts = r.f64("ts")?;

    let declared = r.array_len("events")?;
    check_limit("events", declared, MAX_EVENTS_PER_BATCH)?;
    let mut events = Vec::with_capacity(declared.min(r.remaining() / MIN_EVENT_BYTES));
    let mut unknown_events = 0;
    let mut ignored_fields = IgnoredFields::default();
    for _ in 0..declared {
        match decode_event(&mut r, engine, &mut ignored_fields)? {
            Some(event) => events.push(event),
            None => unknown_events += 1,
        }
    }

    let dp_rank = if len >= 3 {
        r.opt_u32("data_parallel_rank")?
    } else {
        None
    };
    for _ in 3..len {
        r.skip(1)?;
    }
    r.finish()?;
    Ok(DecodedBatch {
        batch: EventBatch {
            ts,
            dp_rank,
            events,
        },
        unknown_events,
        ignored_fields,
    })
}

fn check_limit(what: &'static str, declared: usize, limit: usize) -> Result<(), WireError> {
    if declared > limit {
        return Err(WireError::LimitExceeded {
            what,
            declared: declared as u64,
            limit: limit as u64,
        });
    }
    Ok(())
}

/// Event kinds the index understands; any other tag is skipped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Stored,
    Removed,
    Cleared,
}

impl Kind {
    fn from_tag(tag: &[u8]) -> Option<Kind> {
        match tag {
            b"BlockStored" => Some(Kind::Stored),
            b"BlockRemoved" => Some(Kind::Removed),
            b"AllBlocksCleared" => Some(Kind::Cleared),
            _ => None,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Kind::Stored => "BlockStored",
            Kind::Removed => "BlockRemoved",
            Kind::Cleared => "AllBlocksCleared",
        }
    }

    /// Field at array position `index` (1-based after the tag), identical in S1..S7 because
    /// every release only appended fields. SGLang's arrays share positions 1–6 with vLLM's and
    /// end with the metadata map of a salted store.
    fn positional(self, engine: Engine, index: usize) -> Field {
        if engine == Engine::Sglang {
            return match (self, index) {
                (Kind::Stored, 7) => Field::Metadata,
                (_, 7..) => Field::Ignored,
                _ => self.positional(Engine::Vllm, index),
            };
        }
        match (self, index) {
            (Kind::Stored, 1) | (Kind::Removed, 1) => Field::BlockHashes,
            (Kind::Stored, 2) => Field::ParentBlockHash,
            (Kind::Stored, 3) => Field::TokenIds,
            (Kind::Stored, 4) => Field::BlockSize,
            (Kind::Stored, 5) => Field::LoraId,
            (Kind::Stored, 6) | (Kind::Removed, 2) => Field::Medium,
            (Kind::Stored, 7) => Field::LoraName,
            (Kind::Stored, 8) => Field::ExtraKeys,
            (Kind::Stored, 9) | (Kind::Removed, 3) => Field::GroupIdx,
            (Kind::Stored, 10) => Field::CacheKind,
            (Kind::Stored, 11) => Field::SlidingWindow,
            _ => Field::Ignored,
        }
    }

    /// Field named `key` in map events (vLLM 0.24+, SGLang 0.5.20+, which adds `cache_salt`).
    fn named(self, engine: Engine, key: &[u8]) -> Field {
        match (self, key) {
            (Kind::Stored, b"cache_salt") if engine == Engine::Sglang => Field::CacheSalt,
            (Kind::Stored | Kind::Removed, b"block_hashes") => Field::BlockHashes,
            (Kind::Stored | Kind::Removed, b"medium") => Field::Medium,
            (Kind::Stored | Kind::Removed, b"group_idx") => Field::GroupIdx,
            (Kind::Stored, b"parent_block_hash") => Field::ParentBlockHash,
            (Kind::Stored, b"token_ids") => Field::TokenIds,
            (Kind::Stored, b"block_size") => Field::BlockSize,
            (Kind::Stored, b"lora_id") => Field::LoraId,
            (Kind::Stored, b"lora_name") => Field::LoraName,
            (Kind::Stored, b"extra_keys") => Field::ExtraKeys,
            (Kind::Stored, b"kv_cache_spec_kind") => Field::CacheKind,
            (Kind::Stored, b"kv_cache_spec_sliding_window") => Field::SlidingWindow,
            (Kind::Stored | Kind::Removed, b"locality") => Field::Unused(Unused::Locality),
            (Kind::Stored | Kind::Removed, b"ownership") => Field::Unused(Unused::Ownership),
            (Kind::Stored, b"session_id") => Field::Unused(Unused::SessionId),
            (Kind::Stored, b"lookahead_token_ids") => Field::Unused(Unused::LookaheadTokenIds),
            _ => Field::Ignored,
        }
    }
}

/// The event fields the domain keeps, the known ones it does not use (skipped and counted),
/// and everything else (skipped).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Field {
    BlockHashes,
    ParentBlockHash,
    TokenIds,
    BlockSize,
    LoraId,
    Medium,
    LoraName,
    ExtraKeys,
    GroupIdx,
    CacheKind,
    SlidingWindow,
    /// SGLang's `cache_salt` (a map event's key).
    CacheSalt,
    /// SGLang ≤0.5.19's `{cache_salt}` map at position 7 of a salted positional store.
    Metadata,
    Unused(Unused),
    Ignored,
}

/// vLLM's event fields the index does not use (see [`IgnoredFields`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Unused {
    Locality,
    Ownership,
    SessionId,
    LookaheadTokenIds,
}

impl Unused {
    fn count(self, ignored: &mut IgnoredFields) {
        let counter = match self {
            Unused::Locality => &mut ignored.locality,
            Unused::Ownership => &mut ignored.ownership,
            Unused::SessionId => &mut ignored.session_id,
            Unused::LookaheadTokenIds => &mut ignored.lookahead_token_ids,
        };
        *counter = counter.saturating_add(1);
    }
}

/// Fields read so far; absent ones stay at their nil default.
#[derive(Debug, Default)]
struct Fields<'a> {
    block_hashes: Option<BlockHashes>,
    parent: Option<Hash<'a>>,
    token_ids: Vec<u32>,
    block_size: u32,
    lora_id: Option<i64>,
    medium: Option<&'a str>,
    lora_name: Option<&'a str>,
    extra_keys: Option<Vec<Option<HashValue>>>,
    group_idx: Option<u32>,
    cache_kind: Option<&'a str>,
    sliding_window: Option<u32>,
    cache_salt: Option<&'a str>,
    token_layout: TokenLayout,
}

#[derive(Debug)]
struct BlockHashes {
    hashes: Vec<EngineHash>,
    /// Full digests, kept only when every hash of the list came as bytes.
    digests: Option<Vec<Vec<u8>>>,
}

/// One event; `None` for an unknown tag (skipped).
fn decode_event(
    r: &mut Reader<'_>,
    engine: Engine,
    ignored: &mut IgnoredFields,
) -> Result<Option<KvEvent>, WireError> {
    match r.container("event")? {
        Container::Array => decode_array_event(r, engine, ignored),
        Container::Map => decode_map_event(r, engine, ignored),
    }
}

fn decode_array_event(
    r: &mut Reader<'_>,
    engine: Engine,
    ignored: &mut IgnoredFields,
) -> Result<Option<KvEvent>, WireError> {
    let len = r.array_len("event")?;
    if len == 0 {
        return Err(WireError::MissingField {
            field: "type",
            context: "event",
        });
    }
    let Some(kind) = Kind::from_tag(r.str_raw("event type")?) else {
        for _ in 1..len {
            r.skip(1)?;
        }
        return Ok(None);
    };
    let mut fields = Fields::default();
    for index in 1..len {
        read_field(
            r,
            engine,
            kind.positional(engine, index),
            &mut fields,
            ignored,
        )?;
    }
    build(kind, fields).map(Some)
}

fn decode_map_event(
    r: &mut Reader<'_>,
    engine: Engine,
    ignored: &mut IgnoredFields,
) -> Result<Option<KvEvent>, WireError> {
    let pairs = r.map_len("event")?;
    let body = r.position();

    // vLLM writes "type" first; any other producer's order costs one extra scan.
    let mut first_pair_read = false;
    let mut tag = None;
    if pairs > 0 && r.key()? == Some(b"type".as_slice()) {
        tag = Some(r.str_raw("event type")?);
        first_pair_read = true;
    } else {
        r.rewind(body);
        for _ in 0..pairs {
            if r.key()? == Some(b"type".as_slice()) {
                tag = Some(r.str_raw("event type")?);
            } else {
                r.skip(1)?;
            }
        }
        r.rewind(body);
    }
    let Some(tag) = tag else {
        return Err(WireError::MissingField {
            field: "type",
            context: "event",
        });
    };

    let kind = Kind::from_tag(tag);
    let mut fields = Fields::default();
    for _ in usize::from(first_pair_read)..pairs {
        let field = match (kind, r.key()?) {
            (Some(kind), Some(key)) => kind.named(engine, key),
            _ => Field::Ignored,
        };
        read_field(r, engine, field, &mut fields, ignored)?;
    }
    match kind {
        Some(kind) => build(kind, fields).map(Some),
        None => Ok(None),
    }
}

fn read_field<'a>(
    r: &mut Reader<'a>,
    engine: Engine,
    field: Field,
    fields: &mut Fields<'a>,
    ignored: &mut IgnoredFields,
) -> Result<(), WireError> {
    match field {
        Field::BlockHashes => fields.block_hashes = block_hashes(r)?,
        Field::ParentBlockHash => {
            fields.parent = if r.nil()? {
                None
            } else {
                Some(r.hash("parent_block_hash")?)
            }
        }
        Field::TokenIds if engine == Engine::Sglang => {
            (fields.token_ids, fields.token_layout) = sglang_token_ids(r)?;
        }
        Field::TokenIds => fields.token_ids = token_ids(r)?,
        Field::CacheSalt => fields.cache_salt = r.opt_str("cache_salt")?,
        Field::Metadata => fields.cache_salt = metadata_salt(r)?,
        Field::BlockSize => fields.block_size = r.opt_u32("block_size")?.unwrap_or(0),
        Field::LoraId => fields.lora_id = r.opt_i64("lora_id")?,
        Field::Medium => fields.medium = r.opt_str("medium")?,
        Field::LoraName => fields.lora_name = r.opt_str("lora_name")?,
        Field::ExtraKeys => fields.extra_keys = extra_keys(r)?,
        Field::GroupIdx => fields.group_idx = r.opt_u32("group_idx")?,
        Field::CacheKind => fields.cache_kind = r.opt_str("kv_cache_spec_kind")?,
        Field::SlidingWindow => {
            fields.sliding_window = r.opt_u32("kv_cache_spec_sliding_window")?;
        }
        Field::Unused(unused) => {
            if !r.nil()? {
                unused.count(ignored);
                r.skip(1)?;
            }
        }
        Field::Ignored => r.skip(1)?,
    }
    Ok(())
}

fn block_hashes(r: &mut Reader<'_>) -> Result<Option<BlockHashes>, WireError> {
    if r.nil()? {
        return Ok(None);
    }
    let len = r.array_len("block_hashes")?;
    check_limit("block_hashes", len, MAX_BLOCKS_PER_EVENT)?;
    let mut hashes = Vec::with_capacity(len);
    let mut digests: Option<Vec<Vec<u8>>> = None;
    let mut all_digests = true;
    for _ in 0..len {
        let hash = r.hash("block_hashes")?;
        match hash {
            Hash::Int(_) => all_digests = false,
            Hash::Digest(bytes) if all_digests => digests
                .get_or_insert_with(|| Vec::with_capacity(len))
                .push(bytes.to_vec()),
            Hash::Digest(_) => {}
        }
        hashes.push(hash.to_u64());
    }
    Ok(Some(BlockHashes {
        hashes,
        digests: digests.filter(|_| all_digests),
    }))
}

fn token_ids(r: &mut Reader<'_>) -> Result<Vec<u32>, WireError> {
    if r.nil()? {
        return Ok(Vec::new());
    }
    let len = r.array_len("token_ids")?;
    check_limit("token_ids", len, MAX_TOKENS_PER_EVENT)?;
    let mut tokens = Vec::with_capacity(len);
    r.u32_items(len, "token_ids", &mut tokens)?;
    Ok(tokens)
}

/// SGLang's token ids: u32 ids (read as vLLM's), or ids past u32, or EAGLE's bigram pairs
/// `[[t0, t1], [t1, t2], …]`, whose second tokens must chain into the next pair's first.
fn sglang_token_ids(r: &mut Reader<'_>) -> Result<(Vec<u32>, TokenLayout), WireError> {
    let start = r.position();
    if r.nil()? {
        return Ok((Vec::new(), TokenLayout::Plain));
    }
    let len = r.array_len("token_ids")?;
    check_limit("token_ids", len, MAX_TOKENS_PER_EVENT)?;
    if r.peek_container() != Some(Container::Array) {
        // The common case: every id fits u32.
        let mut fast = r.clone();
        let mut tokens = Vec::with_capacity(len);
        match fast.u32_items(len, "token_ids", &mut tokens) {
            Ok(()) => {
                *r = fast;
                return Ok((tokens, TokenLayout::Plain));
            }
            Err(WireError::IntOutOfRange { .. }) => {}
            Err(error) => return Err(error),
        }
    }
    r.rewind(start);
    let len = r.array_len("token_ids")?;
    let bigram = len > 0 && r.peek_container() == Some(Container::Array);
    let mut raw: Vec<u64> = Vec::with_capacity(len + usize::from(bigram));
    for i in 0..len {
        if !bigram {
            raw.push(r.u64_token("token_ids")?);
            continue;
        }
        let at = r.position();
        if r.array_len("token_ids")? != 2 {
            return Err(WireError::Inconsistent {
                field: "token_ids",
                reason: "a bigram is not two tokens",
                offset: at,
            });
        }
        let first = r.u64_token("token_ids")?;
        if i == 0 {
            raw.push(first);
        } else if raw.last() != Some(&first) {
            return Err(WireError::Inconsistent {
                field: "token_ids",
                reason: "a bigram does not start with the previous one's second token",
                offset: at,
            });
        }
        raw.push(r.u64_token("token_ids")?);
    }
    let narrow = |t: u64| u32::try_from(t).unwrap_or(u32::MAX);
    let token_ids: Vec<u32> = raw.iter().take(len).map(|&t| narrow(t)).collect();
    let layout = if raw.iter().any(|&t| u32::try_from(t).is_err()) {
        TokenLayout::Wide {
            tokens: raw,
            bigram,
        }
    } else if bigram {
        TokenLayout::Bigram {
            next: raw.last().map_or(0, |&t| narrow(t)),
        }
    } else {
        TokenLayout::Plain
    };
    Ok((token_ids, layout))
}

/// The salt of SGLang ≤0.5.19's `BlockStoredMetadata` map (`{cache_salt: str}`).
fn metadata_salt<'a>(r: &mut Reader<'a>) -> Result<Option<&'a str>, WireError> {
    if r.nil()? {
        return Ok(None);
    }
    let mut salt = None;
    for _ in 0..r.map_len("metadata")? {
        if r.key()? == Some(b"cache_salt".as_slice()) {
            salt = r.opt_str("cache_salt")?;
        } else {
            r.skip(1)?;
        }
    }
    Ok(salt)
}

fn extra_keys(r: &mut Reader<'_>) -> Result<Option<Vec<Option<HashValue>>>, WireError> {
    if r.nil()? {
        return Ok(None);
    }
    let len = r.array_len("extra_keys")?;
    check_limit("extra_keys", len, MAX_BLOCKS_PER_EVENT)?;
    let mut keys = Vec::with_capacity(len);
    for _ in 0..len {
        keys.push(if r.nil()? {
            None
        } else {
            Some(r.hash_value("extra_keys", 1)?)
        });
    }
    Ok(Some(keys))
}

fn build(kind: Kind, fields: Fields<'_>) -> Result<KvEvent, WireError> {
    let required_hashes = |hashes: Option<BlockHashes>| {
        hashes.ok_or(WireError::MissingField {
            field: "block_hashes",
            context: kind.name(),
        })
    };
    Ok(match kind {
        Kind::Stored => {
            let BlockHashes { hashes, digests } = required_hashes(fields.block_hashes)?;
            let (parent_block_hash, parent_digest) = match fields.parent {
                None => (None, None),
                Some(hash @ Hash::Int(_)) => (Some(hash.to_u64()), None),
                Some(hash @ Hash::Digest(bytes)) => (Some(hash.to_u64()), Some(bytes.to_vec())),
            };
            KvEvent::BlockStored(BlockStored {
                block_hashes: hashes,
                parent_block_hash,
                token_ids: fields.token_ids,
                block_size: fields.block_size,
                lora_id: fields.lora_id,
                lora_name: fields.lora_name.map(str::to_owned),
                medium: Medium::from_wire(fields.medium),
                extra_keys: fields.extra_keys,
                group_idx: fields.group_idx,
                cache_kind: fields.cache_kind.map(CacheKind::from_wire),
                sliding_window: fields.sliding_window,
                block_digests: digests,
                parent_digest,
                sglang: (fields.cache_salt.is_some() || fields.token_layout != TokenLayout::Plain)
                    .then(|| {
                        Box::new(SglangRun {
                            cache_salt: fields.cache_salt.map(str::to_owned),
                            token_layout: fields.token_layout,
                        })
                    }),
            })
        }
        Kind::Removed => KvEvent::BlockRemoved(BlockRemoved {
            block_hashes: required_hashes(fields.block_hashes)?.hashes,
            medium: Medium::from_wire(fields.medium),
            group_idx: fields.group_idx,
        }),
        Kind::Cleared => KvEvent::AllBlocksCleared,
    })
}
