//! The `Split` pre-tokenizer regexes of Llama 3, Qwen2/2.5/3, o200k (gpt-oss), Tekken (Mistral
//! NeMo) and DeepSeek-V3's sequence of three `Split`s as hand-written scanners, recognised by
//! their exact pattern strings ([`SplitPattern::from_regexes`]).
//!
//! `tokenizers` runs these with Oniguruma (`find_iter`, `Isolated` behaviour: every match is a
//! piece). Each scanner returns, for a position, the end of the match Oniguruma finds there:
//! alternatives tried left to right, greedy quantifiers backtracking one char at a time, the first
//! success taken (not the longest). Every char starts a match of each pattern (letters, numbers,
//! whitespace and "other" each have an alternative), so the matches tile the text and no gap
//! pieces occur.
//!
//! Oniguruma's semantics modelled here:
//! - `\s` is Unicode White_Space, `\p{L}`/`\p{N}`/`\p{M}`/`\p{Lu}`… general categories (Unicode
//!   16.0 in both Oniguruma and `unicode-general-category`);
//! - `(?i:'s|'t|'re|'ve|'m|'ll|'d)` folds case with Unicode simple folding: besides ASCII case,
//!   U+017F `ſ` folds to `s` (no other char folds to one of these letters);
//! - `\s+(?!\S)` gives back one whitespace char when the run is followed by a non-space, so that
//!   char can start the next piece; `\s*[\r\n]+` ends at the run's last `\r`/`\n`.

use unicode_general_category::{GeneralCategory, get_general_category};

/// Llama 3 / 3.1 / 3.2 / 3.3 (`\p{N}{1,3}`).
pub(crate) const LLAMA3: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen2 / 2.5 / 3 (one digit per piece).
pub(crate) const QWEN2: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// tiktoken's o200k (gpt-oss, GPT-4o): case-aware words with contraction suffixes.
pub(crate) const O200K: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Mistral NeMo's Tekken: o200k's word alternatives without the contraction suffixes, one digit
/// per piece.
pub(crate) const TEKKEN: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// DeepSeek-V3 (and R1): three `Split`s in sequence, each run on every piece of the one before.
/// First runs of up to three numbers, then runs of CJK ideographs and kana, then words.
pub(crate) const DEEPSEEK_V3: [&str; 3] = [
    r"\p{N}{1,3}",
    "[\u{4e00}-\u{9fa5}\u{3040}-\u{309f}\u{30a0}-\u{30ff}]+",
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+",
];

/// A `Split` regex (or sequence of them) this module scans by hand.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SplitPattern {
    /// [`LLAMA3`] (`max_digits` 3) or [`QWEN2`] (1).
    Llama3 { max_digits: u8 },
    /// [`O200K`] (contraction suffixes, `max_digits` 3) or [`TEKKEN`] (neither: 1).
    O200k { contractions: bool, max_digits: u8 },
    /// [`DEEPSEEK_V3`].
    DeepSeekV3,
}

impl SplitPattern {
    /// The scanner for exactly this sequence of pattern strings (each `Split` applied to every
    /// piece of the one before), if there is one.
    pub(crate) fn from_regexes(regexes: &[&str]) -> Option<Self> {
        match regexes {
            [LLAMA3] => Some(Self::Llama3 { max_digits: 3 }),
            [QWEN2] => Some(Self::Llama3 { max_digits: 1 }),
            [O200K] => Some(Self::O200k {
                contractions: true,
                max_digits: 3,
            }),
            [TEKKEN] => Some(Self::O200k {
                contractions: false,
                max_digits: 1,
            }),
            _ if regexes == DEEPSEEK_V3 => Some(Self::DeepSeekV3),
            _ => None,
        }
    }

    /// The pieces of `text`, in order; they concatenate back to `text`.
    pub(crate) fn split(self, text: &str) -> Pieces<'_> {
        Pieces {
            pattern: self,
            text,
            pos: 0,
            numbers_end: 0,
            cjk_end: 0,
        }
    }
}

