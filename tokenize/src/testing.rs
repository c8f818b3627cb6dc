//! Test support: seeded mixed text that exercises every branch of the pre-tokenizers and the
//! normalizer (used by the exactness tests against `tokenizers` and by the encode bench).

use std::path::PathBuf;

/// The real tokenizer folders `scripts/models.sh` fetches (each `<models dir>/<name>/`).
pub const REAL_MODELS: [&str; 9] = [
    "qwen3",
    "llama3_1",
    "gptoss",
    "qwen2_5",
    "deepseek_v3",
    "mistral_nemo",
    "llama2",
    "gemma2",
    "gemma3",
];

/// Where the real tokenizer folders are: `KVROUTE_MODELS`, else `scripts/models.sh`'s cache.
pub fn real_models_dir() -> Option<PathBuf> {
    std::env::var_os("KVROUTE_MODELS")
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/kvroute/models"))
        })
}

/// A small seeded generator (SplitMix64): the same seed gives the same text on every platform.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// A generator from `seed`.
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A number in `0..n` (`n` > 0).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n.max(1) as u64) as usize
    }

    /// One of `items`.
    pub fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len())]
    }

    /// One of `items`.
    pub fn pick_str(&mut self, items: &[&'static str]) -> &'static str {
        items[self.below(items.len())]
    }

    /// A char from `lo..=hi` (surrogates become U+FFFD).
    fn char_in(&mut self, lo: u32, hi: u32) -> char {
        let code = lo + self.below((hi - lo + 1) as usize) as u32;
        char::from_u32(code).unwrap_or('\u{fffd}')
    }
}

const WORDS: &[&str] = &[
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "you",
    "that",
    "it",
    "he",
    "was",
    "for",
    "on",
    "are",
    "as",
    "with",
    "his",
    "they",
    "at",
    "be",
    "this",
    "have",
    "from",
    "or",
    "one",
    "had",
    "by",
    "word",
    "but",
    "not",
    "what",
    "all",
    "were",
    "we",
    "when",
    "your",
    "can",
    "said",
    "there",
    "use",
    "an",
    "each",
    "which",
    "she",
    "do",
    "how",
    "their",
    "if",
    "will",
    "up",
    "other",
    "about",
    "out",
    "many",
    "then",
    "them",
    "these",
    "so",
    "some",
    "her",
    "would",
    "make",
    "like",
    "him",
    "into",
    "time",
    "has",
    "look",
    "two",
    "more",
    "write",
    "go",
    "see",
    "number",
    "routing",
    "cache",
    "tokenizer",
    "prefix",
    "replica",
    "request",
    "latency",
    "software",
    "license",
    "distribution",
    "naïve",
    "café",
    "résumé",
    "Straße",
    "façade",
    "coöperate",
];

const CONTRACTIONS: &[&str] = &[
    "'s",
    "'t",
    "'re",
    "'ve",
    "'m",
    "'ll",
    "'d",
    "'S",
    "'T",
    "'RE",
    "'Re",
    "'rE",
    "'VE",
    "'M",
    "'LL",
    "'lL",
    "'D",
    "'\u{17f}",
    "'x",
    "'",
    "''",
    "\u{2019}s",
    "'\u{fb05}",
];

const CODE: &[&str] = &[
    "fn main() {\n    let x = vec![1, 2, 3];\n    println!(\"{x:?}\");\n}\n",
    "def f(a, b):\n\treturn a + b  # sum\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }\r\n",
    "SELECT id, name FROM users WHERE age >= 18 ORDER BY name;\n",
    "import numpy as np\nx = np.zeros((3, 4), dtype=np.float32)\n",
    "<div class=\"row\"><a href=\"https://example.com/a/b?c=d&e=f\">link</a></div>\n",
    "if (!ok && x->next != NULL) return -1; // TODO(fix)\n",
    "const { a, b } = await fetch('/api/v1/items').then(r => r.json());\n",
    "$ cargo nextest run -p kvroute-tokenize -E 'test(/split/)' 2>&1 | tail -3\n",
    "    }\n\n    #[test]\n    fn it_works() {\n        assert_eq!(2 + 2, 4);\n    }\n",
    "/usr/local/bin/python3 -m pip install -U 'tokenizers>=0.20'\n",
    "HTTPServer XMLHttpRequest getHTTPResponseCode parseJSON iOS macOS camelCase snake_case\n",
];

const SPACES: &[&str] = &[
    " ", " ", " ", "  ", "\t", "\n", "\n", "\r\n", "\r", "\u{b}", "\u{c}", "\u{85}", "\u{a0}",
    "\u{1680}", "\u{2000}", "\u{2009}", "\u{200a}", "\u{2028}", "\u{2029}", "\u{202f}", "\u{205f}",
    "\u{3000}", "\u{180e}", "\u{200b}", "\u{feff}",
];

/// Text that composes or reorders under NFC: decomposed letters, marks out of canonical order,
/// Hangul jamo, singletons and compatibility ideographs.
const NFC_CASES: &[&str] = &[
    "e\u{301}",
    "a\u{308}",
    "o\u{302}\u{301}",
    "A\u{30a}",
    "\u{212b}",
    "\u{2126}",
    "\u{212a}",
    "a\u{301}\u{323}",
    "a\u{323}\u{301}",
    "q\u{307}\u{323}",
    "\u{1100}\u{1161}",
    "\u{1100}\u{1161}\u{11a8}",
    "\u{ac00}\u{11a8}",
    "\u{f900}",
    "\u{2f800}",
    "\u{344}",
    "\u{e9}\u{301}",
    "\u{3b1}\u{313}\u{301}\u{345}",
    "\u{928}\u{93c}",
    "\u{915}\u{93c}",
    "\u{5d9}\u{5b4}",
    "\u{fb1d}",
    "\u{1e0a}\u{323}",
    "\u{cd}",
    "I\u{301}",
    "\u{1ec7}",
    "\u{304b}\u{3099}",
    "\u{30cf}\u{309a}",
    "\u{f91}\u{fb7}",
    "\u{301}",
    "\u{301}\u{301}",
];

const EMOJI: &[&str] = &[
    "\u{1f600}",
    "\u{1f44d}\u{1f3fd}",
    "\u{1f44b}\u{1f3ff}",
    "\u{1f468}\u{200d}\u{1f469}\u{200d}\u{1f467}",
    "\u{1f3f3}\u{fe0f}\u{200d}\u{1f308}",
    "\u{2764}\u{fe0f}",
    "\u{1f1fa}\u{1f1f8}",
    "1\u{fe0f}\u{20e3}",
    "\u{1f9d1}\u{1f3fb}\u{200d}\u{1f4bb}",
    "\u{263a}",
    "\u{2705}",
    "\u{1f525}\u{1f525}",
];

/// Seeded mixed text of about `bytes` bytes: English prose with case and contraction
/// variants, code, JSON, CJK, Arabic, Devanagari, Thai, emoji with ZWJ and skin tones,
/// combining marks and NFD forms, digit runs, whitespace runs (`\r\n`, unicode spaces), the
/// `specials` (added-token contents) whole and cut, and random chars from every plane.
pub fn mixed_text(seed: u64, bytes: usize, specials: &[&str]) -> String {
    let mut rng = Rng::new(seed);
    let mut text = String::with_capacity(bytes + 256);
    while text.len() < bytes {
        push_fragment(&mut rng, &mut text, specials);
    }
    text
}

fn push_fragment(rng: &mut Rng, text: &mut String, specials: &[&str]) {
    match rng.below(100) {
        0..=29 => push_prose(rng, text),
        30..=37 => text.push_str(rng.pick_str(CODE)),
        38..=43 => push_json(rng, text, 0),
        44..=49 => push_script(rng, text),
        50..=54 => {
            for _ in 0..1 + rng.below(4) {
                text.push_str(rng.pick_str(EMOJI));
            }
        }
        55..=61 => {
            // Marks on letters, decomposed and precomposed forms side by side.
            text.push_str(rng.pick_str(NFC_CASES));
            if rng.below(2) == 0 {
                text.push_str(rng.pick_str(WORDS));
            }
        }
        62..=67 => push_digits(rng, text),
        68..=76 => {
            for _ in 0..1 + rng.below(6) {
                text.push_str(rng.pick_str(SPACES));
            }
        }
        77..=81 => {
            text.push_str(rng.pick_str(WORDS));
            text.push_str(rng.pick_str(CONTRACTIONS));
        }
        82..=86 if !specials.is_empty() => {
            let special = *rng.pick(specials);
            if rng.below(4) == 0 {
                // A cut special token: the text around it must not match.
                let mut cut = rng.below(special.len().max(1));
                while !special.is_char_boundary(cut) {
                    cut -= 1;
                }
                text.push_str(&special[..cut]);
            } else {
                text.push_str(special);
            }
        }
        87..=91 => {
            for _ in 0..1 + rng.below(4) {
                text.push_str(rng.pick_str(&[
                    "!", "?", "...", "--", "/", "//", "(", ")", "[", "]", "{", "}", "\"", "«", "»",
                    "—", "…", "•", "©", "€", "∑", "≤",
                ]));
            }
        }
        _ => {
            for _ in 0..1 + rng.below(4) {
                let c = match rng.below(4) {
                    0 => rng.char_in(0x80, 0x7ff),
                    1 => rng.char_in(0x800, 0xffff),
                    2 => rng.char_in(0x10000, 0x10ffff),
                    _ => rng.char_in(0, 0x7f),
                };
                text.push(c);
            }
        }
    }
}

fn push_prose(rng: &mut Rng, text: &mut String) {
    let words = 3 + rng.below(20);
    for i in 0..words {
        if i > 0 {
            text.push(' ');
        }
        let word = rng.pick_str(WORDS);
        match rng.below(10) {
            0 => text.push_str(&word.to_uppercase()),
            1 | 2 => {
                let mut chars = word.chars();
                if let Some(first) = chars.next() {
                    text.extend(first.to_uppercase());
                    text.push_str(chars.as_str());
                }
            }
            3 => {
                text.push_str(word);
                text.push_str(&rng.pick_str(WORDS).to_uppercase());
            }
            4 => {
                text.push_str(word);
                text.push_str(rng.pick_str(CONTRACTIONS));
            }
            _ => text.push_str(word),
        }
        if rng.below(8) == 0 {
            text.push_str(rng.pick_str(&[",", ".", ";", ":", "!", "?", "\"", ")", "'"]));
        }
    }
    text.push_str(rng.pick_str(&[". ", ".\n", ".\n\n", "! ", "? ", ".\r\n", "\n", " "]));
}

fn push_json(rng: &mut Rng, text: &mut String, depth: u8) {
    if depth > 2 || rng.below(3) == 0 {
        match rng.below(5) {
            0 => text.push_str(&rng.next_u64().to_string()),
            1 => text.push_str(rng.pick_str(&["true", "false", "null", "-1.5e-3", "0"])),
            2 => {
                text.push('"');
                text.push_str(rng.pick_str(WORDS));
                text.push_str(rng.pick_str(&["", "\\n", "\\u00e9", "\\\"", " x"]));
                text.push('"');
            }
            _ => {
                text.push('"');
                text.push_str(rng.pick_str(NFC_CASES));
                text.push('"');
            }
        }
        return;
    }
    if rng.below(2) == 0 {
        text.push('[');
        for i in 0..rng.below(4) {
            if i > 0 {
                text.push_str(", ");
            }
            push_json(rng, text, depth + 1);
        }
        text.push(']');
    } else {
        text.push_str(rng.pick_str(&["{", "{\n  ", "{ "]));
        for i in 0..1 + rng.below(3) {
            if i > 0 {
                text.push_str(rng.pick_str(&[", ", ",\n  ", ","]));
            }
            text.push('"');
            text.push_str(rng.pick_str(WORDS));
            text.push_str("\": ");
            push_json(rng, text, depth + 1);
        }
        text.push_str(rng.pick_str(&["}", "\n}", " }"]));
    }
}

/// A run of a non-Latin script: CJK, kana, Hangul, Arabic (with harakat), Devanagari, Thai.
fn push_script(rng: &mut Rng, text: &mut String) {
    let (lo, hi) = *rng.pick(&[
        (0x4e00, 0x9fff),
        (0x3040, 0x30ff),
        (0xac00, 0xd7a3),
        (0x0600, 0x06ff),
        (0x0900, 0x097f),
        (0x0e00, 0x0e7f),
        (0x0590, 0x05ff),
        (0x0400, 0x04ff),
        (0x0370, 0x03ff),
        (0xff00, 0xffef),
    ]);
    for _ in 0..1 + rng.below(12) {
        text.push(rng.char_in(lo, hi));
        if rng.below(12) == 0 {
            text.push_str(rng.pick_str(&[" ", "\u{3002}", "\u{3001}", "\u{60c}", ". ", "\n"]));
        }
    }
}

fn push_digits(rng: &mut Rng, text: &mut String) {
    let digits: &[(u32, u32)] = &[
        (0x30, 0x39),
        (0x30, 0x39),
        (0x660, 0x669),
        (0x966, 0x96f),
        (0xff10, 0xff19),
        (0x2160, 0x2188),
        (0xb2, 0xb3),
    ];
    let (lo, hi) = *rng.pick(digits);
    for _ in 0..1 + rng.below(20) {
        text.push(rng.char_in(lo, hi));
        if rng.below(10) == 0 {
            text.push_str(rng.pick_str(&[",", ".", " ", ":", "-", "e"]));
        }
    }
}
