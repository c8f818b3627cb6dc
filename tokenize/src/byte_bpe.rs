//! A fast, exact encoder for BPE pipelines: byte-level BPE (GPT-2 style `tokenizer.json`, the
//! `Split`-regex pipelines of Llama 3, Qwen2/2.5/3, o200k (gpt-oss), Tekken (Mistral NeMo) and
//! DeepSeek-V3) and SentencePiece-style BPE (Llama 2, Gemma: `▁` for spaces, byte fallback).
//!
//! `tokenizers::Tokenizer::encode_fast` spends most of its time on bookkeeping we never read
//! (offset alignment in `NormalizedString`, per-piece allocations, Oniguruma). [`FastBpe`]
//! computes the same ids directly: added tokens are cut out of the raw text, each remaining
//! segment is normalized, split by the pre-tokenizer (a hand-written scanner: `gpt2_split`, or
//! `split` for the `Split` regexes it recognises by their exact strings, or `sentencepiece`'s
//! words and cuts), each piece starts as one symbol per byte (byte-level) or per char
//! (SentencePiece, with `<0xNN>` byte fallback) and is merged by rank exactly as `tokenizers`'
//! BPE does (or taken whole from the vocab with `ignore_merges`), and the post-processor's special
//! tokens wrap the result. A word cache memoizes pieces.
//!
//! Modelled exactly — [`FastBpe::from_tokenizer_json`] returns `Some` only for this:
//! - `normalizer`: null, `NFC` (computed by `unicode-normalization-alignments`, the crate
//!   `tokenizers` itself runs), `Prepend`, `Replace` of a literal string, or a `Sequence` of
//!   those; `truncation`, `padding`: null;
//! - byte-level: `pre_tokenizer` `ByteLevel { add_prefix_space: false, use_regex: true }`, or a
//!   `Sequence` of `Split { pattern: Regex(P), behavior: Isolated, invert: false }`s and
//!   `ByteLevel { add_prefix_space: false, use_regex: false }` where the Ps are exactly Llama 3's,
//!   Qwen2's, o200k's, Tekken's or DeepSeek-V3's three (`split::LLAMA3`, …); all 256 byte-level
//!   chars in the vocab (so `unk` can never occur), no byte fallback;
//! - SentencePiece-style: `pre_tokenizer` null, `Split { pattern: String, behavior:
//!   MergedWithPrevious }` or `Metaspace` (any `prepend_scheme`, `split` on or off); chars as
//!   initial symbols, `byte_fallback` (with every byte token a missing char can need), else the
//!   unknown token (`fuse_unk`) or nothing;
//! - `model`: BPE without dropout, continuing-subword prefix or end-of-word suffix; merges as
//!   `"a b"` strings or `[a, b]` pairs; `ignore_merges` honoured;
//! - `added_tokens` without `single_word`/`lstrip`/`rstrip` (matched leftmost-longest, first the
//!   non-normalized ones in the raw text, then the normalized ones — in their normalized form —
//!   in what is left, the two passes of `tokenizers`; `special` does not change encoding); ids
//!   assigned as `tokenizers` does on load (the model's id when the content is in the vocab,
//!   else the next free id from the vocab size);
//! - `post_processor`: null, `ByteLevel` (offsets only), `TemplateProcessing` whose `single`
//!   template is special tokens around exactly one `$A`, or a `Sequence` of those.
//!
//! Everything else (other normalizers and `Split` patterns, `add_prefix_space`, WordPiece,
//! Unigram, …) yields `None` and stays with `tokenizers`. [`crate::ModelTokenizer`] also
//! cross-checks both encoders on a sample at load and keeps `tokenizers` when they differ.

mod gpt2_split;
mod normalize;
mod sentencepiece;
pub(crate) mod split;

use std::borrow::Cow;
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, HashSet};
use std::hash::{BuildHasherDefault, Hasher};

use daachorse::{DoubleArrayAhoCorasick, DoubleArrayAhoCorasickBuilder, MatchKind};
use parking_lot::Mutex;
use serde_json::Value;
use unicode_normalization_alignments::{IsNormalized, UnicodeNormalization, is_nfc_quick};

use sentencepiece::{CharSymbols, Cuts, Words};
use split::SplitPattern;

use crate::TokenizeError;

/// Pieces at most this long (bytes) are memoized; longer ones are rare and cheap to skip.
const CACHE_MAX_WORD_LEN: usize = 30;
/// Most ids a cached word may have.
const CACHE_MAX_WORD_IDS: usize = 8;
/// Buckets of the word cache (a power of two) of two one-cache-line slots each: 8 MiB. Four
/// times the 2 MiB it was keeps more of a stream of new prompts' words (`encode_*_new_text`
/// groups, docs/benchmarks-history-2026-12.md); a lookup still reads one bucket.
const CACHE_BUCKETS: usize = 1 << 16;
/// Pieces encoded per hold of the word cache's lock, their buckets read together first.
const PIECE_BATCH: usize = 64;
/// Words of at most this many initial symbols are merged by [`FastBpe::merge_short`]:
/// rescanning a few pair ranks per merge is cheaper than a heap's pushes and pops and its stale
/// candidates' extra merge-table probes, and most pieces are this short.
const SHORT_WORD: usize = 24;

/// Which family of pipelines a [`FastBpe`] encodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FastEncoderKind {
    /// Byte-level BPE (GPT-2, Llama 3, Qwen2/3, o200k, Tekken, DeepSeek-V3).
    ByteBpe,
    /// SentencePiece-style BPE (Llama 2, Gemma): chars, `▁`, byte fallback.
    SentencePieceBpe,
}

impl FastEncoderKind {
    /// The name `kvroute-check` reports: `fast-byte-bpe` or `fast-sentencepiece-bpe`.
    pub fn name(self) -> &'static str {
        match self {
            Self::ByteBpe => "fast-byte-bpe",
            Self::SentencePieceBpe => "fast-sentencepiece-bpe",
        }
    }
}

/// The exact fast encoder of one BPE `tokenizer.json`; see the module docs.
pub struct FastBpe {
    /// The normalizer's steps, applied to each segment before pre-tokenization.
    normalizer: Vec<normalize::Step>,
    pre_tokenizer: PreTokenizer,
    /// Initial symbols of a piece.
    alphabet: Alphabet,
    /// `(left, right)` packed into a u64 -> its merge.
    merges: HashMap<u64, Merge, FastHash>,
    /// With `ignore_merges`: whole words (raw bytes) found in the vocab.
    whole_words: Option<HashMap<Box<[u8]>, u32, FastHash>>,
    added: AddedTokens,
    /// Ids the post-processor puts before / after the text when `add_special_tokens`.
    prefix: Vec<u32>,
    suffix: Vec<u32>,
    /// Memoized piece -> ids; cleared when full.
    cache: Mutex<WordCache>,
}