/// Iterator over the pieces of one text segment.
#[derive(Debug)]
pub(crate) struct Pieces<'a> {
    pattern: SplitPattern,
    text: &'a str,
    pos: usize,
    /// DeepSeek-V3: the end of the current first-stage piece (a number run or the text between).
    numbers_end: usize,
    /// DeepSeek-V3: the end of the current second-stage piece (a CJK run or the text between).
    cjk_end: usize,
}

impl<'a> Iterator for Pieces<'a> {
    type Item = &'a str;

    fn next(&mut self) -> Option<&'a str> {
        let start = self.pos;
        let scan = Scan { text: self.text };
        let end = match self.pattern {
            SplitPattern::Llama3 { max_digits } => scan.llama3_end(start, max_digits)?,
            SplitPattern::O200k {
                contractions,
                max_digits,
            } => scan.o200k_end(start, contractions, max_digits)?,
            SplitPattern::DeepSeekV3 => self.deepseek_end(start)?,
        };
        self.pos = end;
        self.text.get(start..end)
    }
}

impl Pieces<'_> {
    /// The end of DeepSeek-V3's next piece at `pos`. Each `Split` runs on the pieces of the one
    /// before as whole strings, so a stage's matches end at its enclosing piece's end (where
    /// `(?!\S)` holds) and the text between matches is a piece of its own.
    fn deepseek_end(&mut self, pos: usize) -> Option<usize> {
        let scan = Scan { text: self.text };
        let (_, kind, _) = char_at(self.text, pos)?;
        if pos >= self.numbers_end {
            // The only ASCII numbers are `0-9`.
            self.numbers_end = if kind == Kind::Number {
                scan.digits_end(pos, 3)
            } else {
                scan.run_end_with(pos, |kind| kind != Kind::Number, Ascii::NotDigits)
            };
        }
        if pos >= self.cjk_end {
            let limited = Scan {
                text: self.text.get(..self.numbers_end)?,
            };
            let cjk = is_deepseek_cjk(self.text.get(pos..)?.chars().next()?);
            // No ASCII char is CJK.
            let ascii = if cjk { Ascii::None } else { Ascii::Any };
            self.cjk_end = limited.chars_end(pos, |c, _| is_deepseek_cjk(c) == cjk, ascii);
        }
        let piece = Scan {
            text: self.text.get(..self.cjk_end)?,
        };
        if let Some(end) = piece.deepseek_word_end(pos) {
            return Some(end);
        }
        // Text no alternative matches runs to where one does.
        let mut end = pos;
        while let Some((_, _, len)) = char_at(piece.text, end) {
            end += len;
            if end < piece.text.len() && piece.deepseek_word_end(end).is_some() {
                break;
            }
        }
        Some(end)
    }
}

/// DeepSeek-V3's second stage: CJK Unified Ideographs U+4E00–U+9FA5, hiragana, katakana.
fn is_deepseek_cjk(c: char) -> bool {
    matches!(c, '\u{4e00}'..='\u{9fa5}' | '\u{3040}'..='\u{309f}' | '\u{30a0}'..='\u{30ff}')
}

/// The char kinds the patterns distinguish (a partition of all chars).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum Kind {
    /// Lu, Lt.
    Upper,
    /// Ll.
    Lower,
    /// Lm, Lo.
    OtherLetter,
    /// Mn, Mc, Me.
    Mark,
    /// Nd, Nl, No.
    Number,
    /// `\r`, `\n`.
    Newline,
    /// Any other White_Space char.
    Space,
    /// Punctuation and symbols (P*, S*).
    Punct,
    /// Everything else (controls, format chars, private use, unassigned).
    Other,
}

impl Kind {
    pub(crate) fn is_letter(self) -> bool {
        matches!(self, Self::Upper | Self::Lower | Self::OtherLetter)
    }
    pub(crate) fn is_space(self) -> bool {
        matches!(self, Self::Newline | Self::Space)
    }
    /// `[^\r\n\p{L}\p{N}]`.
    fn is_prefix(self) -> bool {
        matches!(self, Self::Space | Self::Mark | Self::Punct | Self::Other)
    }
    /// `[^\s\p{L}\p{N}]`.
    fn is_symbol(self) -> bool {
        matches!(self, Self::Mark | Self::Punct | Self::Other)
    }
    /// `[\p{L}\p{M}]`.
    fn is_letter_or_mark(self) -> bool {
        self.is_letter() || self == Self::Mark
    }
    /// `[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]`.
    fn is_upper_set(self) -> bool {
        matches!(self, Self::Upper | Self::OtherLetter | Self::Mark)
    }
    /// `[\p{Ll}\p{Lm}\p{Lo}\p{M}]`.
    fn is_lower_set(self) -> bool {
        matches!(self, Self::Lower | Self::OtherLetter | Self::Mark)
    }
}

