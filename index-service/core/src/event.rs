//! Domain KV-cache events: what the index applies, independent of the engines' wire encodings.
//!
//! `wire` turns every vLLM and SGLang msgpack encoding into these; the index and the agent only
//! see these.

use kvroute_block_keys::HashValue;

/// A block hash as an engine publishes it, reduced to vLLM's u64 form
/// (`int.from_bytes(digest, "big") & (2**64 - 1)`: the digest's last 8 bytes, big-endian).
/// SGLang's signed i64 hashes keep their 64 bits.
pub type EngineHash = u64;

/// The engine family whose events a feed carries (configuration's `engine`).
pub use kvroute_config::Engine;

/// Where the engine holds a block (`medium` in vLLM events).
///
/// A fixed enum so it can label metrics; unknown connector media map to [`Medium::Other`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub enum Medium {
    /// Accelerator memory (`"GPU"`, and the implied medium of events before 0.10.2).
    #[default]
    Gpu,
    /// Host memory offload (`"CPU"`, SGLang's `"CPU_PINNED"`).
    Cpu,
    /// Disk, file system or object storage (`"STORAGE"`, `"FS"`, `"OBJ"`, `"DISK"`).
    Storage,
    /// Any other medium a connector reports (SGLang's `"EXTERNAL"` shared pool included).
    Other,
}

impl Medium {
    /// Parses vLLM's (or SGLang's) `medium` string; `None` (older releases) means GPU.
    pub fn from_wire(medium: Option<&str>) -> Self {
        match medium {
            None => Medium::Gpu,
            Some(m) if m.eq_ignore_ascii_case("gpu") => Medium::Gpu,
            // SGLang's host tier is `CPU_PINNED`.
            Some(m) if m.eq_ignore_ascii_case("cpu") || m.eq_ignore_ascii_case("cpu_pinned") => {
                Medium::Cpu
            }
            Some(m)
                if ["storage", "fs", "obj", "disk"]
                    .iter()
                    .any(|s| m.eq_ignore_ascii_case(s)) =>
            {
                Medium::Storage
            }
            Some(_) => Medium::Other,
        }
    }

    /// Metric label value.
    pub fn as_label(self) -> &'static str {
        match self {
            Medium::Gpu => "gpu",
            Medium::Cpu => "cpu",
            Medium::Storage => "storage",
            Medium::Other => "other",
        }
    }
}

/// One engine step's events (`KVEventBatch`), with the 8-byte sequence number of its ZMQ frame.
#[derive(Debug, Clone, PartialEq)]
pub struct EventBatch {
    /// Engine wall-clock time of the step, Unix seconds.
    pub ts: f64,
    /// Data-parallel rank that published it (`None` before vLLM 0.9.1).
    pub dp_rank: Option<u32>,
    /// Events in the order the engine performed them.
    pub events: Vec<KvEvent>,
}

/// A KV-cache event.
#[derive(Debug, Clone, PartialEq)]
pub enum KvEvent {
    /// Full blocks became cached.
    BlockStored(BlockStored),
    /// Blocks were evicted.
    BlockRemoved(BlockRemoved),
    /// The engine dropped its whole prefix cache (`reset_prefix_cache`).
    AllBlocksCleared,
}