impl std::fmt::Debug for FastBpe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FastBpe")
            .field("normalizer", &self.normalizer)
            .field("pre_tokenizer", &self.pre_tokenizer)
            .field("merges", &self.merges.len())
            .field("ignore_merges", &self.whole_words.is_some())
            .field("prefix", &self.prefix)
            .field("suffix", &self.suffix)
            .finish_non_exhaustive()
    }
}

#[derive(Debug, Clone, Copy)]
struct Merge {
    rank: u32,
    new_id: u32,
}

/// A possible merge of the symbol at `pos` with its right neighbour; ordered as `tokenizers`
/// orders its queue (lowest rank first, then leftmost).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Candidate {
    rank: u32,
    pos: u32,
    new_id: u32,
}

/// One symbol of a word being merged: a doubly linked list over the initial bytes.
#[derive(Debug, Clone, Copy)]
struct Symbol {
    id: u32,
    prev: i32,
    next: i32,
    alive: bool,
}

/// Buffers reused across the pieces of one `encode` call.
#[derive(Debug, Default)]
struct Scratch {
    /// A piece's initial symbols.
    initial: Vec<u32>,
    symbols: Vec<Symbol>,
    queue: BinaryHeap<Reverse<Candidate>>,
    word: Vec<u32>,
}

/// How text segments are cut into pieces before BPE.
#[derive(Debug)]
enum PreTokenizer {
    /// `ByteLevel { use_regex: true }`: the GPT-2 pattern.
    Gpt2,
    /// `Sequence [Split { Regex, Isolated }.., ByteLevel { use_regex: false }]`.
    Split(SplitPattern),
    /// A SentencePiece-style pipeline's words, cut where no merge reaches across (`None`: not
    /// cut, each word is a piece), its segments read raw when `raw` says so.
    SentencePiece {
        words: Words,
        cuts: Option<Cuts>,
        raw: Option<RawSpaces>,
    },
}

/// A SentencePiece pipeline whose segments are cut and encoded as raw text: its normalizer only
/// turns each space into the cut char (after prepending one to the segment, with `prepend`), its
/// words are whole segments, no added token is matched after the normalizer and no whole word is
/// looked up. A raw piece (a space spelled as the cut char's symbol) then has the ids of its
/// normalized span, so the normalizer's copy of every segment and the second scan over it are
/// skipped: with Gemma's added tokens each line is a segment, and they were a fifth of an encode.
/// The word cache is keyed by the raw pieces, all of them read this way.
#[derive(Debug)]
struct RawSpaces {
    prepend: bool,
}

/// A piece's initial symbols.
#[derive(Debug)]
enum Alphabet {
    /// One per byte: the id of the byte's byte-level char.
    Bytes(Box<[u32; 256]>),
    /// One per char, or its bytes' fallback tokens (SentencePiece).
    Chars(Box<CharSymbols>),
}

/// A piece of pre-tokenized text (a byte range of its segment) and its word cache bucket, if it
/// may be cached. Ranges rather than slices, so the batch buffer outlives each segment's text.
struct Piece {
    start: usize,
    end: usize,
    bucket: Option<usize>,
}

impl Piece {
    fn new(segment: &str, piece: &str) -> Self {
        let bytes = piece.as_bytes();
        // Pieces are subslices of their segment.
        let start = piece.as_ptr() as usize - segment.as_ptr() as usize;
        Self {
            start,
            end: start + bytes.len(),
            // Single bytes map straight to their ids.
            bucket: (2..=CACHE_MAX_WORD_LEN)
                .contains(&bytes.len())
                .then(|| word_bucket(bytes)),
        }
    }
}

/// Why a `tokenizer.json` gets no fast path.
enum Reject {
    /// A valid pipeline this encoder does not model.
    Unsupported(&'static str),
    /// A pipeline we model, but with inconsistent content.
    Malformed(String),
}

impl FastBpe {
    /// Builds the fast encoder from a parsed `tokenizer.json`: `Ok(None)` when the pipeline is
    /// not one this encoder reproduces exactly, an error when it is but its content is
    /// inconsistent (e.g. a merge naming a token missing from the vocab).
    pub fn from_tokenizer_json(json: &Value) -> Result<Option<Self>, TokenizeError> {
        match Self::build(json) {
            Ok(bpe) => Ok(Some(bpe)),
            Err(Reject::Unsupported(what)) => {
                tracing::debug!(unsupported = what, "no fast tokenizer path");
                Ok(None)
            }
            Err(Reject::Malformed(reason)) => Err(TokenizeError::Config {
                field: "tokenizer.json",
                reason,
            }),
        }
    }

    /// The family of pipelines this encoder serves.
    pub fn kind(&self) -> FastEncoderKind {
        match self.alphabet {
            Alphabet::Bytes(_) => FastEncoderKind::ByteBpe,
            Alphabet::Chars(_) => FastEncoderKind::SentencePieceBpe,
        }
    }

    /// Whether `crate::leading_cut` spots split this encoder's encodings in two: the byte-level
    /// pipelines (`Split` pieces never span them) with no normalizer but NFC. SentencePiece
    /// pipelines prepend `▁` to each encoded text and merge across spaces, so they take none.
    pub fn allows_leading_cuts(&self) -> bool {
        matches!(self.alphabet, Alphabet::Bytes(_))
            && self
                .normalizer
                .iter()
                .all(|step| *step == normalize::Step::Nfc)
    }

    /// Token ids of `text`, equal to `tokenizers`' `encode_fast(text, add_special_tokens)`.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Vec<u32> {
        self.encode_parts(text, add_special_tokens, add_special_tokens)
    }

    /// [`Self::encode`] without the post-processor's trailing tokens: the ids a longer text
    /// that starts with `text` begins with, when `text` ends at a split boundary (see
    /// `crate::leading_cut`).
    pub fn encode_leading(&self, text: &str, add_special_tokens: bool) -> Vec<u32> {
        self.encode_parts(text, add_special_tokens, false)
    }

    /// `text`'s ids with the post-processor's leading (`add_prefix`) and trailing (`add_suffix`)
    /// special tokens or without them.
    pub(crate) fn encode_parts(&self, text: &str, add_prefix: bool, add_suffix: bool) -> Vec<u32> {
        let mut ids = Vec::new();
        self.encode_parts_into(text, add_prefix, add_suffix, &mut ids);
        ids
    }

