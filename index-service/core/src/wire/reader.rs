//! A bounds-checked msgpack reader over a borrowed payload.
//!
//! Strings and byte strings are returned as slices of the input (no copies). Every declared
//! length is checked against the bytes left before it is used, so a hostile header such as
//! `array32` of four billion elements fails at once instead of allocating or looping.

use rmp::Marker;

use super::WireError;

/// A msgpack integer as encoded: unsigned unless the value is negative.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Int {
    /// A non-negative value (positive fixint, `uint8..uint64`, or a non-negative `int8..int64`).
    Unsigned(u64),
    /// A negative value (negative fixint or `int8..int64`).
    Negative(i64),
}

impl Int {
    /// The value as `i64`, if it fits.
    pub(crate) fn to_i64(self) -> Option<i64> {
        match self {
            Int::Unsigned(v) => i64::try_from(v).ok(),
            Int::Negative(v) => Some(v),
        }
    }

    /// The value reinterpreted as u64 (two's complement for negatives, as for vLLM's signed
    /// pre-0.10.2 `hash()` values).
    pub(crate) fn to_u64_wrapping(self) -> u64 {
        match self {
            Int::Unsigned(v) => v,
            Int::Negative(v) => v as u64,
        }
    }
}

/// Cursor over one msgpack payload.
#[derive(Debug, Clone)]
pub(crate) struct Reader<'a> {
    input: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    pub(crate) fn new(input: &'a [u8]) -> Self {
        Reader { input, pos: 0 }
    }

    /// Offset of the next unread byte.
    pub(crate) fn position(&self) -> usize {
        self.pos
    }

    /// Bytes not yet read.
    pub(crate) fn remaining(&self) -> usize {
        self.input.len() - self.pos
    }

    /// Moves back to an earlier [`Reader::position`] (used to re-read a map after finding its tag).
    pub(crate) fn rewind(&mut self, pos: usize) {
        debug_assert!(pos <= self.pos);
        self.pos = pos.min(self.pos);
    }

    /// The next `n` bytes, borrowed.
    fn take(&mut self, n: usize) -> Result<&'a [u8], WireError> {
        let rest = self.input.get(self.pos..).unwrap_or_default();
        match rest.get(..n) {
            Some(bytes) => {
                self.pos += n;
                Ok(bytes)
            }
            None => Err(WireError::Truncated {
                offset: self.pos,
                needed: n - rest.len(),
            }),
        }
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], WireError> {
        let bytes = self.take(N)?;
        let mut out = [0u8; N];
        out.copy_from_slice(bytes);
        Ok(out)
    }

    fn byte(&mut self) -> Result<u8, WireError> {
        Ok(self.array::<1>()?[0])
    }

    fn be_u16(&mut self) -> Result<u16, WireError> {
        Ok(u16::from_be_bytes(self.array()?))
    }

    fn be_u32(&mut self) -> Result<u32, WireError> {
        Ok(u32::from_be_bytes(self.array()?))
    }

    fn be_u64(&mut self) -> Result<u64, WireError> {
        Ok(u64::from_be_bytes(self.array()?))
    }

    /// The next marker byte without consuming it.
    fn peek(&self) -> Option<u8> {
        self.input.get(self.pos).copied()
    }

    /// The error for a value of the wrong type at `offset` (or for no value at all).
    fn type_error(&self, field: &'static str, expected: &'static str, offset: usize) -> WireError {
        match self.input.get(offset) {
            Some(&marker) => WireError::UnexpectedType {
                field,
                expected,
                found: marker_name(Marker::from_u8(marker)),
                offset,
            },
            None => WireError::Truncated { offset, needed: 1 },
        }
    }

    /// Consumes a nil if one is next; `Ok(false)` (nothing consumed) otherwise.
    pub(crate) fn nil(&mut self) -> Result<bool, WireError> {
        match self.peek() {
            Some(0xc0) => {
                self.pos += 1;
                Ok(true)
            }
            Some(_) => Ok(false),
            None => Err(WireError::Truncated {
                offset: self.pos,
                needed: 1,
            }),
        }
    }

    /// Rejects a declared element count that the remaining bytes cannot hold
    /// (`min_bytes` per element), before anything is sized from it.
    fn checked_len(&self, len: u32, min_bytes: usize) -> Result<usize, WireError> {
        let len = len as usize;
        let needed = len.saturating_mul(min_bytes);
        if needed > self.remaining() {
            return Err(WireError::Truncated {
                offset: self.pos,
                needed: needed - self.remaining(),
            });
        }
        Ok(len)
    }

    /// An array header; the length is known to fit the remaining input.
    pub(crate) fn array_len(&mut self, field: &'static str) -> Result<usize, WireError> {
        let at = self.pos;
        let len = match self.byte()? {
            b @ 0x90..=0x9f => u32::from(b & 0x0f),
            0xdc => u32::from(self.be_u16()?),
            0xdd => self.be_u32()?,
            _ => return Err(self.type_error(field, "array", at)),
        };
        self.checked_len(len, 1)
    }

    /// A map header (number of key/value pairs); the length is known to fit the remaining input.
    pub(crate) fn map_len(&mut self, field: &'static str) -> Result<usize, WireError> {
        let at = self.pos;
        let len = match self.byte()? {
            b @ 0x80..=0x8f => u32::from(b & 0x0f),
            0xde => u32::from(self.be_u16()?),
            0xdf => self.be_u32()?,
            _ => return Err(self.type_error(field, "map", at)),
        };
        self.checked_len(len, 2)
    }

    /// The container kind of the next value, without consuming it.
    pub(crate) fn peek_container(&self) -> Option<Container> {
        match self.peek()? {
            0x90..=0x9f | 0xdc | 0xdd => Some(Container::Array),
            0x80..=0x8f | 0xde | 0xdf => Some(Container::Map),
            _ => None,
        }
    }

    /// The container kind of the next value, which must be an array or a map.
    pub(crate) fn container(&self, field: &'static str) -> Result<Container, WireError> {
        match self.peek_container() {
            Some(container) => Ok(container),
            None if self.remaining() == 0 => Err(WireError::Truncated {
                offset: self.pos,
                needed: 1,
            }),
            None => Err(self.type_error(field, "array or map", self.pos)),
        }
    }

    /// A str (borrowed bytes, not checked for UTF-8), or `None` after skipping any other value.
    /// Used for map keys, where a non-str key is simply an unknown one.
    pub(crate) fn key(&mut self) -> Result<Option<&'a [u8]>, WireError> {
        match self.str_bytes()? {
            Some(bytes) => Ok(Some(bytes)),
            None => {
                self.skip(1)?;
                Ok(None)
            }
        }
    }

    /// Reads a str header and returns its bytes, or `None` (nothing consumed) if the next
    /// value is not a str.
    fn str_bytes(&mut self) -> Result<Option<&'a [u8]>, WireError> {
        let len = match self.peek() {
            Some(b @ 0xa0..=0xbf) => {
                self.pos += 1;
                u32::from(b & 0x1f)
            }
            Some(0xd9) => {
                self.pos += 1;
                u32::from(self.byte()?)
            }
            Some(0xda) => {
                self.pos += 1;
                u32::from(self.be_u16()?)
            }
            Some(0xdb) => {
                self.pos += 1;
                self.be_u32()?
            }
            _ => return Ok(None),
        };
        self.take(len as usize).map(Some)
    }

    /// Reads a bin header and returns its bytes, or `None` (nothing consumed) if the next
    /// value is not a bin.
    fn bin_bytes(&mut self) -> Result<Option<&'a [u8]>, WireError> {
        let len = match self.peek() {
            Some(0xc4) => {
                self.pos += 1;
                u32::from(self.byte()?)
            }
            Some(0xc5) => {
                self.pos += 1;
                u32::from(self.be_u16()?)
            }
            Some(0xc6) => {
                self.pos += 1;
                self.be_u32()?
            }
            _ => return Ok(None),
        };
        self.take(len as usize).map(Some)
    }

    /// A UTF-8 string, borrowed from the input.
    pub(crate) fn str(&mut self, field: &'static str) -> Result<&'a str, WireError> {
        let at = self.pos;
        match self.str_bytes()? {
            Some(bytes) => {
                std::str::from_utf8(bytes).map_err(|_| WireError::InvalidUtf8 { field, offset: at })
            }
            None => Err(self.type_error(field, "str", at)),
        }
    }

    /// A str's raw bytes (not checked for UTF-8), for values only ever compared to known
    /// ASCII names such as event tags.
    pub(crate) fn str_raw(&mut self, field: &'static str) -> Result<&'a [u8], WireError> {
        let at = self.pos;
        self.str_bytes()?
            .ok_or_else(|| self.type_error(field, "str", at))
    }

    /// A string or nil.
    pub(crate) fn opt_str(&mut self, field: &'static str) -> Result<Option<&'a str>, WireError> {
        if self.nil()? {
            return Ok(None);
        }
        self.str(field).map(Some)
    }

    /// A block hash: a uint, a negative int (two's complement) or a str/bin digest.
    pub(crate) fn hash(&mut self, field: &'static str) -> Result<Hash<'a>, WireError> {
        let at = self.pos;
        if let Some(int) = self.int_or_none()? {
            return Ok(Hash::Int(int.to_u64_wrapping()));
        }
        if let Some(bytes) = self.bin_bytes()? {
            return Ok(Hash::Digest(bytes));
        }
        match self.str_bytes()? {
            Some(bytes) => Ok(Hash::Digest(bytes)),
            None => Err(self.type_error(field, "int, bin or str", at)),
        }
    }

    /// An integer of any width, or `None` (nothing consumed) if the next value is not one.
    fn int_or_none(&mut self) -> Result<Option<Int>, WireError> {
        let Some(marker) = self.peek() else {
            return Err(WireError::Truncated {
                offset: self.pos,
                needed: 1,
            });
        };
        let from_signed = |v: i64| {
            if v < 0 {
                Int::Negative(v)
            } else {
                Int::Unsigned(v as u64)
            }
        };
        if !matches!(marker, 0x00..=0x7f | 0xe0..=0xff | 0xcc..=0xd3) {
            return Ok(None);
        }
        self.pos += 1;
        let int = match marker {
            0x00..=0x7f => Int::Unsigned(u64::from(marker)),
            0xe0..=0xff => Int::Negative(i64::from(marker as i8)),
            0xcc => Int::Unsigned(u64::from(self.byte()?)),
            0xcd => Int::Unsigned(u64::from(self.be_u16()?)),
            0xce => Int::Unsigned(u64::from(self.be_u32()?)),
            0xcf => Int::Unsigned(self.be_u64()?),
            0xd0 => from_signed(i64::from(self.byte()? as i8)),
            0xd1 => from_signed(i64::from(self.be_u16()? as i16)),
            0xd2 => from_signed(i64::from(self.be_u32()? as i32)),
            _ => from_signed(self.be_u64()? as i64),
        };
        Ok(Some(int))
    }

    /// An integer of any width.
    pub(crate) fn int(&mut self, field: &'static str) -> Result<Int, WireError> {
        let at = self.pos;
        self.int_or_none()?
            .ok_or_else(|| self.type_error(field, "int", at))
    }

    /// An integer that must fit `u32` (token ids, block size, ranks, group indices).
    #[inline]
    pub(crate) fn u32(&mut self, field: &'static str) -> Result<u32, WireError> {
        // Token ids dominate payloads; most are positive fixints or uint16.
        match self.peek() {
            Some(b @ 0x00..=0x7f) => {
                self.pos += 1;
                Ok(u32::from(b))
            }
            Some(0xcd) => {
                self.pos += 1;
                Ok(u32::from(self.be_u16()?))
            }
            _ => {
                let at = self.pos;
                match self.int(field)? {
                    Int::Unsigned(v) => {
                        u32::try_from(v).map_err(|_| WireError::IntOutOfRange { field, offset: at })
                    }
                    Int::Negative(_) => Err(WireError::IntOutOfRange { field, offset: at }),
                }
            }
        }
    }

    /// A non-negative integer of any width (SGLang token ids, which may exceed u32).
    pub(crate) fn u64_token(&mut self, field: &'static str) -> Result<u64, WireError> {
        let at = self.pos;
        match self.int(field)? {
            Int::Unsigned(v) => Ok(v),
            Int::Negative(_) => Err(WireError::IntOutOfRange { field, offset: at }),
        }
    }

    /// Appends `len` unsigned integers that must fit `u32` (the elements of a token id array).
    ///
    /// The common encodings are read straight from the slice; anything else (wider or signed
    /// markers, errors) goes through [`Reader::u32`].
    pub(crate) fn u32_items(
        &mut self,
        len: usize,
        field: &'static str,
        out: &mut Vec<u32>,
    ) -> Result<(), WireError> {
        // Sized up front (the caller bounded `len` by the remaining input) so the loop stores
        // without per-element capacity checks.
        let start = out.len();
        out.resize(start + len, 0);
        let mut rest = self.input.get(self.pos..).unwrap_or_default();
        for slot in out.iter_mut().skip(start) {
            *slot = match *rest {
                [b @ 0x00..=0x7f, ref tail @ ..] => {
                    rest = tail;
                    u32::from(b)
                }
                [0xcc, b, ref tail @ ..] => {
                    rest = tail;
                    u32::from(b)
                }
                [0xcd, b0, b1, ref tail @ ..] => {
                    rest = tail;
                    u32::from(u16::from_be_bytes([b0, b1]))
                }
                [0xce, b0, b1, b2, b3, ref tail @ ..] => {
                    rest = tail;
                    u32::from_be_bytes([b0, b1, b2, b3])
                }
                _ => {
                    self.pos = self.input.len() - rest.len();
                    let value = self.u32(field)?;
                    rest = self.input.get(self.pos..).unwrap_or_default();
                    value
                }
            };
        }
        self.pos = self.input.len() - rest.len();
        Ok(())
    }

    /// A `u32` or nil.
    pub(crate) fn opt_u32(&mut self, field: &'static str) -> Result<Option<u32>, WireError> {
        if self.nil()? {
            return Ok(None);
        }
        self.u32(field).map(Some)
    }

    /// An `i64` or nil.
    pub(crate) fn opt_i64(&mut self, field: &'static str) -> Result<Option<i64>, WireError> {
        if self.nil()? {
            return Ok(None);
        }
        let at = self.pos;
        self.int(field)?
            .to_i64()
            .map(Some)
            .ok_or(WireError::IntOutOfRange { field, offset: at })
    }

    /// A float (msgspec always writes float64; float32 and ints are accepted too).
    pub(crate) fn f64(&mut self, field: &'static str) -> Result<f64, WireError> {
        let at = self.pos;
        match self.peek() {
            Some(0xcb) => {
                self.pos += 1;
                Ok(f64::from_bits(self.be_u64()?))
            }
            Some(0xca) => {
                self.pos += 1;
                Ok(f64::from(f32::from_bits(self.be_u32()?)))
            }
            _ => match self.int_or_none()? {
                Some(Int::Unsigned(v)) => Ok(v as f64),
                Some(Int::Negative(v)) => Ok(v as f64),
                None => Err(self.type_error(field, "float", at)),
            },
        }
    }

    /// A generic value for `extra_keys`: nil, int, str, bin or (nested) array.
    pub(crate) fn hash_value(
        &mut self,
        field: &'static str,
        depth: usize,
    ) -> Result<kvroute_block_keys::HashValue, WireError> {
        use kvroute_block_keys::HashValue;
        let at = self.pos;
        if depth > super::MAX_NESTING_DEPTH {
            return Err(WireError::NestingTooDeep {
                limit: super::MAX_NESTING_DEPTH,
                offset: at,
            });
        }
        if self.nil()? {
            return Ok(HashValue::None);
        }
        if let Some(bytes) = self.str_bytes()? {
            let s = std::str::from_utf8(bytes)
                .map_err(|_| WireError::InvalidUtf8 { field, offset: at })?;
            return Ok(HashValue::Str(s.to_owned()));
        }
        if let Some(bytes) = self.bin_bytes()? {
            return Ok(HashValue::Bytes(bytes.to_vec()));
        }
        if let Some(int) = self.int_or_none()? {
            return int
                .to_i64()
                .map(HashValue::Int)
                .ok_or(WireError::IntOutOfRange { field, offset: at });
        }
        if self.peek_container() == Some(Container::Array) {
            let len = self.array_len(field)?;
            let mut items = Vec::with_capacity(len);
            for _ in 0..len {
                items.push(self.hash_value(field, depth + 1)?);
            }
            return Ok(HashValue::Tuple(items));
        }
        Err(self.type_error(field, "nil, int, str, bin or array", at))
    }

    /// Skips one value of any type, `depth` levels below the top.
    pub(crate) fn skip(&mut self, depth: usize) -> Result<(), WireError> {
        let at = self.pos;
        if depth > super::MAX_NESTING_DEPTH {
            return Err(WireError::NestingTooDeep {
                limit: super::MAX_NESTING_DEPTH,
                offset: at,
            });
        }
        let marker = Marker::from_u8(self.byte()?);
        let data_len: usize = match marker {
            Marker::FixPos(_) | Marker::FixNeg(_) | Marker::Null | Marker::True | Marker::False => {
                0
            }
            Marker::U8 | Marker::I8 => 1,
            Marker::U16 | Marker::I16 => 2,
            Marker::U32 | Marker::I32 | Marker::F32 => 4,
            Marker::U64 | Marker::I64 | Marker::F64 => 8,
            Marker::FixStr(len) => usize::from(len),
            Marker::Str8 | Marker::Bin8 => usize::from(self.byte()?),
            Marker::Str16 | Marker::Bin16 => usize::from(self.be_u16()?),
            Marker::Str32 | Marker::Bin32 => self.be_u32()? as usize,
            Marker::FixExt1 => 2,
            Marker::FixExt2 => 3,
            Marker::FixExt4 => 5,
            Marker::FixExt8 => 9,
            Marker::FixExt16 => 17,
            Marker::Ext8 => usize::from(self.byte()?) + 1,
            Marker::Ext16 => usize::from(self.be_u16()?) + 1,
            Marker::Ext32 => (self.be_u32()? as usize).saturating_add(1),
            Marker::FixArray(_) | Marker::Array16 | Marker::Array32 => {
                self.rewind(at);
                let len = self.array_len("skipped value")?;
                for _ in 0..len {
                    self.skip(depth + 1)?;
                }
                return Ok(());
            }
            Marker::FixMap(_) | Marker::Map16 | Marker::Map32 => {
                self.rewind(at);
                let len = self.map_len("skipped value")?;
                for _ in 0..len * 2 {
                    self.skip(depth + 1)?;
                }
                return Ok(());
            }
            Marker::Reserved => return Err(self.type_error("skipped value", "msgpack value", at)),
        };
        self.take(data_len).map(|_| ())
    }

    /// Fails unless the whole input has been read.
    pub(crate) fn finish(&self) -> Result<(), WireError> {
        match self.remaining() {
            0 => Ok(()),
            extra => Err(WireError::TrailingBytes {
                offset: self.pos,
                extra,
            }),
        }
    }
}

/// A block hash as found on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Hash<'a> {
    /// `uint`/`int` form (already reduced to u64).
    Int(u64),
    /// Raw digest (`bin`, or `str` from third-party producers).
    Digest(&'a [u8]),
}

impl Hash<'_> {
    /// vLLM's u64 form: the last 8 bytes big-endian, zero-padded on the left when shorter.
    pub(crate) fn to_u64(self) -> u64 {
        match self {
            Hash::Int(v) => v,
            Hash::Digest(bytes) => {
                let tail = &bytes[bytes.len().saturating_sub(8)..];
                let mut buf = [0u8; 8];
                buf[8 - tail.len()..].copy_from_slice(tail);
                u64::from_be_bytes(buf)
            }
        }
    }
}

/// Container kinds the event decoder dispatches on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Container {
    Array,
    Map,
}

/// Human name of a msgpack type, for errors.
fn marker_name(marker: Marker) -> &'static str {
    match marker {
        Marker::FixPos(_)
        | Marker::FixNeg(_)
        | Marker::U8
        | Marker::U16
        | Marker::U32
        | Marker::U64
        | Marker::I8
        | Marker::I16
        | Marker::I32
        | Marker::I64 => "int",
        Marker::Null => "nil",
        Marker::True | Marker::False => "bool",
        Marker::F32 | Marker::F64 => "float",
        Marker::FixStr(_) | Marker::Str8 | Marker::Str16 | Marker::Str32 => "str",
        Marker::Bin8 | Marker::Bin16 | Marker::Bin32 => "bin",
        Marker::FixArray(_) | Marker::Array16 | Marker::Array32 => "array",
        Marker::FixMap(_) | Marker::Map16 | Marker::Map32 => "map",
        Marker::FixExt1
        | Marker::FixExt2
        | Marker::FixExt4
        | Marker::FixExt8
        | Marker::FixExt16
        | Marker::Ext8
        | Marker::Ext16
        | Marker::Ext32 => "ext",
        Marker::Reserved => "reserved marker",
    }
}