/// `BlockStored`: consecutive full blocks of one request, in chain order.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct BlockStored {
    /// Published hashes, one per block.
    pub block_hashes: Vec<EngineHash>,
    /// Hash of the block before the first one; `None` when the run starts at block 0.
    pub parent_block_hash: Option<EngineHash>,
    /// `block_hashes.len() * block_size` token ids (empty for connector placeholder events).
    pub token_ids: Vec<u32>,
    /// Tokens per block (0 for connector placeholder events).
    pub block_size: u32,
    /// LoRA adapter int id (deprecated by vLLM since 0.14, still sent).
    pub lora_id: Option<i64>,
    /// LoRA adapter name (0.14+).
    pub lora_name: Option<String>,
    /// Where the blocks are held.
    pub medium: Medium,
    /// Per-block extra hash keys as published (0.17+): one entry per block, `None` for plain text.
    pub extra_keys: Option<Vec<Option<HashValue>>>,
    /// KV-cache group (0.20+); hybrid models publish one group per attention kind.
    pub group_idx: Option<u32>,
    /// The group's kind (`kv_cache_spec_kind`, 0.22+); `None` from older engines.
    pub cache_kind: Option<CacheKind>,
    /// The group's sliding window in tokens (`kv_cache_spec_sliding_window`, 0.22+), for
    /// sliding-window groups.
    pub sliding_window: Option<u32>,
    /// Full 32-byte (or 16-byte xxhash) digests when the engine publishes raw bytes
    /// (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`); lets the index verify mid-chain runs.
    pub block_digests: Option<Vec<Vec<u8>>>,
    /// Full digest of the parent, when published as raw bytes.
    pub parent_digest: Option<Vec<u8>>,
    /// What SGLang publishes beyond vLLM's fields; `None` for vLLM's runs and SGLang's plain,
    /// unsalted ones (boxed: rare, and every event would carry its size).
    pub sglang: Option<Box<SglangRun>>,
}

impl BlockStored {
    /// The request's cache salt as SGLang publishes it.
    pub fn cache_salt(&self) -> Option<&str> {
        self.sglang.as_ref()?.cache_salt.as_deref()
    }

    /// How `token_ids` relate to the tokens the engine hashed.
    pub fn token_layout(&self) -> &TokenLayout {
        const PLAIN: &TokenLayout = &TokenLayout::Plain;
        self.sglang.as_ref().map_or(PLAIN, |run| &run.token_layout)
    }
}

/// An SGLang run's fields that vLLM's runs do not have.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct SglangRun {
    /// The request's cache salt (vLLM hashes it into `extra_keys`): SGLang seeds the salted
    /// request's chain with it.
    pub cache_salt: Option<String>,
    /// How `token_ids` relate to the tokens SGLang hashed, when they are not plain u32 ids.
    pub token_layout: TokenLayout,
}

/// SGLang's token ids beyond plain u32 ids. `token_ids` always holds one token per position
/// (`block_hashes.len() * block_size`), so everything that reads tokens per block still can.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum TokenLayout {
    /// `token_ids` are the hashed tokens.
    #[default]
    Plain,
    /// EAGLE-family speculative decoding: SGLang keys position `i` by the pair (`token_ids[i]`,
    /// `token_ids[i + 1]`), the last position's pair ending in `next`. Published as those pairs.
    Bigram {
        /// The second token of the last position's pair.
        next: u32,
    },
    /// Some token exceeds u32 (SGLang 0.5.23's multimodal pads): the tokens as published, one
    /// per position (one more when `bigram`, the pairs' tokens as above); `token_ids` holds
    /// `u32::MAX` where a token does not fit.
    Wide {
        /// The positions' tokens, plus the last pair's second token when `bigram`.
        tokens: Vec<u64>,
        /// Positions are pairs, as in [`TokenLayout::Bigram`].
        bigram: bool,
    },
}

impl TokenLayout {
    /// The words SGLang hashed for the `block_size` positions starting at `start` of a run
    /// whose per-position tokens are `token_ids` (a bigram page's flattened pairs), appended
    /// to `out`. `None` when the run is shorter than that.
    pub fn page_words(
        &self,
        token_ids: &[u32],
        start: usize,
        block_size: usize,
        out: &mut Vec<u64>,
    ) -> Option<()> {
        let end = start.checked_add(block_size)?;
        let pairs = |tokens: &[u64], out: &mut Vec<u64>| {
            for pair in tokens.windows(2) {
                out.extend_from_slice(pair);
            }
        };
        match self {
            TokenLayout::Plain => {
                out.extend(token_ids.get(start..end)?.iter().map(|&t| u64::from(t)));
            }
            TokenLayout::Bigram { next } => {
                let mut tokens: Vec<u64> = token_ids
                    .get(start..end)?
                    .iter()
                    .map(|&t| u64::from(t))
                    .collect();
                tokens.push(u64::from(token_ids.get(end).copied().unwrap_or(*next)));
                pairs(&tokens, out);
            }
            TokenLayout::Wide {
                tokens,
                bigram: false,
            } => out.extend_from_slice(tokens.get(start..end)?),
            TokenLayout::Wide {
                tokens,
                bigram: true,
            } => pairs(tokens.get(start..=end)?, out),
        }
        Some(())
    }