    /// [`Self::encode_parts`] appended to `ids`, which grows once at most: a long prompt's
    /// tokens are hundreds of KiB, and every regrowth copies them into fresh pages.
    pub(crate) fn encode_parts_into(
        &self,
        text: &str,
        add_prefix: bool,
        add_suffix: bool,
        ids: &mut Vec<u32>,
    ) {
        // At most one token per two bytes but in rare text (byte fallback, emoji runs): mixed
        // prose and code take 2.5 to 4.
        ids.reserve(text.len() / 2 + self.prefix.len() + self.suffix.len());
        if add_prefix {
            ids.extend_from_slice(&self.prefix);
        }
        let mut scratch = Scratch::default();
        let mut batch = Vec::with_capacity(PIECE_BATCH);
        // tokenizers' two passes: non-normalized added tokens in the raw text; then each segment
        // between them is normalized and the normalized added tokens are cut out of that.
        split_on(
            self.added.raw.as_ref(),
            text,
            &mut |segment| match segment {
                Segment::Added(id) => ids.push(id),
                Segment::Text(raw) => {
                    let raw_first = raw.as_ptr() == text.as_ptr();
                    let normalized = if self.reads_raw() {
                        Cow::Borrowed(raw)
                    } else {
                        normalize::apply(&self.normalizer, raw)
                    };
                    split_on(
                        self.added.normalized.as_ref(),
                        &normalized,
                        &mut |segment| match segment {
                            Segment::Added(id) => ids.push(id),
                            Segment::Text(part) => {
                                // Metaspace's `first` scheme: only the text at the input's start.
                                let first = raw_first && part.as_ptr() == normalized.as_ptr();
                                self.encode_text(part, first, ids, &mut scratch, &mut batch);
                            }
                        },
                    );
                }
            },
        );
        if add_suffix {
            ids.extend_from_slice(&self.suffix);
        }
    }

    /// Splits `text` (a normalized segment between added tokens; `first`: at the input's start)
    /// with the pre-tokenizer and encodes its pieces.
    fn encode_text(
        &self,
        text: &str,
        first: bool,
        out: &mut Vec<u32>,
        scratch: &mut Scratch,
        batch: &mut Vec<Piece>,
    ) {
        match &self.pre_tokenizer {
            PreTokenizer::Gpt2 => {
                self.encode_pieces(text, gpt2_split::split(text), out, scratch, batch);
            }
            PreTokenizer::Split(pattern) => {
                self.encode_pieces(text, pattern.split(text), out, scratch, batch);
            }
            PreTokenizer::SentencePiece {
                words,
                cuts,
                raw: Some(raw),
            } => {
                if let (Some(cuts), Alphabet::Chars(symbols)) = (cuts, &self.alphabet) {
                    self.encode_raw(text, raw, cuts, symbols, out, scratch, batch);
                } else {
                    // Never built so (see `raw_spaces`): the normalized path, still exact.
                    let normalized = normalize::apply(&self.normalizer, text);
                    self.encode_pieces(&normalized, words.split(&normalized), out, scratch, batch);
                }
            }
            PreTokenizer::SentencePiece {
                words,
                cuts,
                raw: None,
            } => {
                let prepared = words.prepare(text, first);
                let (Some(cuts), Alphabet::Chars(symbols)) = (cuts, &self.alphabet) else {
                    self.encode_pieces(&prepared, words.split(&prepared), out, scratch, batch);
                    return;
                };
                for word in words.split(&prepared) {
                    // `ignore_merges` looks the whole word up, before any cut.
                    if let Some(&id) = self
                        .whole_words
                        .as_ref()
                        .and_then(|w| w.get(word.as_bytes()))
                    {
                        out.push(id);
                        continue;
                    }
                    self.encode_pieces(word, cuts.split(word, symbols), out, scratch, batch);
                }
            }
        }
    }

