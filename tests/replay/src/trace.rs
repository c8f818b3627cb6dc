//! Mooncake-format traces: one JSON object per line with `timestamp` (ms), `input_length`,
//! `output_length` and `hash_ids` (one id per 512-token block of the prompt).
//!
//! # Block keys
//!
//! A hash id names a block *given everything before it* (the trace's chain is the prefix
//! identity), so each id is mapped to a chained key, `key[i] = xxh3(key[i-1] ‖ hash_id[i])`,
//! like vLLM's block hashes: two requests share block `i` only when they share blocks `0..=i`.
//!
//! # Partial blocks
//!
//! `hash_ids` has `ceil(input_length / 512)` entries, so unless `input_length` is a multiple of
//! 512 the last id covers a partial block. vLLM only caches full blocks, so a partial block is
//! never cached, matched or published: it is always prefilled, and only the leading
//! `input_length / 512` keys ([`Request::keys`]) take part in caching and routing.
//!
//! # Sessions
//!
//! A record may carry a `session_id` (alias `conversation_id`; a number or a string): the
//! conversation, user or agent it belongs to. [`Request::session`] is a hash of it, or, when the
//! trace has none (the Mooncake traces do not), of the first [`SESSION_PREFIX_BLOCKS`] blocks:
//! the chained key of block `min(full blocks, 8) − 1`, which names those blocks and everything
//! before them (the partial first block when there is no full one).

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::BLOCK_TOKENS;

/// Leading blocks that stand in for a session when a record names none: 8 × 512 = 4096 tokens,
/// long enough to get past a system prompt shared by every conversation (the first block alone
/// sent a whole multi-turn trace to one replica), short enough that a conversation's turns
/// keep one key once its first turn is that long.
pub const SESSION_PREFIX_BLOCKS: usize = 8;

/// A record's session, conversation or user id, as the trace spells it.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(untagged)]
pub enum SessionId {
    /// A numeric id.
    Number(u64),
    /// A textual id.
    Text(String),
}

impl SessionId {
    /// The id's 64-bit key (xxh3 of its bytes, a tag byte keeping `7` and `"7"` apart).
    pub fn key(&self) -> u64 {
        let mut bytes = Vec::new();
        match self {
            SessionId::Number(n) => {
                bytes.push(0);
                bytes.extend_from_slice(&n.to_le_bytes());
            }
            SessionId::Text(text) => {
                bytes.push(1);
                bytes.extend_from_slice(text.as_bytes());
            }
        }
        xxhash_rust::xxh3::xxh3_64(&bytes)
    }
}

/// One trace line as written in the file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TraceRecord {
    /// Arrival time, ms from the trace start.
    pub timestamp: u64,
    /// Prompt tokens.
    pub input_length: u32,
    /// Generated tokens.
    pub output_length: u32,
    /// One id per 512-token prompt block (the last may be partial).
    pub hash_ids: Vec<u64>,
    /// The session (conversation, user, agent) the request belongs to, if the trace says.
    #[serde(
        default,
        alias = "conversation_id",
        skip_serializing_if = "Option::is_none"
    )]
    pub session_id: Option<SessionId>,
}

/// A trace that could not be read.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    /// The file could not be opened or read.
    #[error("reading {path}: {source}")]
    Io {
        /// The trace file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// A line is not a valid record.
    #[error("{path}:{line}: {reason}")]
    BadLine {
        /// The trace file.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// What is wrong with it.
        reason: String,
    },
    /// The file holds no request.
    #[error("{path}: no requests")]
    Empty {
        /// The trace file.
        path: PathBuf,
    },
}

impl TraceError {
    /// Short label of the error kind.
    pub fn as_label(&self) -> &'static str {
        match self {
            Self::Io { .. } => "io",
            Self::BadLine { .. } => "bad_line",
            Self::Empty { .. } => "empty",
        }
    }
}

/// A request ready to simulate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    /// Position in arrival order (0-based).
    pub id: usize,
    /// Arrival time, µs of virtual time.
    pub arrival_us: u64,
    /// Prompt tokens.
    pub input_tokens: u32,
    /// Generated tokens (at least 1: the first token ends the prefill).
    pub output_tokens: u32,
    /// Chained keys of every prompt block, the partial last one included.
    pub chain: Vec<u64>,
    /// How many leading blocks are full (cacheable).
    pub full_blocks: usize,
    /// Session key: the record's session id hashed, else the prefix key (see the module docs).
    pub session: u64,
}

impl Request {
    /// Keys of the full (cacheable) prompt blocks.
    pub fn keys(&self) -> &[u64] {
        &self.chain[..self.full_blocks]
    }