    /// Whether the page of `block_size` positions at `start` holds a token past u32.
    pub fn is_wide_page(&self, start: usize, block_size: usize) -> bool {
        let TokenLayout::Wide { tokens, bigram } = self else {
            return false;
        };
        let end = (start + block_size + usize::from(*bigram)).min(tokens.len());
        tokens
            .get(start.min(end)..end)
            .is_some_and(|page| page.iter().any(|&t| u32::try_from(t).is_err()))
    }
}
/// The kind of a KV-cache group (`kv_cache_spec_kind`), which decides what a cache hit needs
/// from it (vLLM's `KVCacheSpecKind`). A fixed enum so it can label metrics; a kind this
/// release does not know is [`CacheKind::Unknown`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum CacheKind {
    /// `full_attention`: every block of the prefix is needed.
    FullAttention,
    /// `mla_attention`: full attention with latent KV; every block is needed.
    MlaAttention,
    /// `sink_full_attention`: full attention with sink tokens; every block is needed.
    SinkFullAttention,
    /// `sliding_window`: only the blocks of the window before the cut are needed.
    SlidingWindow,
    /// `sliding_window_mla`: sliding window with latent KV.
    SlidingWindowMla,
    /// `chunked_local_attention`: only the blocks of the cut's chunk are needed.
    ChunkedLocalAttention,
    /// `mamba`: recurrent state (Mamba, linear attention).
    Mamba,
    /// `encoder_only_attention`.
    EncoderOnlyAttention,
    /// `cross_attention`.
    CrossAttention,
    /// `unknown`, or a kind this release of kvroute does not know.
    Unknown,
}

impl CacheKind {
    /// Every kind, for pre-registering metric series.
    pub const ALL: [CacheKind; 10] = [
        CacheKind::FullAttention,
        CacheKind::MlaAttention,
        CacheKind::SinkFullAttention,
        CacheKind::SlidingWindow,
        CacheKind::SlidingWindowMla,
        CacheKind::ChunkedLocalAttention,
        CacheKind::Mamba,
        CacheKind::EncoderOnlyAttention,
        CacheKind::CrossAttention,
        CacheKind::Unknown,
    ];

    /// Parses vLLM's `kv_cache_spec_kind` string.
    pub fn from_wire(kind: &str) -> Self {
        CacheKind::ALL
            .into_iter()
            .find(|known| *known != CacheKind::Unknown && known.as_label() == kind)
            .unwrap_or(CacheKind::Unknown)
    }

    /// vLLM's name of the kind (also the metric label).
    pub fn as_label(self) -> &'static str {
        match self {
            CacheKind::FullAttention => "full_attention",
            CacheKind::MlaAttention => "mla_attention",
            CacheKind::SinkFullAttention => "sink_full_attention",
            CacheKind::SlidingWindow => "sliding_window",
            CacheKind::SlidingWindowMla => "sliding_window_mla",
            CacheKind::ChunkedLocalAttention => "chunked_local_attention",
            CacheKind::Mamba => "mamba",
            CacheKind::EncoderOnlyAttention => "encoder_only_attention",
            CacheKind::CrossAttention => "cross_attention",
            CacheKind::Unknown => "unknown",
        }
    }

    /// Whether a hit needs every block of the prefix (vLLM's `FullAttentionSpec` family: the
    /// groups its coordinator scans left to right).
    pub fn is_full_attention(self) -> bool {
        matches!(
            self,
            CacheKind::FullAttention | CacheKind::MlaAttention | CacheKind::SinkFullAttention
        )
    }
}

/// `BlockRemoved`: blocks evicted from one medium.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct BlockRemoved {
    /// Published hashes of the evicted blocks.
    pub block_hashes: Vec<EngineHash>,
    /// Medium they were evicted from.
    pub medium: Medium,
    /// KV-cache group (0.20+).
    pub group_idx: Option<u32>,
}