    /// Encodes a raw segment of a [`RawSpaces`] pipeline: the first piece (with the prepended
    /// cut char, if any: the only piece copied) and then the rest's pieces in place.
    #[expect(
        clippy::too_many_arguments,
        reason = "encode_text's state, passed down"
    )]
    fn encode_raw(
        &self,
        text: &str,
        raw: &RawSpaces,
        cuts: &Cuts,
        symbols: &CharSymbols,
        out: &mut Vec<u32>,
        scratch: &mut Scratch,
        batch: &mut Vec<Piece>,
    ) {
        let mut rest = text;
        if raw.prepend && !text.is_empty() {
            // Cut spots are ASCII spaces or the cut char's first byte: char boundaries.
            let end = cuts.next_raw_cut(text, 0, symbols);
            let (head, tail) = text.split_at(end.min(text.len()));
            let mut first = String::with_capacity(head.len() + 4);
            first.push(cuts.at());
            first.push_str(head);
            self.encode_pieces(&first, std::iter::once(first.as_str()), out, scratch, batch);
            rest = tail;
        }
        self.encode_pieces(rest, cuts.split_raw(rest, symbols), out, scratch, batch);
    }

    /// Whether segments are encoded raw, without the normalizer's copy (see [`RawSpaces`]).
    fn reads_raw(&self) -> bool {
        matches!(
            self.pre_tokenizer,
            PreTokenizer::SentencePiece { raw: Some(_), .. }
        )
    }

    /// Encodes the pieces of `text`, [`PIECE_BATCH`] at a time.
    fn encode_pieces<'t>(
        &self,
        text: &'t str,
        mut pieces: impl Iterator<Item = &'t str>,
        out: &mut Vec<u32>,
        scratch: &mut Scratch,
        batch: &mut Vec<Piece>,
    ) {
        loop {
            batch.clear();
            batch.extend(
                pieces
                    .by_ref()
                    .take(PIECE_BATCH)
                    .map(|piece| Piece::new(text, piece)),
            );
            if batch.is_empty() {
                return;
            }
            // Never waited for: a holder may be a background thread the kernel preempted for
            // this one (a 32k decision waited 2–5 ms behind an idle-class thread's batch); the
            // batch then goes without the cache, exactly as with it.
            let mut held = self.cache.try_lock();
            let cache: &mut [CacheBucket] = held.as_deref_mut().map_or(&mut [], |cache| cache);
            // Read every piece's bucket before using any: the reads are independent, so the CPU
            // overlaps their misses, where looking pieces up one by one waits for each in turn.
            // Between a router's requests the table has left the CPU caches, and those serial
            // misses were most of a tokenization (`--bench picker --cold-caches`, and in place
            // behind Envoy).
            let touched = batch
                .iter()
                .filter_map(|piece| piece.bucket.filter(|_| !cache.is_empty()))
                .fold(0u8, |acc, bucket| acc ^ cache[bucket].touch());
            std::hint::black_box(touched);
            for piece in batch.iter() {
                let word = text.get(piece.start..piece.end).unwrap_or_default();
                let bucket = piece.bucket.filter(|_| !cache.is_empty());
                self.encode_piece(word, bucket, cache, out, scratch);
            }
        }
    }

    fn encode_piece(
        &self,
        word: &str,
        bucket: Option<usize>,
        cache: &mut [CacheBucket],
        out: &mut Vec<u32>,
        scratch: &mut Scratch,
    ) {
        let bytes = word.as_bytes();
        if let [byte] = bytes {
            let id = match &self.alphabet {
                Alphabet::Bytes(ids) => Some(ids[usize::from(*byte)]),
                Alphabet::Chars(symbols) => symbols.id_of(char::from(*byte)),
            };
            if let Some(id) = id {
                out.push(id);
                return;
            }
        }
        // The word cache first: its bucket is already in the CPU cache (read above), where the
        // whole-word table of a 128k–200k vocabulary is a likely miss per piece.
        if let Some(bucket) = bucket
            && cache[bucket].ids_of(bytes, out)
        {
            return;
        }
        // Pieces cut out of a word are not words: `ignore_merges` looked the word up already.
        let whole = self
            .whole_words
            .as_ref()
            .filter(|_| !self.cuts_words())
            .and_then(|words| words.get(bytes));
        let ids: &[u32] = match whole {
            Some(id) => std::slice::from_ref(id),
            None => {
                let mut initial = std::mem::take(&mut scratch.initial);
                self.initial_symbols(word, &mut initial);
                if initial.len() <= SHORT_WORD {
                    self.merge_short(&initial, &mut scratch.word);
                } else {
                    self.merge_word(&initial, scratch);
                }
                scratch.initial = initial;
                &scratch.word
            }
        };
        out.extend_from_slice(ids);
        if let Some(bucket) = bucket
            && let Some(entry) = CachedWord::new(bytes, ids)
        {
            cache[bucket].store(entry);
        }
    }

    /// Whether pieces can be parts of a word (SentencePiece cuts).
    fn cuts_words(&self) -> bool {
        matches!(
            self.pre_tokenizer,
            PreTokenizer::SentencePiece { cuts: Some(_), .. }
        )
    }

    /// The initial symbols of a piece, as `tokenizers` makes them.
    fn initial_symbols(&self, word: &str, out: &mut Vec<u32>) {
        match &self.alphabet {
            Alphabet::Bytes(ids) => {
                out.clear();
                out.extend(word.bytes().map(|byte| ids[usize::from(byte)]));
            }
            Alphabet::Chars(symbols) => symbols.symbols(word, out),
        }
    }

    /// `tokenizers`' `Word::merge_all` without dropout, from the initial symbols: a queue of
    /// candidate merges; a popped candidate is applied if its symbol is alive, has a right
    /// neighbour and that pair still merges into the same token. Result in `scratch.word`.
    fn merge_word(&self, initial: &[u32], scratch: &mut Scratch) {
        let Scratch {
            symbols,
            queue,
            word,
            ..
        } = scratch;
        symbols.clear();
        queue.clear();
        word.clear();
        let last = initial.len().saturating_sub(1);
        symbols.extend(initial.iter().enumerate().map(|(i, &id)| Symbol {
            id,
            prev: i as i32 - 1,
            next: if i == last { -1 } else { i as i32 + 1 },
            alive: true,
        }));
        for (pos, pair) in symbols.windows(2).enumerate() {
            if let Some(merge) = self.merge_of(pair[0].id, pair[1].id) {
                queue.push(Reverse(candidate(merge, pos)));
            }
        }
        while let Some(Reverse(top)) = queue.pop() {
            let pos = top.pos as usize;
            let current = symbols[pos];
            if !current.alive || current.next < 0 {
                continue;
            }
            let right_pos = current.next as usize;
            let right = symbols[right_pos];
            match self.merge_of(current.id, right.id) {
                Some(merge) if merge.new_id == top.new_id => {}
                _ => continue, // an outdated candidate
            }
            symbols[pos].id = top.new_id;
            symbols[pos].next = right.next;
            symbols[right_pos].alive = false;
            if right.next >= 0 {
                symbols[right.next as usize].prev = pos as i32;
            }
            if current.prev >= 0 {
                let prev = current.prev as usize;
                if let Some(merge) = self.merge_of(symbols[prev].id, top.new_id) {
                    queue.push(Reverse(candidate(merge, prev)));
                }
            }
            if right.next >= 0
                && let Some(merge) = self.merge_of(top.new_id, symbols[right.next as usize].id)
            {
                queue.push(Reverse(candidate(merge, pos)));
            }
        }
        word.extend(symbols.iter().filter(|s| s.alive).map(|s| s.id));
    }

    /// [`Self::merge_word`] for words of at most [`SHORT_WORD`] bytes, on stack arrays: merges
    /// the adjacent pair of lowest rank, leftmost among equals, until none merges. The same ids
    /// as `tokenizers`' queue: every live pair has a candidate of its true rank in the queue, a
    /// stale candidate can never pass its `new_id` check (symbols only grow, so a different pair
    /// at the same position spans different bytes and makes a different token), and the queue's
    /// tie order is the position, i.e. leftmost. Result in `word`.
    fn merge_short(&self, initial: &[u32], word: &mut Vec<u32>) {
        const NONE: u32 = u32::MAX;
        let n = initial.len().min(SHORT_WORD);
        let mut ids = [0u32; SHORT_WORD];
        // `ranks[i]`/`new_ids[i]`: the merge of symbols i and i + 1 (rank NONE: none).
        let mut ranks = [NONE; SHORT_WORD];
        let mut new_ids = [0u32; SHORT_WORD];
        ids[..n].copy_from_slice(&initial[..n]);
        let pair = |ids: &[u32; SHORT_WORD], i: usize| match self.merge_of(ids[i], ids[i + 1]) {
            Some(merge) => (merge.rank, merge.new_id),
            None => (NONE, 0),
        };
        for i in 0..n.saturating_sub(1) {
            (ranks[i], new_ids[i]) = pair(&ids, i);
        }
        let mut len = n;
        while len > 1 {
            let pairs = len - 1;
            let mut best = 0;
            for i in 1..pairs {
                // Strictly lower: the leftmost of equal ranks wins.
                if ranks[i] < ranks[best] {
                    best = i;
                }
            }
            if ranks[best] == NONE {
                break;
            }
            ids[best] = new_ids[best];
            // Symbol best + 1 and pair best go; the pairs after them shift left by one.
            ids.copy_within(best + 2..len, best + 1);
            ranks.copy_within(best + 1..pairs, best);
            new_ids.copy_within(best + 1..pairs, best);
            len -= 1;
            if best > 0 {
                (ranks[best - 1], new_ids[best - 1]) = pair(&ids, best - 1);
            }
            if best + 1 < len {
                (ranks[best], new_ids[best]) = pair(&ids, best);
            }
        }
        word.clear();
        word.extend_from_slice(&ids[..len]);
    }

    #[inline]
    fn merge_of(&self, left: u32, right: u32) -> Option<Merge> {
        self.merges.get(&pair_key(left, right)).copied()
    }

    fn build(json: &Value) -> Result<Self, Reject> {
        use Reject::Unsupported;
        for field in ["truncation", "padding"] {
            if !json.get(field).is_none_or(Value::is_null) {
                return Err(Unsupported(field));
            }
        }
        let normalizer = normalize::parse(json.get("normalizer"), 0)?;
        let pre = json.get("pre_tokenizer").unwrap_or(&Value::Null);
        // A pipeline without the ByteLevel pre-tokenizer merges chars: SentencePiece-style.
        let byte_level = parse_pre_tokenizer(pre);
        let words = match byte_level {
            Ok(_) => None,
            Err(_) => Some(Words::parse(pre)?),
        };
        split::init_kind_table();
        let model = json
            .get("model")
            .ok_or_else(|| Reject::Malformed("no model".to_owned()))?;
        check_bpe_options(model, words.is_some())?;
        let vocab = parse_vocab(model)?;

        let mut alphabet = match words {
            None => {
                let mut byte_ids = Box::new([0; 256]);
                for (byte, slot) in byte_ids.iter_mut().enumerate() {
                    let c = byte_char(byte as u8);
                    *slot = *vocab
                        .get(c.encode_utf8(&mut [0; 4]) as &str)
                        .ok_or(Unsupported("a byte-level char is missing from the vocab"))?;
                }
                Alphabet::Bytes(byte_ids)
            }
            Some(_) => Alphabet::Chars(Box::new(CharSymbols::new(model, &vocab)?)),
        };

        let merge_list = parse_merges(model)?;
        let mut pre_tokenizer = match (byte_level, words) {
            (Ok(pre_tokenizer), _) => pre_tokenizer,
            (Err(_), Some(words)) => {
                let cuts = match &alphabet {
                    Alphabet::Chars(symbols) if !words.pieces_are_words() => Some(Cuts::new(
                        cut_char(&words, &normalizer),
                        &merge_list,
                        symbols,
                    )),
                    _ => None,
                };
                PreTokenizer::SentencePiece {
                    words,
                    cuts,
                    raw: None,
                }
            }
            (Err(reject), None) => return Err(reject),
        };
        let mut merges = HashMap::with_capacity_and_hasher(merge_list.len(), FastHash::default());
        // One buffer for every merged token's text (200k–450k merges in real vocabularies).
        let mut joined = String::new();
        for (rank, (left, right)) in merge_list.into_iter().enumerate() {
            let id = |token: &str| {
                vocab.get(token).copied().ok_or_else(|| {
                    Reject::Malformed(format!("merge token {token:?} is not in the vocab"))
                })
            };
            joined.clear();
            joined.push_str(left);
            joined.push_str(right);
            let merge = Merge {
                rank: rank as u32,
                new_id: id(&joined)?,
            };
            // A repeated pair keeps its last rank, as in tokenizers' map.
            merges.insert(pair_key(id(left)?, id(right)?), merge);
        }

        let ignore_merges = match model.get("ignore_merges") {
            None | Some(Value::Null) => false,
            Some(Value::Bool(b)) => *b,
            Some(_) => return Err(Unsupported("model.ignore_merges")),
        };
        let whole_words = ignore_merges.then(|| {
            if matches!(alphabet, Alphabet::Chars(_)) {
                return vocab
                    .iter()
                    .map(|(token, &id)| (Box::from(token.as_bytes()), id))
                    .collect();
            }
            // Byte-level chars are all below U+0144: a table, not a map, for millions of lookups.
            let mut char_byte = [None; 0x144];
            for byte in 0..=255u8 {
                if let Some(slot) = char_byte.get_mut(byte_char(byte) as usize) {
                    *slot = Some(byte);
                }
            }
            let byte_of = |c: char| char_byte.get(c as usize).copied().flatten();
            vocab
                .iter()
                .filter_map(|(token, &id)| {
                    let bytes: Option<Box<[u8]>> = token.chars().map(byte_of).collect();
                    Some((bytes?, id))
                })
                .collect()
        });

        let added = AddedTokens::parse(json.get("added_tokens"), &vocab, &normalizer)?;
        if let (
            PreTokenizer::SentencePiece {
                words,
                cuts: Some(cuts),
                raw,
            },
            Alphabet::Chars(symbols),
        ) = (&mut pre_tokenizer, &mut alphabet)
            && whole_words.is_none()
            && added.normalized.is_none()
        {
            *raw = raw_spaces(&normalizer, words, cuts, symbols);
        }
        let (prefix, suffix) =
            parse_post_processor(json.get("post_processor").unwrap_or(&Value::Null), 0)?;
        Ok(Self {
            normalizer,
            pre_tokenizer,
            alphabet,
            merges,
            whole_words,
            added,
            prefix,
            suffix,
            cache: Mutex::new(vec![CacheBucket::EMPTY; CACHE_BUCKETS].into_boxed_slice()),
        })
    }
}

