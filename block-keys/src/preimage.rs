//! Byte-exact serializers for the Python objects vLLM hashes: canonical CBOR
//! (`cbor2.dumps(obj, canonical=True)`) and pickle protocol 5 (CPython's `pickle.dumps(obj, 5)`).
//!
//! Only the value shapes vLLM feeds its block hash are covered: `None`, `int`, `bytes`, `str` and
//! tuples of those. Every object is assumed to appear once (true for vLLM's hash inputs), so the
//! pickle memo never produces a back-reference.

use crate::HashValue;

/// The chained parent as vLLM holds it.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Parent<'a> {
    /// Python `bytes` (0.10.2+).
    Bytes(&'a [u8]),
    /// Python `int` given as an unsigned big-endian magnitude (0.9.0-0.10.1.1 algorithms).
    Int(&'a [u8]),
}

impl Parent<'_> {
    /// Python truthiness: vLLM replaces a falsy parent with NONE_HASH (`if not parent_block_hash`).
    pub(crate) fn is_truthy(&self) -> bool {
        match self {
            Parent::Bytes(b) => !b.is_empty(),
            Parent::Int(magnitude) => magnitude.iter().any(|&b| b != 0),
        }
    }
}

/// The hashed block object `(parent, tuple(tokens), extra_keys)`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct BlockTuple<'a> {
    pub(crate) parent: Parent<'a>,
    pub(crate) tokens: &'a [u32],
    pub(crate) extra: Option<&'a HashValue>,
}

/// Significant bytes of a big-endian unsigned magnitude (leading zeros dropped).
fn significant(magnitude: &[u8]) -> &[u8] {
    let first = magnitude
        .iter()
        .position(|&b| b != 0)
        .unwrap_or(magnitude.len());
    &magnitude[first..]
}

/// `Some(value)` if the big-endian magnitude fits a `u64`.
fn magnitude_as_u64(magnitude: &[u8]) -> Option<u64> {
    let sig = significant(magnitude);
    (sig.len() <= 8).then(|| crate::published_u64(sig))
}

/// Appends the first `len` bytes of `bytes`. A constant-size copy plus a truncate is much cheaper
/// than a variable-length `extend_from_slice` for these 1-5 byte token encodings.
#[inline]
fn push_prefix(out: &mut Vec<u8>, bytes: [u8; 5], len: usize) {
    out.extend_from_slice(&bytes);
    out.truncate(out.len() - (bytes.len() - len));
}

// ---------------------------------------------------------------------------------------------
// Canonical CBOR (RFC 8949 core deterministic encoding, as cbor2 emits it)
// ---------------------------------------------------------------------------------------------

pub(crate) mod cbor {
    use super::*;

    const MAJOR_UINT: u8 = 0;
    const MAJOR_NEGINT: u8 = 1;
    const MAJOR_BYTES: u8 = 2;
    const MAJOR_TEXT: u8 = 3;
    const MAJOR_ARRAY: u8 = 4;
    const TAG_POSITIVE_BIGNUM: u8 = 0xc2;
    const NULL: u8 = 0xf6;

    /// A major type with its argument in the shortest form.
    fn head(out: &mut Vec<u8>, major: u8, arg: u64) {
        let major = major << 5;
        if arg < 24 {
            out.push(major | arg as u8);
        } else if let Ok(v) = u8::try_from(arg) {
            out.extend_from_slice(&[major | 24, v]);
        } else if let Ok(v) = u16::try_from(arg) {
            out.push(major | 25);
            out.extend_from_slice(&v.to_be_bytes());
        } else if let Ok(v) = u32::try_from(arg) {
            out.push(major | 26);
            out.extend_from_slice(&v.to_be_bytes());
        } else {
            out.push(major | 27);
            out.extend_from_slice(&arg.to_be_bytes());
        }
    }

    fn len_head(out: &mut Vec<u8>, major: u8, len: usize) {
        head(out, major, len as u64);
    }