    /// Most KV tokens the request holds (prompt plus every generated token but the last, whose
    /// KV is never written).
    pub fn peak_kv_tokens(&self) -> u32 {
        self.input_tokens + self.output_tokens.saturating_sub(1)
    }

    /// Most blocks the request holds at once.
    pub fn peak_blocks(&self) -> u32 {
        self.peak_kv_tokens().div_ceil(BLOCK_TOKENS)
    }

    /// Most leading blocks a cache hit may cover: vLLM always computes the last prompt token,
    /// so a prompt that is an exact multiple of the block size can hit all blocks but one.
    pub fn max_hit_blocks(&self) -> usize {
        (self.input_tokens.saturating_sub(1) / BLOCK_TOKENS) as usize
    }
}

/// Chains a trace's hash ids into block keys (see the module docs).
pub fn chain_keys(hash_ids: &[u64]) -> Vec<u64> {
    let mut keys = Vec::with_capacity(hash_ids.len());
    let mut parent: u64 = 0x6b76_726f_7574_6531; // "kvroute1": the root of every chain
    for id in hash_ids {
        let mut bytes = [0u8; 16];
        bytes[..8].copy_from_slice(&parent.to_le_bytes());
        bytes[8..].copy_from_slice(&id.to_le_bytes());
        parent = xxhash_rust::xxh3::xxh3_64(&bytes);
        keys.push(parent);
    }
    keys
}

/// Checks one record and turns it into a request.
pub fn prepare(id: usize, record: &TraceRecord) -> Result<Request, String> {
    if record.input_length == 0 {
        return Err("input_length is 0".to_owned());
    }
    let expected = record.input_length.div_ceil(BLOCK_TOKENS) as usize;
    if record.hash_ids.len() != expected {
        return Err(format!(
            "{} hash_ids for input_length {} (expected ceil(input_length / {BLOCK_TOKENS}) = {expected})",
            record.hash_ids.len(),
            record.input_length
        ));
    }
    let chain = chain_keys(&record.hash_ids);
    let full_blocks = (record.input_length / BLOCK_TOKENS) as usize;
    let session = match &record.session_id {
        Some(session) => session.key(),
        None => prefix_session_key(&chain, full_blocks),
    };
    Ok(Request {
        id,
        arrival_us: record.timestamp.saturating_mul(1000),
        input_tokens: record.input_length,
        output_tokens: record.output_length.max(1),
        chain,
        full_blocks,
        session,
    })
}

/// The session key of a request without a session id: the chained key of its first
/// [`SESSION_PREFIX_BLOCKS`] full blocks (fewer if it has fewer; its first, partial, block if
/// it has none).
pub fn prefix_session_key(chain: &[u64], full_blocks: usize) -> u64 {
    let blocks = full_blocks.clamp(1, SESSION_PREFIX_BLOCKS);
    chain.get(blocks - 1).or(chain.last()).copied().unwrap_or(0)
}

/// Turns records into requests sorted by arrival (stable: equal timestamps keep file order).
pub fn prepare_all(records: &[TraceRecord]) -> Result<Vec<Request>, (usize, String)> {
    let mut order: Vec<usize> = (0..records.len()).collect();
    order.sort_by_key(|i| records[*i].timestamp);
    order
        .iter()
        .enumerate()
        .map(|(id, i)| prepare(id, &records[*i]).map_err(|reason| (*i, reason)))
        .collect()
}

/// Reads a Mooncake JSONL file. Blank lines are skipped; any other bad line is an error naming
/// the line.
pub fn read_records(path: &Path) -> Result<Vec<TraceRecord>, TraceError> {
    let io = |source| TraceError::Io {
        path: path.to_owned(),
        source,
    };
    let file = std::fs::File::open(path).map_err(io)?;
    let mut records = Vec::new();
    for (index, line) in BufReader::new(file).lines().enumerate() {
        let line = line.map_err(io)?;
        if line.trim().is_empty() {
            continue;
        }
        let record: TraceRecord = serde_json::from_str(&line).map_err(|e| TraceError::BadLine {
            path: path.to_owned(),
            line: index + 1,
            reason: e.to_string(),
        })?;
        records.push(record);
    }
    if records.is_empty() {
        return Err(TraceError::Empty {
            path: path.to_owned(),
        });
    }
    Ok(records)
}

/// Reads and prepares a trace file.
pub fn read_trace(path: &Path) -> Result<Vec<Request>, TraceError> {
    let records = read_records(path)?;
    // Line numbers of checked records: non-blank lines in order.
    prepare_all(&records).map_err(|(index, reason)| TraceError::BadLine {
        path: path.to_owned(),
        line: line_of_record(path, index).unwrap_or(index + 1),
        reason,
    })
}