fn candidate(merge: Merge, pos: usize) -> Candidate {
    Candidate {
        rank: merge.rank,
        pos: pos as u32,
        new_id: merge.new_id,
    }
}

type FastHash = BuildHasherDefault<MulHasher>;
/// Memo of word → ids: a fixed table of two-slot buckets. A lookup reads one bucket, where a map of
/// boxed keys and values touched four lines (control bytes, entry, key, ids): with the CPU caches
/// cold, as between a router's requests, those misses were most of a tokenization
/// (`--bench picker --cold-caches`). A third word of a bucket replaces the second way's.
type WordCache = Box<[CacheBucket]>;

/// Two slots for words of the same hash: a word shares its bucket with another word of the
/// prompt's vocabulary far less often than a direct-mapped slot, where such pairs evicted each
/// other on every prompt and were merged again each time.
///
/// A new word takes the second way and moves to the first only when it is found again, so a
/// stream of words seen once (most of a new prompt's rare words) replaces only the second way and
/// never evicts a word that recurs; storing new words first evicted recurring words on new text.
#[derive(Clone, Copy)]
#[repr(C, align(128))]
struct CacheBucket {
    /// The most recently found again first.
    ways: [CachedWord; 2],
}

impl CacheBucket {
    const EMPTY: Self = Self {
        ways: [CachedWord::EMPTY; 2],
    };

    /// Appends the ids to `out` if this bucket holds `word`.
    fn ids_of(&mut self, word: &[u8], out: &mut Vec<u32>) -> bool {
        if self.ways[0].ids_of(word, out) {
            return true;
        }
        if self.ways[1].ids_of(word, out) {
            self.ways.swap(0, 1);
            return true;
        }
        false
    }

    fn store(&mut self, entry: CachedWord) {
        let way = usize::from(self.ways[0].word_len != 0);
        self.ways[way] = entry;
    }

