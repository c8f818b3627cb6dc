//! SentencePiece-style BPE (Llama 2, Gemma, Mistral's older vocabularies): the word's chars are
//! its initial symbols (not its bytes), a char missing from the vocab becomes its bytes' `<0xNN>`
//! tokens (`byte_fallback`) or the unknown token, and spaces are `▁` — replaced by a normalizer
//! (`Replace`, often after `Prepend("▁")`) or by the `Metaspace` pre-tokenizer with its
//! `prepend_scheme` and `split`.
//!
//! Without `Metaspace`'s split, `tokenizers` merges a whole segment between added tokens as one
//! word: BPE over kilobytes of text at once. [`Cuts`] splits such a word where no merge can
//! reach across — before a `▁` whose preceding symbol no merged token ever joins to a `▁` (read
//! from the merges at load) — so its pieces are merged (and cached) on their own with the same
//! ids: a merge changes only the two symbols it joins, so merges on either side of a spot no
//! merge spans never interact, and each side's merges happen in the same order alone.

use std::collections::{HashMap, HashSet};

use serde_json::Value;

use super::{FastHash, Reject};

/// The Metaspace replacement, and the char [`Cuts`] cut before unless told otherwise.
pub(super) const METASPACE: char = '\u{2581}';

/// Char -> initial symbol ids, with `tokenizers`' byte fallback and unknown handling.
#[derive(Debug)]
pub(super) struct CharSymbols {
    ascii: [Option<u32>; 128],
    other: HashMap<char, u32, FastHash>,
    /// `<0xNN>` ids when `byte_fallback` (every byte a char missing from the vocab can hold has
    /// one, checked at load, so the unknown token never occurs).
    byte_fallback: Option<Box<[u32; 256]>>,
    /// The unknown token's id, when unknown chars are not dropped.
    unk: Option<u32>,
    fuse_unk: bool,
}

impl CharSymbols {
    pub(super) fn new(model: &Value, vocab: &HashMap<&str, u32, FastHash>) -> Result<Self, Reject> {
        use Reject::Unsupported;
        let mut ascii = [None; 128];
        let mut other = HashMap::default();
        for (token, &id) in vocab {
            let mut chars = token.chars();
            if let (Some(c), None) = (chars.next(), chars.next()) {
                match ascii.get_mut(c as usize) {
                    Some(slot) => *slot = Some(id),
                    None => {
                        other.insert(c, id);
                    }
                }
            }
        }
        let flag = |field: &str| model.get(field).and_then(Value::as_bool).unwrap_or(false);
        let byte_fallback = if flag("byte_fallback") {
            let mut ids = Box::new([u32::MAX; 256]);
            for (byte, slot) in ids.iter_mut().enumerate() {
                match vocab.get(format!("<0x{byte:02X}>").as_str()) {
                    Some(&id) => *slot = id,
                    // A missing byte token is harmless only for an ASCII byte whose char is in
                    // the vocab (no char that falls back holds it); otherwise `tokenizers`
                    // mixes unknown tokens in, which this encoder does not model.
                    None if byte < 128 && ascii[byte].is_some() => {}
                    None => return Err(Unsupported("byte_fallback without every byte token")),
                }
            }
            Some(ids)
        } else {
            None
        };
        let unk = match model.get("unk_token") {
            None | Some(Value::Null) => None,
            Some(Value::String(token)) => Some(
                *vocab
                    .get(token.as_str())
                    .ok_or(Unsupported("unk_token missing from the vocab"))?,
            ),
            Some(_) => return Err(Unsupported("model.unk_token")),
        };
        Ok(Self {
            ascii,
            other,
            byte_fallback,
            unk,
            fuse_unk: flag("fuse_unk"),
        })
    }

    /// The id of `c` as one symbol, if the vocab has it.
    #[inline]
    pub(super) fn id_of(&self, c: char) -> Option<u32> {
        match self.ascii.get(c as usize) {
            Some(id) => *id,
            None => self.other.get(&c).copied(),
        }
    }

    /// Spells a space as `c`'s symbol, for a pipeline whose normalizer turns every space into
    /// `c` and whose segments are read raw (see `RawSpaces` in `byte_bpe`); its normalized text
    /// never holds a space, so no other symbol changes. False (and nothing changed) when `c` is
    /// not in the vocab.
    pub(super) fn spell_space_as(&mut self, c: char) -> bool {
        let Some(id) = self.id_of(c) else {
            return false;
        };
        self.ascii[usize::from(b' ')] = Some(id);
        true
    }

    /// Whether a char missing from the vocab becomes `<0xNN>` tokens.
    pub(super) fn has_byte_fallback(&self) -> bool {
        self.byte_fallback.is_some()
    }

