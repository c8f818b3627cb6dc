//! The GPT-2 pre-tokenizer regex as a hand-written scanner.
//!
//! `tokenizers`' ByteLevel pre-tokenizer splits text with the Oniguruma pattern
//!
//! ```text
//! 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
//! ```
//!
//! keeping every match as a piece. Every char is whitespace, a letter, a number or "other", so
//! the matches tile the text. At each position the alternatives are tried left to right
//! (leftmost-first): an ASCII contraction; an optional U+0020 then a maximal run of one class;
//! else a whitespace run — all of it at the end of the text, otherwise all but its last char
//! (`(?!\S)` backtracks one char so that char can prefix the next word), or the single char
//! when the run is one char long.
//!
//! Classes follow Oniguruma's Unicode tables (Unicode 16.0): `\s` is the White_Space property
//! (= [`char::is_whitespace`]), `\p{L}` the general categories Lu/Ll/Lt/Lm/Lo and `\p{N}`
//! Nd/Nl/No, looked up in `unicode-general-category` (also Unicode 16.0) beyond ASCII
//! (through [`kind_of`], shared with the `Split` scanners).

use super::split::{Kind, kind_of};

/// The character classes the pattern distinguishes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Class {
    Letter,
    Number,
    Space,
    Other,
}

/// The class of `c` (from the kinds the `Split` scanners use: one set of Unicode tables).
pub(crate) fn class_of(c: char) -> Class {
    match kind_of(c) {
        Kind::Upper | Kind::Lower | Kind::OtherLetter => Class::Letter,
        Kind::Number => Class::Number,
        Kind::Newline | Kind::Space => Class::Space,
        Kind::Mark | Kind::Punct | Kind::Other => Class::Other,
    }
}

/// The pieces of `text`, in order; they concatenate back to `text`.
pub(crate) fn split(text: &str) -> Gpt2Split<'_> {
    Gpt2Split { text, pos: 0 }
}

/// Iterator over the pieces of one text segment.
#[derive(Debug)]
pub(crate) struct Gpt2Split<'a> {
    text: &'a str,
    pos: usize,
}

impl<'a> Iterator for Gpt2Split<'a> {
    type Item = &'a str;

    fn next(&mut self) -> Option<&'a str> {
        let start = self.pos;
        let (c, len) = char_at(self.text, start)?;
        let end = if let Some(n) = contraction_len(c, &self.text.as_bytes()[start + len..]) {
            start + len + n
        } else if let Some((next, next_len)) = char_at(self.text, start + len)
            && c == ' '
            && class_of(next) != Class::Space
        {
            // ` ?X+`: the space joins the run of whatever class follows it.
            self.run_end(start + len + next_len, class_of(next))
        } else {
            match class_of(c) {
                Class::Space => self.whitespace_end(start, len),
                class => self.run_end(start + len, class),
            }
        };
        self.pos = end;
        Some(&self.text[start..end])
    }
}

impl Gpt2Split<'_> {
    /// End of the maximal run of `class` chars starting at `pos`.
    fn run_end(&self, mut pos: usize, class: Class) -> usize {
        while let Some((c, len)) = char_at(self.text, pos)
            && class_of(c) == class
        {
            pos += len;
        }
        pos
    }

    /// `\s+(?!\S)|\s+` at a whitespace char `start` of byte length `len`.
    fn whitespace_end(&self, start: usize, len: usize) -> usize {
        let mut last = start;
        let mut pos = start + len;
        while let Some((c, len)) = char_at(self.text, pos)
            && class_of(c) == Class::Space
        {
            last = pos;
            pos += len;
        }
        if pos == self.text.len() || last == start {
            pos
        } else {
            last
        }
    }
}

/// `'s|'t|'re|'ve|'m|'ll|'d`: byte length after the apostrophe, when one matches here.
fn contraction_len(c: char, rest: &[u8]) -> Option<usize> {
    if c != '\'' {
        return None;
    }
    match rest {
        [b's' | b't' | b'm' | b'd', ..] => Some(1),
        [b'r' | b'v', b'e', ..] | [b'l', b'l', ..] => Some(2),
        _ => None,
    }
}

/// The char at byte `pos` and its UTF-8 length (`pos` is always a char boundary here).
#[inline]
fn char_at(text: &str, pos: usize) -> Option<(char, usize)> {
    let &byte = text.as_bytes().get(pos)?;
    if byte.is_ascii() {
        return Some((char::from(byte), 1));
    }
    let c = text.get(pos..)?.chars().next()?;
    Some((c, c.len_utf8()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pieces(text: &str) -> Vec<&str> {
        split(text).collect()
    }

    #[test]
    fn splits_like_the_gpt2_regex() {
        assert_eq!(
            pieces("Hello world's  end\n\n x"),
            ["Hello", " world", "'s", " ", " end", "\n\n", " x"]
        );
        assert_eq!(pieces("a  "), ["a", "  "]);
        assert_eq!(pieces("\u{a0}word"), ["\u{a0}", "word"]);
        assert_eq!(pieces("''s 'x"), ["''", "s", " '", "x"]);
        assert_eq!(
            pieces("e\u{301}t\u{e9} 42\u{663}!?"),
            ["e", "\u{301}", "t\u{e9}", " 42\u{663}", "!?"]
        );
        assert_eq!(pieces("  \nx"), ["  ", "\n", "x"]);
        assert_eq!(pieces("I'LL we'll"), ["I", "'", "LL", " we", "'ll"]);
        assert!(pieces("").is_empty());
    }

    #[test]
    fn unicode_tables_match_oniguruma_version() {
        // tokenizers' Oniguruma (onig_sys 69.9) carries Unicode 16.0 property tables.
        assert_eq!(unicode_general_category::UNICODE_VERSION, (16, 0, 0));
    }
}