    /// Reads both slots (to bring them into the CPU cache).
    fn touch(&self) -> u8 {
        self.ways[0].word_len ^ self.ways[1].word_len
    }
}

/// One word cache slot: the word's bytes and its ids, inline in one cache line.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct CachedWord {
    word_len: u8,
    ids_len: u8,
    word: [u8; CACHE_MAX_WORD_LEN],
    ids: [u32; CACHE_MAX_WORD_IDS],
}

impl CachedWord {
    const EMPTY: Self = Self {
        word_len: 0,
        ids_len: 0,
        word: [0; CACHE_MAX_WORD_LEN],
        ids: [0; CACHE_MAX_WORD_IDS],
    };

    /// A slot for `word` → `ids`, if both fit.
    fn new(word: &[u8], ids: &[u32]) -> Option<Self> {
        if word.is_empty() || word.len() > CACHE_MAX_WORD_LEN || ids.len() > CACHE_MAX_WORD_IDS {
            return None;
        }
        let mut entry = Self::EMPTY;
        entry.word_len = u8::try_from(word.len()).ok()?;
        entry.ids_len = u8::try_from(ids.len()).ok()?;
        entry.word[..word.len()].copy_from_slice(word);
        entry.ids[..ids.len()].copy_from_slice(ids);
        Some(entry)
    }

    /// Appends the ids to `out` if this slot holds `word`.
    fn ids_of(&self, word: &[u8], out: &mut Vec<u32>) -> bool {
        let len = usize::from(self.word_len);
        if len == 0 || len != word.len() || self.word[..len] != *word {
            return false;
        }
        out.extend_from_slice(&self.ids[..usize::from(self.ids_len)]);
        true
    }
}

/// The cache bucket of `word`.
fn word_bucket(word: &[u8]) -> usize {
    let mut hasher = MulHasher::default();
    hasher.write(word);
    // The top bits are the best mixed.
    (hasher.0 >> (64 - CACHE_BUCKETS.trailing_zeros())) as usize
}

fn pair_key(left: u32, right: u32) -> u64 {
    (u64::from(left) << 32) | u64::from(right)
}

/// A multiplicative (Fx-style) hasher for merge pairs and short byte strings; SipHash would
/// dominate the lookups. Keys come from the model file and prompt text, which cannot choose
/// collisions usefully: every table is bounded.
#[derive(Debug, Default)]
struct MulHasher(u64);

impl Hasher for MulHasher {
    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for chunk in &mut chunks {
            let mut word = [0; 8];
            word.copy_from_slice(chunk);
            self.write_u64(u64::from_le_bytes(word));
        }
        // Shifted in byte by byte: copying the tail into a zeroed array compiled to a `memcpy`
        // call per word hashed.
        let tail = (chunks.remainder().iter().enumerate())
            .fold(0, |tail, (i, &byte)| tail | u64::from(byte) << (8 * i));
        self.write_u64(tail);
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0 ^ n).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }

    fn finish(&self) -> u64 {
        // Fold the well-mixed high bits into the low bits the table indexes by.
        self.0.rotate_left(26)
    }
}

/// GPT-2's reversible byte -> char map: printable Latin-1 bytes map to themselves, the other 68
/// bytes to U+0100.. in byte order.
fn byte_char(byte: u8) -> char {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    if printable(byte) {
        return char::from(byte);
    }
    let offset = (0..byte).filter(|&b| !printable(b)).count() as u32;
    char::from_u32(256 + offset).unwrap_or(char::REPLACEMENT_CHARACTER)
}

/// The pre-tokenizers modelled: GPT-2's `ByteLevel` alone, or a `Split` by a known regex
/// (isolating its matches) followed by `ByteLevel` without its regex.
fn parse_pre_tokenizer(pre: &Value) -> Result<PreTokenizer, Reject> {
    let unsupported = Reject::Unsupported("pre_tokenizer");
    fn str_of<'v>(value: &'v Value, field: &str) -> Option<&'v str> {
        value.get(field).and_then(Value::as_str)
    }
    let byte_level = |value: &Value, use_regex: bool| {
        str_of(value, "type") == Some("ByteLevel")
            && value.get("add_prefix_space") == Some(&Value::Bool(false))
            && match value.get("use_regex") {
                None => use_regex, // the default is true
                Some(flag) => flag == &Value::Bool(use_regex),
            }
    };
    if byte_level(pre, true) {
        return Ok(PreTokenizer::Gpt2);
    }
    if str_of(pre, "type") != Some("Sequence") {
        return Err(unsupported);
    }
    let Some([splits @ .., last]) = pre
        .get("pretokenizers")
        .and_then(Value::as_array)
        .map(Vec::as_slice)
    else {
        return Err(unsupported);
    };
    let regexes: Option<Vec<&str>> = splits
        .iter()
        .map(|split| {
            let isolated = str_of(split, "type") == Some("Split")
                && str_of(split, "behavior") == Some("Isolated")
                && split.get("invert") == Some(&Value::Bool(false));
            isolated
                .then(|| split.get("pattern").and_then(|p| str_of(p, "Regex")))
                .flatten()
        })
        .collect();
    match regexes.as_deref().and_then(SplitPattern::from_regexes) {
        Some(pattern) if byte_level(last, false) => Ok(PreTokenizer::Split(pattern)),
        _ => Err(unsupported),
    }
}

/// `text` in NFC, as `tokenizers`' `NFC` normalizer computes it (the same crate and tables;
/// Unicode 9.0). Text the quick check passes is already in NFC and is not copied.
///
/// Only the chunks that fail the quick check are normalized. A chunk starts before an ASCII
/// character followed by non-ASCII ones (or at the text's start) and ends before the next ASCII
/// character: an ASCII character is a starter (combining class 0, NFC_QC=Yes) that is never the
/// second character of a canonical composition, so nothing before it composes or reorders with
/// anything after it, and NFC of the text is the NFC of its chunks, concatenated. (The ASCII
/// character opening a chunk can take a following combining mark: `e` + U+0301.) One NFD word in
/// a long prompt then costs its chunk, not a normalization of the whole prompt.
fn nfc(text: &str) -> Cow<'_, str> {
    if text.is_ascii() {
        return Cow::Borrowed(text);
    }
    let bytes = text.as_bytes();
    let mut normalized: Option<String> = None;
    // `copied`: how much of `text` the owned copy (once there is one) already holds.
    let mut copied = 0;
    let mut at = 0;
    while let Some(offset) = bytes[at..].iter().position(|b| !b.is_ascii()) {
        let first_non_ascii = at + offset;
        let start = first_non_ascii.saturating_sub(1).max(at);
        let end = bytes[first_non_ascii..]
            .iter()
            .position(u8::is_ascii)
            .map_or(bytes.len(), |n| first_non_ascii + n);
        // Both ends are at ASCII bytes or the text's ends: char boundaries.
        let chunk = text.get(start..end).unwrap_or_default();
        if is_nfc_quick(chunk.chars()) != IsNormalized::Yes {
            let out = normalized.get_or_insert_with(|| String::with_capacity(text.len() + 16));
            out.push_str(text.get(copied..start).unwrap_or_default());
            out.extend(chunk.nfc().map(|(c, _)| c));
            copied = end;
        }
        at = end;
    }
    match normalized {
        None => Cow::Borrowed(text),
        Some(mut out) => {
            out.push_str(text.get(copied..).unwrap_or_default());
            Cow::Owned(out)
        }
    }
}