    /// The initial symbols of `word`, as `tokenizers`' `BPE::merge_word` makes them: each char's
    /// id; a char missing from the vocab as its bytes' fallback tokens, else as the unknown token
    /// (consecutive ones fused into one with `fuse_unk`), else dropped.
    pub(super) fn symbols(&self, word: &str, out: &mut Vec<u32>) {
        out.clear();
        let mut unk = None;
        for c in word.chars() {
            if let Some(id) = self.id_of(c) {
                if let Some(pending) = unk.take() {
                    out.push(pending);
                }
                out.push(id);
            } else if let Some(bytes) = &self.byte_fallback {
                for byte in c.encode_utf8(&mut [0; 4]).bytes() {
                    out.push(bytes[usize::from(byte)]);
                }
            } else if let Some(unk_id) = self.unk
                && !(self.fuse_unk && unk.is_some())
                && let Some(pending) = unk.replace(unk_id)
            {
                out.push(pending);
            }
        }
        if let Some(pending) = unk {
            out.push(pending);
        }
    }
}

/// `prepend_scheme` of the Metaspace pre-tokenizer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Prepend {
    /// Before every segment not starting with the replacement.
    Always,
    /// Only before the segment at the very start of the input.
    First,
    Never,
}

/// How a SentencePiece pipeline cuts a normalized segment into words.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Words {
    /// No pre-tokenizer: the segment is one word.
    Whole,
    /// `Split { pattern: String(s), behavior: MergedWithPrevious }`: a word ends after each `s`.
    EndAfter(String),
    /// `Metaspace`: spaces become `replacement`, which is prepended per `prepend`, and with
    /// `split` each replacement starts a word.
    Metaspace {
        replacement: char,
        prepend: Prepend,
        split: bool,
    },
}

impl Words {
    /// The pre-tokenizer, if it is one of these.
    pub(super) fn parse(pre: &Value) -> Result<Self, Reject> {
        let unsupported = Reject::Unsupported("pre_tokenizer");
        if pre.is_null() {
            return Ok(Self::Whole);
        }
        let str_of = |field: &str| pre.get(field).and_then(Value::as_str);
        match str_of("type") {
            Some("Split")
                if str_of("behavior") == Some("MergedWithPrevious")
                    && pre.get("invert") == Some(&Value::Bool(false)) =>
            {
                let pattern = pre
                    .get("pattern")
                    .and_then(|p| p.get("String"))
                    .and_then(Value::as_str)
                    .filter(|p| !p.is_empty())
                    .ok_or(unsupported)?;
                Ok(Self::EndAfter(pattern.to_owned()))
            }
            Some("Metaspace") => {
                let mut chars = str_of("replacement").unwrap_or_default().chars();
                let (Some(replacement), None) = (chars.next(), chars.next()) else {
                    return Err(unsupported);
                };
                // tokenizers' defaults: `always`, `split: true`; `add_prefix_space: false`
                // means `never` (and contradicts any other scheme, which tokenizers refuses).
                let mut prepend = match str_of("prepend_scheme") {
                    None | Some("always") => Prepend::Always,
                    Some("first") => Prepend::First,
                    Some("never") => Prepend::Never,
                    Some(_) => return Err(unsupported),
                };
                if pre.get("add_prefix_space") == Some(&Value::Bool(false)) {
                    prepend = Prepend::Never;
                }
                let split = match pre.get("split") {
                    None | Some(Value::Null) => true,
                    Some(Value::Bool(split)) => *split,
                    Some(_) => return Err(unsupported),
                };
                Ok(Self::Metaspace {
                    replacement,
                    prepend,
                    split,
                })
            }
            _ => Err(unsupported),
        }
    }

    /// Whether each word is a piece: no word needs [`Cuts`].
    pub(super) fn pieces_are_words(&self) -> bool {
        matches!(self, Self::Metaspace { split: true, .. })
    }