/// Kinds of the ASCII chars, so the common case needs no table search.
const ASCII_KIND: [Kind; 128] = {
    let mut table = [Kind::Other; 128];
    let mut b = 0;
    while b < 128 {
        table[b] = match b as u8 {
            b'A'..=b'Z' => Kind::Upper,
            b'a'..=b'z' => Kind::Lower,
            b'0'..=b'9' => Kind::Number,
            b'\r' | b'\n' => Kind::Newline,
            // White_Space in ASCII besides \r \n: \t \v \f and space.
            0x09 | 0x0B | 0x0C | b' ' => Kind::Space,
            // Every printable ASCII char that is not a letter or digit is P or S.
            b'!'..=b'~' => Kind::Punct,
            _ => Kind::Other,
        };
        b += 1;
    }
    table
};

/// The kind of `c`.
#[inline]
pub(crate) fn kind_of(c: char) -> Kind {
    if c.is_ascii() {
        return ASCII_KIND[c as usize];
    }
    kind_of_non_ascii(c)
}

/// Kinds of the Basic Multilingual Plane, built once ([`init_kind_table`]): a table read instead
/// of a binary search of the category ranges per char of CJK, Arabic, … text.
static BMP_KINDS: std::sync::OnceLock<Box<[Kind]>> = std::sync::OnceLock::new();

/// Builds the BMP kind table (64 KiB, a few ms) so no request pays for it.
pub(crate) fn init_kind_table() {
    BMP_KINDS.get_or_init(|| {
        (0..0x1_0000u32)
            .map(|code| char::from_u32(code).map_or(Kind::Other, kind_by_category))
            .collect()
    });
}

#[inline]
fn kind_of_non_ascii(c: char) -> Kind {
    if let Some(table) = BMP_KINDS.get()
        && let Some(&kind) = table.get(c as usize)
    {
        return kind;
    }
    kind_by_category(c)
}

fn kind_by_category(c: char) -> Kind {
    use GeneralCategory::*;
    if c.is_ascii() {
        return ASCII_KIND[c as usize];
    }
    if c.is_whitespace() {
        return Kind::Space;
    }
    match get_general_category(c) {
        UppercaseLetter | TitlecaseLetter => Kind::Upper,
        LowercaseLetter => Kind::Lower,
        ModifierLetter | OtherLetter => Kind::OtherLetter,
        NonspacingMark | SpacingMark | EnclosingMark => Kind::Mark,
        DecimalNumber | LetterNumber | OtherNumber => Kind::Number,
        ConnectorPunctuation | DashPunctuation | OpenPunctuation | ClosePunctuation
        | InitialPunctuation | FinalPunctuation | OtherPunctuation | MathSymbol
        | CurrencySymbol | ModifierSymbol | OtherSymbol => Kind::Punct,
        _ => Kind::Other,
    }
}

/// The char at byte `pos` (a char boundary), its kind and UTF-8 length.
#[inline]
fn char_at(text: &str, pos: usize) -> Option<(char, Kind, usize)> {
    let &byte = text.as_bytes().get(pos)?;
    if byte.is_ascii() {
        return Some((char::from(byte), ASCII_KIND[usize::from(byte)], 1));
    }
    let c = text.get(pos..)?.chars().next()?;
    Some((c, kind_of_non_ascii(c), c.len_utf8()))
}

/// An ASCII byte range skipped by SWAR in [`Scan::run_end_with`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ascii {
    None,
    /// `A-Z`, `a-z`.
    Letters,
    /// `A-Z`.
    Upper,
    /// `a-z`.
    Lower,
    /// Every ASCII byte but `0-9`.
    NotDigits,
    /// Every ASCII byte.
    Any,
}