/// The char SentencePiece cuts go before: the Metaspace replacement, or what the normalizer
/// replaces spaces with.
fn cut_char(words: &Words, normalizer: &[normalize::Step]) -> char {
    if let Words::Metaspace { replacement, .. } = words {
        return *replacement;
    }
    let replaced = normalizer.iter().rev().find_map(|step| match step {
        normalize::Step::Replace { pattern, content } if pattern == " " => {
            let mut chars = content.chars();
            match (chars.next(), chars.next()) {
                (Some(c), None) => Some(c),
                _ => None,
            }
        }
        _ => None,
    });
    replaced.unwrap_or(sentencepiece::METASPACE)
}

/// The [`RawSpaces`] reading of a SentencePiece pipeline with cuts, if it has one: its
/// normalizer is `Replace(" ", c)`, after `Prepend(c)` or not, with `c` the cut char (not a space,
/// and in the vocab: raw spaces are then spelled as its symbol); its words are whole segments
/// (`Whole`, or an `EndAfter` pattern with a space, which never occurs once spaces are replaced).
/// The caller checks there are no normalized added tokens and no whole-word lookups.
fn raw_spaces(
    normalizer: &[normalize::Step],
    words: &Words,
    cuts: &Cuts,
    symbols: &mut CharSymbols,
) -> Option<RawSpaces> {
    use normalize::Step;
    let c = cuts.at();
    let replaces = |step: &Step| {
        matches!(step, Step::Replace { pattern, content }
            if pattern == " " && content.chars().eq(std::iter::once(c)))
    };
    let prepends =
        |step: &Step| matches!(step, Step::Prepend(p) if p.chars().eq(std::iter::once(c)));
    let prepend = match normalizer {
        [replace] if replaces(replace) => false,
        [prepend, replace] if prepends(prepend) && replaces(replace) => true,
        _ => return None,
    };
    let whole = match words {
        Words::Whole => true,
        Words::EndAfter(pattern) => pattern.contains(' '),
        Words::Metaspace { .. } => false,
    };
    (whole && c != ' ' && symbols.spell_space_as(c)).then_some(RawSpaces { prepend })
}

/// `sentencepiece`: whether the pipeline merges chars (which may fall back to bytes).
fn check_bpe_options(model: &Value, sentencepiece: bool) -> Result<(), Reject> {
    use Reject::Unsupported;
    if model.get("type").and_then(Value::as_str) != Some("BPE") {
        return Err(Unsupported("model.type"));
    }
    let null_or = |field: &str, ok: &dyn Fn(&Value) -> bool| {
        model.get(field).is_none_or(|v| v.is_null() || ok(v))
    };
    if !null_or("dropout", &|v| v.as_f64() == Some(0.0)) {
        return Err(Unsupported("model.dropout"));
    }
    for field in ["continuing_subword_prefix", "end_of_word_suffix"] {
        if !null_or(field, &|v| v.as_str() == Some("")) {
            return Err(Unsupported("model subword prefix/suffix"));
        }
    }
    if !sentencepiece && !null_or("byte_fallback", &|v| v == &Value::Bool(false)) {
        return Err(Unsupported("model.byte_fallback"));
    }
    Ok(())
}

/// Token -> id, borrowing the tokens from the parsed JSON.
fn parse_vocab(model: &Value) -> Result<HashMap<&str, u32, FastHash>, Reject> {
    let vocab = model
        .get("vocab")
        .and_then(Value::as_object)
        .ok_or_else(|| Reject::Malformed("model.vocab is not an object".to_owned()))?;
    vocab
        .iter()
        .map(|(token, id)| {
            let id = id
                .as_u64()
                .and_then(|id| u32::try_from(id).ok())
                .ok_or_else(|| Reject::Malformed(format!("vocab id of {token:?}")))?;
            Ok((token.as_str(), id))
        })
        .collect()
}

/// Merges as `(left, right)` in rank order, from `"a b"` strings or `[a, b]` pairs.
fn parse_merges(model: &Value) -> Result<Vec<(&str, &str)>, Reject> {
    let malformed = |what: &str| Reject::Malformed(format!("model.merges: {what}"));
    let list = model
        .get("merges")
        .and_then(Value::as_array)
        .ok_or_else(|| malformed("not an array"))?;
    let mut merges = Vec::with_capacity(list.len());
    for merge in list {
        match merge {
            // The legacy merges.txt form; tokenizers skips `#version` lines.
            Value::String(line) if line.starts_with("#version") => {}
            Value::String(line) => {
                let mut parts = line.split(' ');
                match (parts.next(), parts.next(), parts.next()) {
                    (Some(left), Some(right), None) => merges.push((left, right)),
                    _ => return Err(malformed(line)),
                }
            }
            Value::Array(pair) => match pair.as_slice() {
                [Value::String(left), Value::String(right)] => merges.push((left, right)),
                _ => return Err(malformed("a pair is not two strings")),
            },
            _ => return Err(malformed("an entry is neither a string nor a pair")),
        }
    }
    Ok(merges)
}