    /// The segment as the pre-tokenizer sees it after its own replacement and prepending
    /// (`first`: the segment starts the input).
    pub(super) fn prepare<'t>(&self, text: &'t str, first: bool) -> std::borrow::Cow<'t, str> {
        use std::borrow::Cow;
        let Self::Metaspace {
            replacement,
            prepend,
            ..
        } = self
        else {
            return Cow::Borrowed(text);
        };
        // Spaces are replaced first: a segment starting with one starts with the replacement.
        let starts = text.starts_with(*replacement) || text.starts_with(' ');
        let prepend = match prepend {
            Prepend::Always => !starts,
            Prepend::First => first && !starts,
            Prepend::Never => false,
        };
        if !prepend && !text.contains(' ') {
            return Cow::Borrowed(text);
        }
        let mut out = String::with_capacity(text.len() + 16);
        if prepend {
            out.push(*replacement);
        }
        for (i, part) in text.split(' ').enumerate() {
            if i > 0 {
                out.push(*replacement);
            }
            out.push_str(part);
        }
        Cow::Owned(out)
    }

    /// The words of a prepared segment, in order; they concatenate back to it.
    pub(super) fn split<'t>(&'t self, text: &'t str) -> impl Iterator<Item = &'t str> + 't {
        let mut rest = text;
        std::iter::from_fn(move || {
            if rest.is_empty() {
                return None;
            }
            let end = match self {
                Self::Whole | Self::Metaspace { split: false, .. } => rest.len(),
                Self::EndAfter(pattern) => {
                    let found = match pattern.as_bytes() {
                        [byte] => find_byte(rest.as_bytes(), 0, *byte),
                        _ => rest.find(pattern.as_str()),
                    };
                    found.map_or(rest.len(), |at| at + pattern.len())
                }
                Self::Metaspace { replacement: r, .. } => {
                    // A word runs from one replacement to the next (MergedWithNext).
                    let first = rest.chars().next().map_or(0, char::len_utf8);
                    let next = rest.get(first..).and_then(|tail| tail.find(*r));
                    next.map_or(rest.len(), |at| first + at)
                }
            };
            let (word, tail) = rest.split_at(end);
            rest = tail;
            Some(word)
        })
    }
}

/// Where a word is cut into pieces no merge spans (see the module docs).
#[derive(Debug)]
pub(super) struct Cuts {
    /// Pieces start at this char...
    at: char,
    /// ...unless the symbol before it ends with one of these in some merged token's text (a
    /// char the vocab lacks counts as its fallback's last char, `>`). A handful at most.
    joins: Vec<char>,
    /// [`Self::cuts_after`] of each ASCII char and of `at`, worked out at load: the char
    /// before a spot is one of these nearly always, and the rule's list and vocab lookups were
    /// a fifth of a raw scan.
    after_ascii: [bool; 128],
    after_at: bool,
}

impl Cuts {
    /// The cut rule for `at` under these merges (rank order, as token texts) and symbols.
    pub(super) fn new(at: char, merges: &[(&str, &str)], symbols: &CharSymbols) -> Self {
        let mut joins = HashSet::new();
        let mut joined = String::new();
        for (left, right) in merges {
            joined.clear();
            joined.push_str(left);
            joined.push_str(right);
            let mut previous = None;
            for c in joined.chars() {
                if c == at
                    && let Some(before) = previous
                {
                    joins.insert(before);
                }
                previous = Some(c);
            }
        }
        let mut joins: Vec<char> = joins.into_iter().collect();
        joins.sort_unstable();
        let mut cuts = Self {
            at,
            joins,
            after_ascii: [false; 128],
            after_at: false,
        };
        let after_ascii = std::array::from_fn(|c| {
            char::from_u32(c as u32).is_some_and(|c| cuts.rule_cuts_after(c, symbols))
        });
        cuts.after_ascii = after_ascii;
        cuts.after_at = cuts.rule_cuts_after(at, symbols);
        cuts
    }