/// The 1-based line of the `index`-th non-blank line.
fn line_of_record(path: &Path, index: usize) -> Option<usize> {
    let text = std::fs::read_to_string(path).ok()?;
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .nth(index)
        .map(|(n, _)| n + 1)
}

/// Writes records as Mooncake JSONL.
pub fn write_records(path: &Path, records: &[TraceRecord]) -> Result<(), TraceError> {
    let io = |source| TraceError::Io {
        path: path.to_owned(),
        source,
    };
    let mut out = std::io::BufWriter::new(std::fs::File::create(path).map_err(io)?);
    for record in records {
        let line = serde_json::to_string(record).map_err(|e| io(std::io::Error::other(e)))?;
        writeln!(out, "{line}").map_err(io)?;
    }
    out.flush().map_err(io)
}

/// Every request scaled in time: arrivals divided by `compression` (2 = twice the rate).
pub fn compress(requests: &[Request], compression: f64) -> Vec<Request> {
    requests
        .iter()
        .map(|r| Request {
            arrival_us: (r.arrival_us as f64 / compression).round() as u64,
            ..r.clone()
        })
        .collect()
}

/// The trace's timestamp resolution, µs: the greatest common divisor of its arrival times
/// (Mooncake timestamps are whole ms, so at least 1000; a trace stamped in whole seconds gives
/// 1 000 000). 1000 when every request arrives at 0.
pub fn timestamp_resolution_us(requests: &[Request]) -> u64 {
    let gcd = |mut a: u64, mut b: u64| {
        while b != 0 {
            (a, b) = (b, a % b);
        }
        a
    };
    match requests.iter().fold(0, |acc, r| gcd(acc, r.arrival_us)) {
        0 => 1000,
        resolution => resolution,
    }
}