/// The ids a post-processor adds before and after the text (only `add_special_tokens` applies
/// them: with it false, TemplateProcessing keeps just `$A`).
fn parse_post_processor(post: &Value, depth: u8) -> Result<(Vec<u32>, Vec<u32>), Reject> {
    use Reject::Unsupported;
    let (mut prefix, mut suffix) = (Vec::new(), Vec::new());
    if post.is_null() {
        return Ok((prefix, suffix));
    }
    match post.get("type").and_then(Value::as_str) {
        Some("ByteLevel") => {} // adjusts offsets only
        Some("Sequence") if depth < 4 => {
            let processors = post
                .get("processors")
                .and_then(Value::as_array)
                .ok_or(Unsupported("post_processor.processors"))?;
            // Each processor wraps what the previous ones produced.
            for processor in processors {
                let (outer_prefix, outer_suffix) = parse_post_processor(processor, depth + 1)?;
                prefix.splice(0..0, outer_prefix);
                suffix.extend(outer_suffix);
            }
        }
        Some("TemplateProcessing") => {
            let pieces = post
                .get("single")
                .and_then(Value::as_array)
                .ok_or(Unsupported("post_processor.single"))?;
            let mut seen_sequence = false;
            for piece in pieces {
                if let Some(special) = piece.get("SpecialToken") {
                    let name = special.get("id").and_then(Value::as_str);
                    let ids = name
                        .and_then(|name| post.get("special_tokens")?.get(name)?.get("ids"))
                        .and_then(Value::as_array)
                        .ok_or_else(|| {
                            Reject::Malformed(format!("template special token {name:?}"))
                        })?;
                    let target = if seen_sequence {
                        &mut suffix
                    } else {
                        &mut prefix
                    };
                    for id in ids {
                        target.push(
                            id.as_u64()
                                .and_then(|id| u32::try_from(id).ok())
                                .ok_or_else(|| Reject::Malformed("template id".to_owned()))?,
                        );
                    }
                } else if piece.get("Sequence").and_then(|s| s.get("id")) == Some(&Value::from("A"))
                    && !seen_sequence
                {
                    seen_sequence = true;
                } else {
                    return Err(Unsupported("post_processor template piece"));
                }
            }
            if !seen_sequence {
                return Err(Unsupported("post_processor template without $A"));
            }
        }
        _ => return Err(Unsupported("post_processor")),
    }
    Ok((prefix, suffix))
}

/// A segment of the input: an added token, or text for the pre-tokenizer and model.
enum Segment<'a> {
    Added(u32),
    Text(&'a str),
}

/// The added tokens' two leftmost-longest matchers, as `tokenizers`' `AddedVocabulary` has.
struct AddedTokens {
    raw: Option<AddedMatcher>,
    normalized: Option<AddedMatcher>,
}

/// A leftmost-longest matcher of added tokens that runs its automaton only where a token can
/// start: real models' added tokens all start with one or two bytes (`<`), so most of a prompt
/// is skipped by a byte-table scan, where the automaton's per-byte transitions cost as much as a
/// tenth of an encode.
struct AddedMatcher {
    automaton: DoubleArrayAhoCorasick<u32>,
    /// Whether a token starts with this byte.
    first_bytes: [bool; 256],
    /// The longest token's length in bytes.
    max_len: usize,
}

impl AddedMatcher {
    /// The leftmost-longest match starting at or after `from`: (start, end, id).
    fn find(&self, bytes: &[u8], mut from: usize) -> Option<(usize, usize, u32)> {
        while let Some(offset) = bytes
            .get(from..)?
            .iter()
            .position(|&b| self.first_bytes[usize::from(b)])
        {
            let at = from + offset;
            let window = bytes.get(at..bytes.len().min(at + self.max_len))?;
            // The window holds every token that could start at `at`, so the automaton's
            // leftmost-longest match starts at 0 exactly when a token starts there, and it is the
            // longest of those.
            match self.automaton.leftmost_find_iter(window).next() {
                Some(found) if found.start() == 0 => {
                    return Some((at, at + found.end(), found.value()));
                }
                _ => from = at + 1,
            }
        }
        None
    }
}

impl AddedTokens {
    /// `normalizer`: the steps normalized tokens are matched after (so in their normalized form).
    fn parse(
        list: Option<&Value>,
        vocab: &HashMap<&str, u32, FastHash>,
        normalizer: &[normalize::Step],
    ) -> Result<Self, Reject> {
        use Reject::Unsupported;
        let list = match list {
            None | Some(Value::Null) => &Vec::new(),
            Some(Value::Array(list)) => list,
            Some(_) => return Err(Reject::Malformed("added_tokens".to_owned())),
        };
        // tokenizers ignores the listed ids: a content in the vocab keeps its vocab id, the
        // others get consecutive ids from the vocab size.
        let mut next_id = vocab.len() as u32;
        let mut seen = HashSet::new();
        let (mut raw, mut normalized) = (Vec::new(), Vec::new());
        for token in list {
            let flag = |name: &str| token.get(name).and_then(Value::as_bool);
            let content = token.get("content").and_then(Value::as_str);
            let (Some(content), Some(single_word), Some(lstrip), Some(rstrip), Some(norm)) = (
                content,
                flag("single_word"),
                flag("lstrip"),
                flag("rstrip"),
                flag("normalized"),
            ) else {
                return Err(Unsupported("added token fields"));
            };
            if single_word || lstrip || rstrip {
                return Err(Unsupported("added token single_word/lstrip/rstrip"));
            }
            if content.is_empty() {
                continue; // tokenizers skips these
            }
            if !seen.insert(content) {
                return Err(Unsupported("duplicate added token"));
            }
            let id = vocab.get(content).copied().unwrap_or_else(|| {
                next_id += 1;
                next_id - 1
            });
            if norm {
                normalized.push((normalize::apply(normalizer, content), id));
            } else {
                raw.push((Cow::Borrowed(content), id));
            }
        }
        Ok(Self {
            raw: matcher(raw)?,
            normalized: matcher(normalized)?,
        })
    }
}

fn split_on<'a>(matcher: Option<&AddedMatcher>, text: &'a str, f: &mut dyn FnMut(Segment<'a>)) {
    let Some(matcher) = matcher else {
        if !text.is_empty() {
            f(Segment::Text(text));
        }
        return;
    };
    let mut start = 0;
    while let Some((found, end, id)) = matcher.find(text.as_bytes(), start) {
        // A match starts at a token's first byte (a UTF-8 lead byte) and ends after its last:
        // char boundaries.
        if let Some(before) = text.get(start..found)
            && !before.is_empty()
        {
            f(Segment::Text(before));
        }
        f(Segment::Added(id));
        start = end;
    }
    if let Some(rest) = text.get(start..)
        && !rest.is_empty()
    {
        f(Segment::Text(rest));
    }
}

fn matcher(tokens: Vec<(Cow<'_, str>, u32)>) -> Result<Option<AddedMatcher>, Reject> {
    if tokens.is_empty() {
        return Ok(None);
    }
    let mut first_bytes = [false; 256];
    let mut max_len = 0;
    for (content, _) in &tokens {
        if let Some(&first) = content.as_bytes().first() {
            first_bytes[usize::from(first)] = true;
        }
        max_len = max_len.max(content.len());
    }
    let automaton = DoubleArrayAhoCorasickBuilder::new()
        .match_kind(MatchKind::LeftmostLongest)
        .build_with_values(
            tokens
                .into_iter()
                .map(|(content, id)| (content.into_owned(), id)),
        )
        .map_err(|e| Reject::Malformed(format!("added tokens: {e}")))?;
    Ok(Some(AddedMatcher {
        automaton,
        first_bytes,
        max_len,
    }))
}

#[cfg(test)]
mod sentencepiece_tests;
#[cfg(test)]
mod tests;