    /// The pieces of `word`, in order; they concatenate back to it.
    pub(super) fn split<'t>(
        &'t self,
        word: &'t str,
        symbols: &'t CharSymbols,
    ) -> impl Iterator<Item = &'t str> + 't {
        let mut rest = word;
        std::iter::from_fn(move || {
            if rest.is_empty() {
                return None;
            }
            // The next `at` after the first char whose preceding char allows a cut.
            let bytes = rest.as_bytes();
            let mut buffer = [0; 4];
            let at = self.at.encode_utf8(&mut buffer).as_bytes();
            let first_byte = at.first().copied().unwrap_or_default();
            let mut end = rest.chars().next().map_or(0, char::len_utf8);
            let end = loop {
                let Some(found) = find_byte(bytes, end, first_byte) else {
                    break rest.len();
                };
                end = found;
                // Byte by byte: `starts_with` of a runtime-length slice is a `memcmp` call.
                let here = bytes.get(end..end + at.len());
                if !here.is_some_and(|here| here.iter().zip(at).all(|(a, b)| a == b)) {
                    end += 1;
                    continue;
                }
                let before = rest.get(..end).and_then(|head| head.chars().next_back());
                if before.is_some_and(|before| self.cuts_after(before, symbols)) {
                    break end;
                }
                end += at.len();
            };
            let (piece, tail) = rest.split_at(end.min(rest.len()));
            rest = tail;
            Some(piece)
        })
    }

    /// The char pieces start at.
    pub(super) fn at(&self) -> char {
        self.at
    }

    /// The pieces of `raw`, a segment read before its normalizer turned each space into `at`
    /// (so a space stands for `at`, both as a cut spot and as the char before one): the raw
    /// spans of the normalized segment's pieces. One scan, and no copy of the segment.
    pub(super) fn split_raw<'t>(
        &'t self,
        raw: &'t str,
        symbols: &'t CharSymbols,
    ) -> impl Iterator<Item = &'t str> + 't {
        let mut start = 0;
        std::iter::from_fn(move || {
            let first = raw.get(start..)?.chars().next()?.len_utf8();
            let end = self.next_raw_cut(raw, start + first, symbols);
            let piece = raw.get(start..end)?;
            start = end;
            Some(piece)
        })
    }

    /// The first cut at or after `from` in `raw` (read as in [`Self::split_raw`]), else
    /// `raw.len()`. A cut at 0 is judged after an `at` prepended to the segment: only a caller
    /// that prepends one passes 0.
    pub(super) fn next_raw_cut(&self, raw: &str, from: usize, symbols: &CharSymbols) -> usize {
        let bytes = raw.as_bytes();
        let mut buffer = [0; 4];
        let at = self.at.encode_utf8(&mut buffer).as_bytes();
        let lead = at.first().copied().unwrap_or_default();
        let mut end = from;
        loop {
            let Some(found) = find_either_byte(bytes, end, b' ', lead) else {
                return raw.len();
            };
            let len = if bytes.get(found) == Some(&b' ') {
                1
            } else if bytes
                .get(found..found + at.len())
                .is_some_and(|here| here.iter().zip(at).all(|(a, b)| a == b))
            {
                at.len()
            } else {
                end = found + 1;
                continue;
            };
            let cuts = match found.checked_sub(1).map(|i| bytes.get(i)) {
                // The start: after the prepended `at`.
                None => self.after_at,
                Some(Some(b' ')) => self.after_at,
                Some(Some(&b)) if b.is_ascii() => self.after_ascii[usize::from(b)],
                Some(_) => raw
                    .get(..found)
                    .and_then(|head| head.chars().next_back())
                    .is_some_and(|before| self.cuts_after(before, symbols)),
            };
            if cuts {
                return found;
            }
            end = found + len;
        }
    }

    /// Whether a piece may start at an `at` after `before`.
    #[inline]
    fn cuts_after(&self, before: char, symbols: &CharSymbols) -> bool {
        match self.after_ascii.get(before as usize) {
            Some(&cuts) => cuts,
            None if before == self.at => self.after_at,
            None => self.rule_cuts_after(before, symbols),
        }
    }

    fn rule_cuts_after(&self, before: char, symbols: &CharSymbols) -> bool {
        if self.joins.contains(&before) {
            return false;
        }
        if symbols.id_of(before).is_some() {
            true
        } else if symbols.has_byte_fallback() {
            !self.joins.contains(&'>')
        } else {
            // An unknown char's symbol: never cut after it.
            false
        }
    }
}

/// The first `byte` in `bytes` at or after `from`, eight bytes at a time: pieces are short, too
/// short for `memchr`'s set-up to pay (a call per piece was a fifth of an encode), and a byte
/// loop was still a tenth.
#[inline]
pub(super) fn find_byte(bytes: &[u8], from: usize, byte: u8) -> Option<usize> {
    find_either_byte(bytes, from, byte, byte)
}

/// The first `a` or `b` in `bytes` at or after `from`, as [`find_byte`] searches.
pub(super) fn find_either_byte(bytes: &[u8], mut from: usize, a: u8, b: u8) -> Option<usize> {
    const ONES: u64 = 0x0101_0101_0101_0101;
    const HIGH: u64 = 0x8080_8080_8080_8080;
    // The lowest set bit marks the first zero byte of `x` exactly (borrows only run upwards
    // from it), so the lowest bit of two such masks ORed marks the first of either byte.
    let zeros = |x: u64| x.wrapping_sub(ONES) & !x & HIGH;
    while let Some(chunk) = bytes.get(from..).and_then(<[u8]>::first_chunk::<8>) {
        let word = u64::from_le_bytes(*chunk);
        let zero = zeros(word ^ (u64::from(a) * ONES)) | zeros(word ^ (u64::from(b) * ONES));
        if zero != 0 {
            return Some(from + (zero.trailing_zeros() / 8) as usize);
        }
        from += 8;
    }
    let tail = bytes.get(from..)?;
    tail.iter()
        .position(|&x| x == a || x == b)
        .map(|at| from + at)
}