/// Spreads each request uniformly within its timestamp's resolution: a request stamped `t`
/// arrives in `[t, t + resolution)` (and before the next timestamp), drawn from `seed`.
/// `requests` must be sorted by arrival (as [`prepare_all`] leaves them). The offsets drawn for requests that
/// share a timestamp are sorted and handed out in file order, so arrival order (and every id)
/// is unchanged: a conversation's turn never overtakes the previous one, and the later of two
/// requests stamped together still arrives later. What changes is that a burst stamped at one
/// instant no longer reaches the router within one microsecond, before any engine or metric
/// can move.
pub fn jitter(requests: &[Request], resolution_us: u64, seed: u64) -> Vec<Request> {
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut out = requests.to_vec();
    let mut start = 0;
    while start < out.len() {
        let stamp = out[start].arrival_us;
        let end = start
            + out[start..]
                .iter()
                .take_while(|r| r.arrival_us == stamp)
                .count();
        // Never past the next timestamp, whatever resolution the caller gives.
        let span = out
            .get(end)
            .map_or(resolution_us, |next| next.arrival_us.saturating_sub(stamp))
            .min(resolution_us)
            .max(1);
        let mut offsets: Vec<u64> = (start..end).map(|_| rng.random_range(0..span)).collect();
        offsets.sort_unstable();
        for (request, offset) in out[start..end].iter_mut().zip(offsets) {
            request.arrival_us = stamp + offset;
        }
        start = end;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(text: &str) -> tempfile::NamedTempFile {
        let mut file = tempfile::NamedTempFile::new().unwrap();
        file.write_all(text.as_bytes()).unwrap();
        file
    }

    #[test]
    fn reads_and_chains() {
        let file = write(
            "{\"timestamp\": 5, \"input_length\": 1100, \"output_length\": 3, \"hash_ids\": [1, 2, 3]}\n\n\
             {\"timestamp\": 1, \"input_length\": 1024, \"output_length\": 0, \"hash_ids\": [1, 9]}\n",
        );
        let requests = read_trace(file.path()).unwrap();
        assert_eq!(requests.len(), 2);
        // Sorted by arrival.
        assert_eq!(requests[0].arrival_us, 1000);
        assert_eq!(requests[0].output_tokens, 1);
        assert_eq!(requests[0].keys().len(), 2);
        assert_eq!(requests[0].max_hit_blocks(), 1);
        assert_eq!(
            requests[1].keys().len(),
            2,
            "the partial third block is not a key"
        );
        assert_eq!(requests[0].chain[0], requests[1].chain[0]);
        assert_ne!(requests[0].chain[1], requests[1].chain[1]);
        // Same id after a different parent is a different block.
        assert_ne!(chain_keys(&[1, 2])[1], chain_keys(&[3, 2])[1]);
    }

    #[test]
    fn session_key_is_the_id_else_the_leading_blocks() {
        let record = |ids: Vec<u64>, session_id| TraceRecord {
            timestamp: 0,
            input_length: ids.len() as u32 * BLOCK_TOKENS,
            output_length: 1,
            hash_ids: ids,
            session_id,
        };
        let key = |ids: Vec<u64>, session| prepare(0, &record(ids, session)).unwrap().session;
        // No id: requests sharing only a first (system prompt) block get different keys …
        assert_ne!(key(vec![1, 2], None), key(vec![1, 3], None));
        // … and a conversation's turns keep one once it has SESSION_PREFIX_BLOCKS blocks.
        let turn: Vec<u64> = (0..SESSION_PREFIX_BLOCKS as u64).collect();
        let mut longer = turn.clone();
        longer.extend([90, 91, 92]);
        assert_eq!(key(turn.clone(), None), key(longer.clone(), None));
        // An id wins over the prompt: same id, different prompts → same key; ids are typed.
        let seven = Some(SessionId::Number(7));
        assert_eq!(key(vec![1], seven.clone()), key(longer, seven.clone()));
        assert_ne!(
            key(vec![1], seven),
            key(vec![1], Some(SessionId::Text("7".to_owned())))
        );
        // Read from JSON under either name, numeric or textual; absent stays absent on write.
        let line = |field: &str| {
            format!(
                "{{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [1], {field}}}\n"
            )
        };
        let file = write(&(line("\"session_id\": 5") + &line("\"conversation_id\": \"c-9\"")));
        let records = read_records(file.path()).unwrap();
        assert_eq!(records[0].session_id, Some(SessionId::Number(5)));
        assert_eq!(
            records[1].session_id,
            Some(SessionId::Text("c-9".to_owned()))
        );
        let plain = serde_json::to_string(&record(vec![1], None)).unwrap();
        assert!(!plain.contains("session"), "{plain}");
    }

    fn stamped(ms: &[u64]) -> Vec<Request> {
        let records: Vec<TraceRecord> = ms
            .iter()
            .map(|&timestamp| TraceRecord {
                timestamp,
                input_length: 10,
                output_length: 1,
                hash_ids: vec![timestamp],
                session_id: None,
            })
            .collect();
        prepare_all(&records).unwrap()
    }

    #[test]
    fn jitter_spreads_within_the_resolution_keeping_order() {
        let requests = stamped(&[0, 0, 0, 5, 5, 7, 1000, 1000, 1000, 1000]);
        assert_eq!(timestamp_resolution_us(&requests), 1000);
        assert_eq!(
            timestamp_resolution_us(&stamped(&[0, 2000, 6000])),
            2_000_000
        );
        assert_eq!(timestamp_resolution_us(&stamped(&[0, 0])), 1000);
        let jittered = jitter(&requests, 1000, 3);
        assert_eq!(jittered, jitter(&requests, 1000, 3), "seeded");
        assert_ne!(jittered, jitter(&requests, 1000, 4));
        for (raw, moved) in requests.iter().zip(&jittered) {
            assert_eq!(raw.id, moved.id);
            assert_eq!(raw.chain, moved.chain);
            assert!((raw.arrival_us..raw.arrival_us + 1000).contains(&moved.arrival_us));
        }
        // Order kept, within a timestamp and across: ids stay positions in arrival order.
        assert!(
            jittered
                .windows(2)
                .all(|w| w[0].arrival_us <= w[1].arrival_us)
        );
        // A burst no longer lands on one instant.
        let burst: std::collections::HashSet<u64> =
            jittered[6..].iter().map(|r| r.arrival_us).collect();
        assert!(burst.len() > 1, "{burst:?}");
        // A resolution larger than the gap to the next timestamp is clipped to the gap.
        let wide = jitter(&requests, 1_000_000, 3);
        assert!(wide.windows(2).all(|w| w[0].arrival_us <= w[1].arrival_us));
        assert!(wide[..3].iter().all(|r| r.arrival_us < 5000));
    }

    #[test]
    fn bad_lines_name_their_line() {
        let file = write(
            "{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [1]}\n\nnot json\n",
        );
        let error = read_trace(file.path()).unwrap_err();
        assert_eq!(error.as_label(), "bad_line");
        assert!(error.to_string().contains(":3:"), "{error}");
        let file = write(
            "{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [1]}\n\
             {\"timestamp\": 0, \"input_length\": 1000, \"output_length\": 1, \"hash_ids\": [1]}\n",
        );
        let error = read_trace(file.path()).unwrap_err();
        assert!(error.to_string().contains(":2:"), "{error}");
        assert_eq!(
            read_trace(write("\n").path()).unwrap_err().as_label(),
            "empty"
        );
    }
}