const ONES: u64 = 0x0101_0101_0101_0101;
const HIGH: u64 = 0x8080_8080_8080_8080;

impl Ascii {
    /// The end of the run of bytes in this set from `pos`, found eight bytes at a time.
    #[inline]
    fn run_end(self, bytes: &[u8], mut pos: usize) -> usize {
        if self == Self::None {
            return pos;
        }
        while let Some(chunk) = bytes.get(pos..).and_then(<[u8]>::first_chunk::<8>) {
            let outside = !self.members(u64::from_le_bytes(*chunk)) & HIGH;
            if outside != 0 {
                // Little-endian: the lowest set bit is the first byte outside the set.
                return pos + (outside.trailing_zeros() / 8) as usize;
            }
            pos += 8;
        }
        while let Some(&byte) = bytes.get(pos)
            && self.members(u64::from(byte)) & 0x80 != 0
        {
            pos += 1;
        }
        pos
    }

    /// The high bit of each byte of `x` set iff that byte is in the set.
    #[inline]
    fn members(self, x: u64) -> u64 {
        let (x, lo, hi) = match self {
            Self::None => return 0,
            // Setting bit 5 maps A-Z onto a-z and no other byte into a-z.
            Self::Letters => (x | (0x20 * ONES), b'a', b'z'),
            Self::Upper => (x, b'A', b'Z'),
            Self::Lower => (x, b'a', b'z'),
            Self::NotDigits => return !x & HIGH & !Self::digits(x),
            Self::Any => return !x & HIGH,
        };
        // On the low seven bits of each byte no sum carries into the next byte.
        let low = x & !HIGH;
        let at_least_lo = low + (0x80 - u64::from(lo)) * ONES;
        let above_hi = low + (0x7f - u64::from(hi)) * ONES;
        at_least_lo & !above_hi & !x & HIGH
    }

    /// The high bit of each byte of `x` set iff that byte is `0-9`.
    #[inline]
    fn digits(x: u64) -> u64 {
        let low = x & !HIGH;
        let at_least_zero = low + (0x80 - u64::from(b'0')) * ONES;
        let above_nine = low + (0x7f - u64::from(b'9')) * ONES;
        at_least_zero & !above_nine & !x & HIGH
    }
}

/// Matching primitives over one text segment.
#[derive(Debug, Clone, Copy)]
struct Scan<'a> {
    text: &'a str,
}