    fn int(out: &mut Vec<u8>, v: i64) {
        match u64::try_from(v) {
            Ok(u) => head(out, MAJOR_UINT, u),
            // -1 - v == !v, with no overflow for i64::MIN.
            Err(_) => head(out, MAJOR_NEGINT, !v as u64),
        }
    }

    fn unsigned_magnitude(out: &mut Vec<u8>, magnitude: &[u8]) {
        match magnitude_as_u64(magnitude) {
            Some(v) => head(out, MAJOR_UINT, v),
            None => {
                let sig = significant(magnitude);
                out.push(TAG_POSITIVE_BIGNUM);
                len_head(out, MAJOR_BYTES, sig.len());
                out.extend_from_slice(sig);
            }
        }
    }

    pub(crate) fn value(out: &mut Vec<u8>, v: &HashValue) {
        match v {
            HashValue::None => out.push(NULL),
            HashValue::Int(i) => int(out, *i),
            HashValue::Str(s) => text(out, s),
            HashValue::Bytes(b) => {
                len_head(out, MAJOR_BYTES, b.len());
                out.extend_from_slice(b);
            }
            HashValue::Tuple(items) => {
                len_head(out, MAJOR_ARRAY, items.len());
                items.iter().for_each(|item| value(out, item));
            }
        }
    }

    pub(crate) fn text(out: &mut Vec<u8>, s: &str) {
        len_head(out, MAJOR_TEXT, s.len());
        out.extend_from_slice(s.as_bytes());
    }