impl Scan<'_> {
    fn kind_at(self, pos: usize) -> Option<Kind> {
        char_at(self.text, pos).map(|(_, kind, _)| kind)
    }

    /// End of the maximal run of chars whose kind satisfies `class`, from `pos`.
    #[inline]
    fn run_end(self, pos: usize, class: impl Fn(Kind) -> bool) -> usize {
        self.run_end_with(pos, class, Ascii::None)
    }

    /// [`Self::run_end`] whose ASCII chars in `ascii` (a subset of `class`) are skipped eight
    /// at a time: most runs are ASCII words, and a per-char loop pays a mispredicted exit at
    /// every word end besides its per-byte work.
    #[inline]
    fn run_end_with(self, pos: usize, class: impl Fn(Kind) -> bool, ascii: Ascii) -> usize {
        self.chars_end(pos, |_, kind| class(kind), ascii)
    }

    /// End of the maximal run of chars satisfying `class` (by char and kind), from `pos`, the
    /// ASCII chars in `ascii` (a subset of `class`) skipped eight at a time.
    #[inline]
    fn chars_end(self, mut pos: usize, class: impl Fn(char, Kind) -> bool, ascii: Ascii) -> usize {
        loop {
            pos = ascii.run_end(self.text.as_bytes(), pos);
            match char_at(self.text, pos) {
                Some((c, kind, len)) if class(c, kind) => pos += len,
                _ => return pos,
            }
        }
    }

    /// End of at most `max` consecutive numbers from `pos`.
    fn digits_end(self, mut pos: usize, max: u8) -> usize {
        for _ in 0..max {
            match char_at(self.text, pos) {
                Some((_, Kind::Number, len)) => pos += len,
                _ => break,
            }
        }
        pos
    }

    /// `(?i:'s|'t|'re|'ve|'m|'ll|'d)` at `pos`: its end, if it matches.
    fn contraction_end(self, pos: usize) -> Option<usize> {
        let rest = self.text.as_bytes().get(pos..)?;
        let len = match rest {
            [
                b'\'',
                b's' | b'S' | b't' | b'T' | b'm' | b'M' | b'd' | b'D',
                ..,
            ] => 2,
            // U+017F LATIN SMALL LETTER LONG S, which folds to `s`.
            [b'\'', 0xC5, 0xBF, ..] => 3,
            [b'\'', b'r' | b'R' | b'v' | b'V', b'e' | b'E', ..]
            | [b'\'', b'l' | b'L', b'l' | b'L', ..] => 3,
            _ => return None,
        };
        Some(pos + len)
    }

    /// The whitespace alternatives `\s*[\r\n]+|\s+(?!\S)|\s+` at a whitespace char `pos`.
    fn whitespace_end(self, pos: usize) -> usize {
        let mut end = pos;
        let mut last_start = pos;
        let mut after_newline = None;
        let mut count = 0usize;
        while let Some((_, kind, len)) = char_at(self.text, end)
            && kind.is_space()
        {
            last_start = end;
            end += len;
            count += 1;
            if kind == Kind::Newline {
                after_newline = Some(end);
            }
        }
        if let Some(newline_end) = after_newline {
            newline_end
        } else if end == self.text.len() || count < 2 {
            end
        } else {
            last_start
        }
    }

    /// ` ?[^\s\p{L}\p{N}]+` then a run of `trailer` chars, at `pos` (kind `kind`, `len` bytes).
    fn symbols_end(
        self,
        c: char,
        kind: Kind,
        pos: usize,
        len: usize,
        slash: bool,
    ) -> Option<usize> {
        let start = if kind.is_symbol() {
            pos + len
        } else if c == ' ' && self.kind_at(pos + 1).is_some_and(Kind::is_symbol) {
            self.run_end(pos + 1, Kind::is_symbol)
        } else {
            return None;
        };
        let end = self.run_end(start, Kind::is_symbol);
        let bytes = self.text.as_bytes();
        let mut trail = end;
        while let Some(&b) = bytes.get(trail)
            && (b == b'\r' || b == b'\n' || (slash && b == b'/'))
        {
            trail += 1;
        }
        Some(trail)
    }

    /// The end of the Llama 3 / Qwen2 match at `pos`, `None` at the end of the text.
    fn llama3_end(self, pos: usize, max_digits: u8) -> Option<usize> {
        let (c, kind, len) = char_at(self.text, pos)?;
        if c == '\''
            && let Some(end) = self.contraction_end(pos)
        {
            return Some(end);
        }
        // `[^\r\n\p{L}\p{N}]?\p{L}+`: no char is both, so no backtracking between the two.
        if kind.is_prefix() && self.kind_at(pos + len).is_some_and(Kind::is_letter) {
            return Some(self.run_end_with(pos + len, Kind::is_letter, Ascii::Letters));
        }
        if kind.is_letter() {
            return Some(self.run_end_with(pos + len, Kind::is_letter, Ascii::Letters));
        }
        if kind == Kind::Number {
            return Some(self.digits_end(pos, max_digits));
        }
        if let Some(end) = self.symbols_end(c, kind, pos, len, false) {
            return Some(end);
        }
        Some(self.whitespace_end(pos))
    }

    /// `[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+` at `pos`: the greedy upper
    /// run gives back chars until a lower-set char can start the lower run, so the match ends
    /// after the lower run starting at the run's end (if a lower-set char is there) or else at the
    /// last lower-set char inside the run (whose successor is upper-only, ending the lower run).
    fn upper_lower_end(self, pos: usize) -> Option<usize> {
        let mut end = pos;
        let mut last_lower_end = None;
        loop {
            // ASCII upper-set chars (A-Z) are not in the lower set: skipping them moves no
            // `last_lower_end`.
            end = Ascii::Upper.run_end(self.text.as_bytes(), end);
            match char_at(self.text, end) {
                Some((_, kind, len)) if kind.is_upper_set() => {
                    end += len;
                    if kind.is_lower_set() {
                        last_lower_end = Some(end);
                    }
                }
                _ => break,
            }
        }
        if self.kind_at(end).is_some_and(Kind::is_lower_set) {
            return Some(self.run_end_with(end, Kind::is_lower_set, Ascii::Lower));
        }
        last_lower_end
    }

    /// `[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*` at `pos`.
    fn upper_then_lower_end(self, pos: usize) -> Option<usize> {
        if !self.kind_at(pos).is_some_and(Kind::is_upper_set) {
            return None;
        }
        let end = self.run_end_with(pos, Kind::is_upper_set, Ascii::Upper);
        Some(self.run_end_with(end, Kind::is_lower_set, Ascii::Lower))
    }

    /// The end of the o200k (or Tekken) match at `pos`, `None` at the end of the text.
    fn o200k_end(self, pos: usize, contractions: bool, max_digits: u8) -> Option<usize> {
        let (c, kind, len) = char_at(self.text, pos)?;
        let with_suffix = |end: usize| {
            contractions
                .then(|| self.contraction_end(end))
                .flatten()
                .unwrap_or(end)
        };
        // Each word alternative tries the optional prefix char first, then without it.
        type Word<'s> = fn(Scan<'s>, usize) -> Option<usize>;
        let words: [Word<'_>; 2] = [Self::upper_lower_end, Self::upper_then_lower_end];
        for word in words {
            if kind.is_prefix()
                && let Some(end) = word(self, pos + len)
            {
                return Some(with_suffix(end));
            }
            if let Some(end) = word(self, pos) {
                return Some(with_suffix(end));
            }
        }
        if kind == Kind::Number {
            return Some(self.digits_end(pos, max_digits));
        }
        if let Some(end) = self.symbols_end(c, kind, pos, len, true) {
            return Some(end);
        }
        Some(self.whitespace_end(pos))
    }

    /// The end of the match of DeepSeek-V3's third pattern at `pos` (`self.text` ends where its
    /// piece does), `None` where no alternative matches:
    /// `[ASCII punct][A-Za-z]+ | [^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+ | ?[\p{P}\p{S}]+[\r\n]*`,
    /// then the whitespace alternatives.
    fn deepseek_word_end(self, pos: usize) -> Option<usize> {
        let (c, kind, len) = char_at(self.text, pos)?;
        let bytes = self.text.as_bytes();
        if c.is_ascii_punctuation() && bytes.get(pos + 1).is_some_and(u8::is_ascii_alphabetic) {
            return Some(Ascii::Letters.run_end(bytes, pos + 1));
        }
        // The optional prefix is neither a letter nor a mark, or the same run either way.
        let prefix = !matches!(kind, Kind::Newline | Kind::Punct) && !kind.is_letter();
        let letters =
            |from: usize| self.run_end_with(from, Kind::is_letter_or_mark, Ascii::Letters);
        if prefix && self.kind_at(pos + len).is_some_and(Kind::is_letter_or_mark) {
            return Some(letters(pos + len));
        }
        if kind.is_letter_or_mark() {
            return Some(letters(pos + len));
        }
        let punct_from = if kind == Kind::Punct {
            Some(pos)
        } else if c == ' ' && self.kind_at(pos + 1) == Some(Kind::Punct) {
            Some(pos + 1)
        } else {
            None
        };
        if let Some(from) = punct_from {
            let mut end = self.run_end(from, |kind| kind == Kind::Punct);
            while let Some(b'\r' | b'\n') = bytes.get(end) {
                end += 1;
            }
            return Some(end);
        }
        kind.is_space().then(|| self.whitespace_end(pos))
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;
    use tokenizers::pre_tokenizers::sequence::Sequence;
    use tokenizers::pre_tokenizers::split::{Split, SplitPattern as HfPattern};
    use tokenizers::{
        OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer, SplitDelimiterBehavior,
    };

    use super::*;

    fn pieces(pattern: &str, text: &str) -> Vec<String> {
        sequence_pieces(&[pattern], text)
    }

    fn sequence_pieces(patterns: &[&str], text: &str) -> Vec<String> {
        let pattern = SplitPattern::from_regexes(patterns).unwrap();
        pattern.split(text).map(str::to_owned).collect()
    }

    /// The pieces `tokenizers` (Oniguruma) cuts `text` into with `split`.
    fn reference(split: &impl PreTokenizer, text: &str) -> Vec<String> {
        let mut pre = PreTokenizedString::from(text);
        split.pre_tokenize(&mut pre).unwrap();
        pre.get_splits(OffsetReferential::Original, OffsetType::Byte)
            .into_iter()
            .map(|(piece, _, _)| piece.to_owned())
            .collect()
    }

    fn hf_split(pattern: &str) -> Split {
        Split::new(
            HfPattern::Regex(pattern.to_owned()),
            SplitDelimiterBehavior::Isolated,
            false,
        )
        .unwrap()
    }

    /// `tokenizers`' `Sequence` of `Split`s, each applied to every piece of the one before.
    fn hf_sequence(patterns: &[&str]) -> Sequence {
        Sequence::new(
            patterns
                .iter()
                .map(|pattern| hf_split(pattern).into())
                .collect(),
        )
    }

    /// One of each kind the patterns tell apart, and the sequences their backtracking turns on.
    const FRAGMENTS: &[&str] = &[
        "a",
        "Z",
        "hello",
        "World",
        "HTTP",
        "Server",
        " ",
        "  ",
        "\t",
        "\n",
        "\r\n",
        "\r",
        "\u{b}",
        "\u{c}",
        "\u{85}",
        "\u{a0}",
        "\u{2028}",
        "\u{3000}",
        "\u{200b}",
        "'",
        "'s",
        "'S",
        "'t",
        "'re",
        "'RE",
        "'rE",
        "'ve",
        "'m",
        "'ll",
        "'Ll",
        "'d",
        "'\u{17f}",
        "'\u{fb05}",
        "'\u{212a}",
        "0",
        "12",
        "3456",
        "\u{663}",
        "\u{2167}",
        "\u{bd}",
        "\u{b2}",
        "!",
        "?!",
        "/",
        "//",
        "-",
        "_",
        ".",
        "\u{301}",
        "\u{308}",
        "\u{20dd}",
        "\u{93f}",
        "\u{e31}",
        "e\u{301}",
        "\u{1c5}",
        "\u{2b0}",
        "\u{4e2d}",
        "\u{6587}",
        "\u{645}\u{631}",
        "\u{928}\u{92e}",
        "\u{e2a}\u{e27}",
        "\u{1f600}",
        "\u{1f44d}\u{1f3fd}",
        "\u{1f468}\u{200d}\u{1f469}",
        "\u{130}",
        "\u{3c3}",
        "\u{df}",
        "<|x|>",
        "\u{3042}\u{3044}",
        "\u{30ab}\u{30bf}",
        "\u{9fa6}",
        "(abc",
        ".x",
        "\u{ff08}",
        "$",
        "+=",
        "\u{1}",
        "\u{200d}",
        "\u{e000}",
        "\u{a9}",
        "\u{2014}",
        "7a",
    ];

    fn text_strategy() -> impl Strategy<Value = String> {
        let fragment = prop_oneof![
            6 => proptest::sample::select(FRAGMENTS).prop_map(str::to_owned),
            1 => any::<char>().prop_map(String::from),
        ];
        proptest::collection::vec(fragment, 0..40).prop_map(|parts| parts.concat())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        #[test]
        fn scanners_equal_oniguruma(text in text_strategy()) {
            for pattern in [LLAMA3, QWEN2, O200K, TEKKEN] {
                let split = hf_split(pattern);
                prop_assert_eq!(pieces(pattern, &text), reference(&split, &text), "{}", pattern);
            }
            prop_assert_eq!(
                sequence_pieces(&DEEPSEEK_V3, &text),
                reference(&hf_sequence(&DEEPSEEK_V3), &text),
                "deepseek-v3"
            );
        }
    }

    #[test]
    fn ascii_runs_equal_the_per_char_runs() {
        for ascii in [
            Ascii::Letters,
            Ascii::Upper,
            Ascii::Lower,
            Ascii::NotDigits,
            Ascii::Any,
        ] {
            let member = |b: u8| match ascii {
                Ascii::Letters => b.is_ascii_alphabetic(),
                Ascii::Upper => b.is_ascii_uppercase(),
                Ascii::Lower => b.is_ascii_lowercase(),
                Ascii::NotDigits => b.is_ascii() && !b.is_ascii_digit(),
                Ascii::Any => b.is_ascii(),
                Ascii::None => false,
            };
            for byte in 0..=255u8 {
                assert_eq!(
                    ascii.members(u64::from(byte)) & 0x80 != 0,
                    member(byte),
                    "{byte}"
                );
            }
            let mut rng = crate::testing::Rng::new(5);
            let alphabet = b"azAZ@[`{09/: \x7f\x80\xc3\xff";
            for _ in 0..20_000 {
                let len = rng.below(24);
                let bytes: Vec<u8> = (0..len).map(|_| *rng.pick(alphabet)).collect();
                let start = rng.below(len + 1);
                let expected = start + bytes[start..].iter().take_while(|&&b| member(b)).count();
                assert_eq!(
                    ascii.run_end(&bytes, start),
                    expected,
                    "{ascii:?} {bytes:?}"
                );
            }
        }
    }

    #[test]
    fn kind_table_equals_the_category_lookup() {
        init_kind_table();
        for code in 0x80..0x1_0000u32 {
            if let Some(c) = char::from_u32(code) {
                assert_eq!(kind_of_non_ascii(c), kind_by_category(c), "U+{code:04X}");
            }
        }
    }

    #[test]
    fn llama3_pieces() {
        assert_eq!(
            pieces(
                LLAMA3,
                "Hello world's  end\n\n x 12345 I'LL 'tis\r\n\r\n  \tfoo!!\n\nbar"
            ),
            [
                "Hello", " world", "'s", " ", " end", "\n\n", " x", " ", "123", "45", " I", "'LL",
                " '", "tis", "\r\n\r\n", "  ", "\tfoo", "!!\n\n", "bar"
            ]
        );
        assert_eq!(pieces(QWEN2, "a 123"), ["a", " ", "1", "2", "3"]);
        assert_eq!(pieces(LLAMA3, "x  "), ["x", "  "]);
        assert_eq!(pieces(LLAMA3, "'\u{17f} 'x"), ["'\u{17f}", " '", "x"]);
    }

    #[test]
    fn o200k_pieces() {
        assert_eq!(
            pieces(
                O200K,
                "HelloWorld HTTPServer don't I'M x\u{301}y 1234 a/b!!\n/c"
            ),
            [
                "Hello",
                "World",
                " HTTPServer",
                " don't",
                " I'M",
                " x\u{301}y",
                " ",
                "123",
                "4",
                " a",
                "/b",
                "!!\n/",
                "c"
            ]
        );
    }

    #[test]
    fn deepseek_v3_pieces() {
        let text =
            "Hello (world) 12345\u{4e2d}\u{6587}abc \u{3042}x  .foo\u{e9}!!\n\n y'all\u{200d}";
        assert_eq!(
            sequence_pieces(&DEEPSEEK_V3, text),
            [
                "Hello",
                " (",
                "world",
                ")",
                " ",
                "123",
                "45",
                "\u{4e2d}\u{6587}",
                "abc",
                " ",
                "\u{3042}",
                "x",
                " ",
                " .",
                "foo\u{e9}",
                "!!\n\n",
                " y",
                "'all",
                "\u{200d}"
            ]
        );
        assert_eq!(
            sequence_pieces(&DEEPSEEK_V3, text),
            reference(&hf_sequence(&DEEPSEEK_V3), text)
        );
    }

    #[test]
    fn hand_examples_agree_with_oniguruma() {
        for pattern in [LLAMA3, QWEN2, O200K, TEKKEN] {
            let split = hf_split(pattern);
            for text in [
                "Hello world's  end\n\n x 12345 I'LL 'tis\r\n\r\n  \tfoo!!\n\nbar",
                "HelloWorld HTTPServer don't I'M x\u{301}y 1234 a/b!!\n/c",
                "'\u{17f} 'x",
                "x  ",
            ] {
                assert_eq!(
                    pieces(pattern, text),
                    reference(&split, text),
                    "{pattern} {text:?}"
                );
            }
        }
    }
}