    /// Appends `cbor2.dumps((parent, tuple(tokens), extra), canonical=True)`.
    pub(crate) fn block(out: &mut Vec<u8>, block: &BlockTuple<'_>) {
        len_head(out, MAJOR_ARRAY, 3);
        match block.parent {
            Parent::Bytes(b) => {
                len_head(out, MAJOR_BYTES, b.len());
                out.extend_from_slice(b);
            }
            Parent::Int(magnitude) => unsigned_magnitude(out, magnitude),
        }
        len_head(out, MAJOR_ARRAY, block.tokens.len());
        out.reserve(block.tokens.len() * 5 + 1);
        for &t in block.tokens {
            // `head(out, MAJOR_UINT, t)` without data-dependent branches: token ids straddle the
            // width boundaries at random, and mispredictions dominated this loop.
            let class = usize::from(t >= 24) + usize::from(t >= 0x100) + usize::from(t >= 0x1_0000);
            let payload_len = [0, 1, 2, 4][class];
            let initial = if class == 0 {
                t as u8
            } else {
                23 + class as u8
            };
            let [_, _, _, _, a, b, c, d] = (u64::from(t) << (8 * (4 - payload_len))).to_be_bytes();
            let (bytes, len) = ([initial, a, b, c, d], 1 + payload_len);
            push_prefix(out, bytes, len);
        }
        match block.extra {
            Some(v) => value(out, v),
            None => out.push(NULL),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Pickle protocol 5, as CPython's C pickler writes it (checked against CPython 3.11)
// ---------------------------------------------------------------------------------------------

pub(crate) mod pickle {
    use super::*;

    const PROTO: u8 = 0x80;
    const FRAME: u8 = 0x95;
    const STOP: u8 = b'.';
    const NONE: u8 = b'N';
    const BININT1: u8 = b'K';
    const BININT2: u8 = b'M';
    const BININT: u8 = b'J';
    const LONG1: u8 = 0x8a;
    const LONG4: u8 = 0x8b;
    const SHORT_BINBYTES: u8 = b'C';
    const BINBYTES: u8 = b'B';
    const BINBYTES8: u8 = 0x8e;
    const SHORT_BINUNICODE: u8 = 0x8c;
    const BINUNICODE: u8 = b'X';
    const BINUNICODE8: u8 = 0x8d;
    const EMPTY_TUPLE: u8 = b')';
    const MARK: u8 = b'(';
    const TUPLE: u8 = b't';
    const TUPLE1: u8 = 0x85;
    const MEMOIZE: u8 = 0x94;

    /// The pickler starts a new frame at the next object once the current one reaches this size,
    /// and writes `bytes`/`str` payloads at least this long outside any frame.
    const FRAME_SIZE_TARGET: usize = 64 * 1024;
    /// Frames shorter than this are written without a FRAME header.
    const FRAME_SIZE_MIN: usize = 4;
    /// FRAME opcode plus u64 little-endian length.
    const FRAME_HEADER_LEN: usize = 9;

    /// A pickler writing into a caller buffer. Frame headers are reserved up front and filled in
    /// (or removed, for frames under [`FRAME_SIZE_MIN`]) when the frame is committed.
    struct Pickler<'b> {
        out: &'b mut Vec<u8>,
        /// Offset of the current frame's reserved header; `None` between frames.
        frame_start: Option<usize>,
    }

    impl<'b> Pickler<'b> {
        fn begin(out: &'b mut Vec<u8>) -> Self {
            out.extend_from_slice(&[PROTO, 5]);
            Self {
                out,
                frame_start: None,
            }
        }

        fn write(&mut self, bytes: &[u8]) {
            if self.frame_start.is_none() {
                self.frame_start = Some(self.out.len());
                self.out.extend_from_slice(&[0; FRAME_HEADER_LEN]);
            }
            self.out.extend_from_slice(bytes);
        }

        fn commit_frame(&mut self) {
            let Some(start) = self.frame_start.take() else {
                return;
            };
            let len = self.out.len() - start - FRAME_HEADER_LEN;
            if len >= FRAME_SIZE_MIN {
                self.out[start] = FRAME;
                self.out[start + 1..start + FRAME_HEADER_LEN]
                    .copy_from_slice(&(len as u64).to_le_bytes());
            } else {
                self.out.drain(start..start + FRAME_HEADER_LEN);
            }
        }

        /// Called before every object is saved, like CPython's framer: a frame is cut only at
        /// object boundaries, so opcodes closing a tuple stay in the frame of its last item.
        fn object_boundary(&mut self) {
            if let Some(start) = self.frame_start
                && self.out.len() - start - FRAME_HEADER_LEN >= FRAME_SIZE_TARGET
            {
                self.commit_frame();
            }
        }

        fn finish(mut self) {
            self.write(&[STOP]);
            self.commit_frame();
        }

        fn none(&mut self) {
            self.object_boundary();
            self.write(&[NONE]);
        }

        fn int(&mut self, v: i64) {
            self.object_boundary();
            if let Ok(small) = u8::try_from(v) {
                self.write(&[BININT1, small]);
            } else if let Ok(small) = u16::try_from(v) {
                let [a, b] = small.to_le_bytes();
                self.write(&[BININT2, a, b]);
            } else if let Ok(v32) = i32::try_from(v) {
                let [a, b, c, d] = v32.to_le_bytes();
                self.write(&[BININT, a, b, c, d]);
            } else {
                self.long(&minimal_twos_complement_le(v));
            }
        }

        /// A non-negative int given as a big-endian magnitude of any width.
        fn unsigned_magnitude(&mut self, magnitude: &[u8]) {
            match magnitude_as_u64(magnitude).map(i64::try_from) {
                Some(Ok(v)) => self.int(v),
                _ => {
                    self.object_boundary();
                    let mut le: Vec<u8> = significant(magnitude).iter().rev().copied().collect();
                    if le.last().is_some_and(|&top| top & 0x80 != 0) {
                        le.push(0); // sign byte: the value is positive
                    }
                    self.long(&le);
                }
            }
        }

        fn long(&mut self, le: &[u8]) {
            match u8::try_from(le.len()) {
                Ok(n) => self.write(&[LONG1, n]),
                Err(_) => {
                    self.write(&[LONG4]);
                    self.write(&(le.len() as u32).to_le_bytes());
                }
            }
            self.write(le);
        }

        /// Saves each token as an int. When the whole run fits in the current frame no frame can
        /// be cut inside it, so the per-object framing checks are skipped.
        fn tokens(&mut self, tokens: &[u32]) {
            // LONG1 of a u32 above i32::MAX is the longest encoding: 2 + 5 bytes.
            const MAX_TOKEN_LEN: usize = 7;
            let worst = tokens.len() * MAX_TOKEN_LEN;
            let fits_frame = self.frame_start.is_some_and(|start| {
                self.out.len() - start - FRAME_HEADER_LEN + worst < FRAME_SIZE_TARGET
            });
            if !fits_frame {
                tokens.iter().for_each(|&t| self.int(i64::from(t)));
                return;
            }
            self.out.reserve(worst);
            for &t in tokens {
                if t > i32::MAX as u32 {
                    self.int(i64::from(t));
                    continue;
                }
                // BININT1/BININT2/BININT picked without data-dependent branches (see CBOR).
                let class = usize::from(t >= 0x100) + usize::from(t >= 0x1_0000);
                let [a, b, c, d] = t.to_le_bytes();
                let (bytes, len) = (
                    [[BININT1, BININT2, BININT][class], a, b, c, d],
                    [2, 3, 5][class],
                );
                push_prefix(self.out, bytes, len);
            }
        }

        /// `bytes` and `str` share their layout; only the opcodes differ.
        fn sized(&mut self, payload: &[u8], ops: [u8; 3]) {
            let [short, long, long8] = ops;
            self.object_boundary();
            let n = payload.len();
            if let Ok(n8) = u8::try_from(n) {
                self.write(&[short, n8]);
                self.write(payload);
            } else {
                let mut header = [0u8; 9];
                let header = match u32::try_from(n) {
                    Ok(n32) => {
                        header[0] = long;
                        header[1..5].copy_from_slice(&n32.to_le_bytes());
                        &header[..5]
                    }
                    Err(_) => {
                        header[0] = long8;
                        header[1..9].copy_from_slice(&(n as u64).to_le_bytes());
                        &header[..]
                    }
                };
                if n >= FRAME_SIZE_TARGET {
                    // Large payloads bypass framing: close the frame, write header and payload
                    // raw; the next write opens a new frame.
                    self.commit_frame();
                    self.out.extend_from_slice(header);
                    self.out.extend_from_slice(payload);
                } else {
                    self.write(header);
                    self.write(payload);
                }
            }
            self.write(&[MEMOIZE]);
        }

        fn bytes(&mut self, b: &[u8]) {
            self.sized(b, [SHORT_BINBYTES, BINBYTES, BINBYTES8]);
        }

        fn str(&mut self, s: &str) {
            self.sized(s.as_bytes(), [SHORT_BINUNICODE, BINUNICODE, BINUNICODE8]);
        }

        /// Saves a tuple whose items are written by `items` (which saves exactly `len` objects).
        fn tuple(&mut self, len: usize, items: impl FnOnce(&mut Self)) {
            self.object_boundary();
            match len {
                0 => self.write(&[EMPTY_TUPLE]),
                1..=3 => {
                    items(self);
                    self.write(&[TUPLE1 + (len as u8 - 1), MEMOIZE]);
                }
                _ => {
                    self.write(&[MARK]);
                    items(self);
                    self.write(&[TUPLE, MEMOIZE]);
                }
            }
        }

        fn value(&mut self, v: &HashValue) {
            match v {
                HashValue::None => self.none(),
                HashValue::Int(i) => self.int(*i),
                HashValue::Str(s) => self.str(s),
                HashValue::Bytes(b) => self.bytes(b),
                HashValue::Tuple(items) => self.tuple(items.len(), |p| {
                    items.iter().for_each(|item| p.value(item));
                }),
            }
        }
    }

    /// The shortest little-endian two's-complement encoding (what CPython's LONG1 carries).
    fn minimal_twos_complement_le(v: i64) -> Vec<u8> {
        let mut le = v.to_le_bytes().to_vec();
        while let [.., prev, last] = le[..] {
            let redundant =
                (last == 0x00 && prev & 0x80 == 0) || (last == 0xff && prev & 0x80 != 0);
            if !redundant {
                break;
            }
            le.pop();
        }
        le
    }

    /// Appends `pickle.dumps(s, protocol=5)` (the NONE_HASH preimage).
    pub(crate) fn str_object(out: &mut Vec<u8>, s: &str) {
        let mut p = Pickler::begin(out);
        p.str(s);
        p.finish();
    }

    /// Appends `pickle.dumps(v, protocol=5)`.
    #[cfg(test)]
    pub(crate) fn value_object(out: &mut Vec<u8>, v: &HashValue) {
        let mut p = Pickler::begin(out);
        p.value(v);
        p.finish();
    }

    /// Appends `pickle.dumps((parent, tuple(tokens), extra), protocol=5)`.
    pub(crate) fn block(out: &mut Vec<u8>, block: &BlockTuple<'_>) {
        let mut p = Pickler::begin(out);
        p.tuple(3, |p| {
            match block.parent {
                Parent::Bytes(b) => p.bytes(b),
                Parent::Int(magnitude) => p.unsigned_magnitude(magnitude),
            }
            p.tuple(block.tokens.len(), |p| p.tokens(block.tokens));
            match block.extra {
                Some(v) => p.value(v),
                None => p.none(),
            }
        });
        p.finish();
    }
}

/// Expected bytes come from CPython 3.11's `pickle.dumps(obj, protocol=5)`.
#[cfg(test)]
mod tests {
    use sha2::{Digest as _, Sha256};

    use super::*;

    fn s(v: &str) -> HashValue {
        HashValue::Str(v.to_owned())
    }

    fn pickled(v: &HashValue) -> String {
        let mut out = Vec::new();
        pickle::value_object(&mut out, v);
        hex::encode(out)
    }

    fn pickled_block_sha256(
        parent: Parent<'_>,
        tokens: &[u32],
        extra: Option<&HashValue>,
    ) -> String {
        let mut out = Vec::new();
        pickle::block(
            &mut out,
            &BlockTuple {
                parent,
                tokens,
                extra,
            },
        );
        hex::encode(Sha256::digest(&out))
    }

    #[test]
    fn pickle_ints_use_cpythons_opcode_per_range() {
        let ints = [
            0,
            255,
            256,
            65535,
            65536,
            -1,
            -129,
            (1 << 31) - 1,
            -(1 << 31),
            1 << 31,
            -(1 << 31) - 1,
            1 << 39,
            -(1 << 39),
            -(1 << 39) - 1,
            i64::MAX,
            i64::MIN,
        ];
        let v = HashValue::Tuple(ints.into_iter().map(HashValue::Int).collect());
        assert_eq!(
            pickled(&v),
            "8005956000000000000000284b004bff4d00014dffff4a000001004affffffff4a7fffffff4affff\
             ff7f4a000000808a0500000080008a05ffffff7fff8a060000000080008a0500000000808a06ffff\
             ffff7fff8a08ffffffffffffff7f8a08000000000000008074942e"
        );
    }

    #[test]
    fn pickle_strings_bytes_and_tuples() {
        let v = HashValue::Tuple(vec![
            s(""),
            s("é"),
            s(&"a".repeat(255)),
            s(&"b".repeat(256)),
            HashValue::Bytes(vec![]),
            HashValue::Bytes(vec![b'x'; 300]),
            HashValue::Tuple(vec![]),
            HashValue::Tuple(vec![s("one")]),
            HashValue::Tuple((1..=4).map(HashValue::Int).collect()),
        ]);
        let expected = format!(
            "8005955d03000000000000288c00948c02c3a9948cff{}945800010000{}944300944\
             22c010000{}94298c036f6e65948594284b014b024b034b04749474942e",
            "61".repeat(255),
            "62".repeat(256),
            "78".repeat(300)
        );
        assert_eq!(pickled(&v), expected);
    }

    #[test]
    fn pickle_legacy_int_parents() {
        let mut out = Vec::new();
        let mut big = [0x11u8; 32];
        big[0] = 0x80;
        let block = BlockTuple {
            parent: Parent::Int(&big),
            tokens: &[1],
            extra: None,
        };
        pickle::block(&mut out, &block);
        assert_eq!(
            hex::encode(&out),
            format!(
                "8005952b000000000000008a21{}80004b0185944e87942e",
                "11".repeat(31)
            )
        );
        out.clear();
        big[0] = 0x7f;
        let block = BlockTuple {
            parent: Parent::Int(&big),
            tokens: &[1],
            extra: None,
        };
        pickle::block(&mut out, &block);
        assert_eq!(
            hex::encode(&out),
            format!(
                "8005952a000000000000008a20{}7f4b0185944e87942e",
                "11".repeat(31)
            )
        );
    }

    #[test]
    fn pickle_token_ids_of_every_width() {
        let mut out = Vec::new();
        let parent = [1u8; 32];
        let block = BlockTuple {
            parent: Parent::Bytes(&parent),
            tokens: &[1 << 31, u32::MAX, 5, 300, 70_000],
            extra: None,
        };
        pickle::block(&mut out, &block);
        assert_eq!(
            hex::encode(&out),
            format!(
                "80059542000000000000004320{}94288a0500000080008a05ffffffff004b054d2c01\
                 4a7011010074944e87942e",
                "01".repeat(32)
            )
        );
    }

    /// Preimages over 64 KiB split into several frames exactly where CPython splits them.
    #[test]
    fn pickle_frames_split_like_cpython() {
        let parent = [1u8; 32];
        for (len, expected) in [
            (
                13099,
                "d95b0d479eb0d0f74bba44d8f82b9b4faf15e66dd0bc4c48067d49fdbe799ce4",
            ),
            (
                13100,
                "ebcd8f518ef1658a7b5e8e5aeac4995860d055091eaa2e261957732de9d18460",
            ),
            (
                13101,
                "9a91609490e029be79785b2020373ba611b5f6c350fe2696f252938382c99521",
            ),
        ] {
            let tokens: Vec<u32> = (70_000..70_000 + len).collect();
            assert_eq!(
                pickled_block_sha256(Parent::Bytes(&parent), &tokens, None),
                expected,
                "{len} tokens"
            );
        }
        for (extra, expected) in [
            (
                HashValue::Tuple(vec![s(&"a".repeat(65535))]),
                "4a2e118ccc139c20c8f267c8856151c466437b1063e97a62494e5f6a4de96aa7",
            ),
            (
                HashValue::Tuple(vec![s(&"a".repeat(70000))]),
                "be929d4ad4349960c83ac9e9935320f38ef78a0475c9341e6983e2ce0babb8c7",
            ),
            (
                HashValue::Tuple(vec![HashValue::Bytes(vec![b'a'; 65536]), s("s")]),
                "778f67130caa9c002a5a369e287e32ab1cf40bf1a180907d775deec2069aa59b",
            ),
        ] {
            assert_eq!(
                pickled_block_sha256(Parent::Bytes(&parent), &[1, 2], Some(&extra)),
                expected
            );
        }
    }

    #[test]
    fn cbor_covers_negative_ints_and_bignums() {
        let mut out = Vec::new();
        cbor::value(
            &mut out,
            &HashValue::Tuple(vec![
                HashValue::Int(-1),
                HashValue::Int(-25),
                HashValue::Int(i64::MIN),
                HashValue::Int(1 << 32),
                HashValue::Bytes(vec![7]),
                HashValue::None,
            ]),
        );
        assert_eq!(
            hex::encode(&out),
            "86203818 3b7fffffffffffffff 1b0000000100000000 4107 f6".replace(' ', "")
        );
        out.clear();
        let mut big = [0u8; 10];
        big[1] = 1;
        let block = BlockTuple {
            parent: Parent::Int(&big),
            tokens: &[24, 256],
            extra: None,
        };
        cbor::block(&mut out, &block);
        assert_eq!(hex::encode(&out), "83c249010000000000000000821818190100f6");
    }
}
