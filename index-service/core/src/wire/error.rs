//! Why a vLLM KV-event message could not be decoded.

/// A malformed ZMQ message or msgpack payload.
///
/// Offsets are byte positions in the payload, so a captured payload can be inspected at the
/// failing spot. [`WireError::as_label`] gives a fixed metric label per variant.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    /// The payload ends inside a value.
    #[error("payload truncated at byte {offset}: {needed} more bytes needed")]
    Truncated {
        /// Where the missing bytes should start.
        offset: usize,
        /// How many bytes the value still needed.
        needed: usize,
    },
    /// A value has a msgpack type the field cannot hold.
    #[error("{field} at byte {offset}: expected {expected}, found {found}")]
    UnexpectedType {
        /// Field (or structural position) being decoded.
        field: &'static str,
        /// What the field may hold.
        expected: &'static str,
        /// The msgpack type found.
        found: &'static str,
        /// Offset of the value's marker.
        offset: usize,
    },
    /// An integer does not fit the field (negative token id, rank beyond u32, ...).
    #[error("{field} at byte {offset}: integer out of range")]
    IntOutOfRange {
        /// Field being decoded.
        field: &'static str,
        /// Offset of the value's marker.
        offset: usize,
    },
    /// A msgpack `str` is not UTF-8.
    #[error("{field} at byte {offset}: string is not valid UTF-8")]
    InvalidUtf8 {
        /// Field being decoded.
        field: &'static str,
        /// Offset of the string's marker.
        offset: usize,
    },
    /// The batch, or one of its events, lacks a field that gives it meaning.
    #[error("{field} missing (or nil) in {context}")]
    MissingField {
        /// The missing field.
        field: &'static str,
        /// The batch or event kind it belongs to.
        context: &'static str,
    },
    /// A declared collection length exceeds a decoding limit.
    #[error("{what}: {declared} declared, limit {limit}")]
    LimitExceeded {
        /// Which limit (`events`, `token_ids`, `block_hashes`, ...).
        what: &'static str,
        /// Declared length.
        declared: u64,
        /// The limit in force.
        limit: u64,
    },
    /// Nested values (`extra_keys` tuples, skipped unknown fields) are nested too deeply.
    #[error("values nested deeper than {limit} levels at byte {offset}")]
    NestingTooDeep {
        /// The depth limit.
        limit: usize,
        /// Offset of the value that went over it.
        offset: usize,
    },
    /// Values that contradict each other (SGLang bigram pairs that do not chain).
    #[error("{field} at byte {offset}: {reason}")]
    Inconsistent {
        /// Field being decoded.
        field: &'static str,
        /// What does not fit.
        reason: &'static str,
        /// Offset of the offending value.
        offset: usize,
    },
    /// Bytes follow the end of the batch.
    #[error("{extra} trailing bytes after the batch at byte {offset}")]
    TrailingBytes {
        /// Where the batch ended.
        offset: usize,
        /// How many bytes follow it.
        extra: usize,
    },
    /// A ZMQ message has a frame count no known layout uses.
    #[error("{message}: {count} frames, expected {expected}")]
    FrameCount {
        /// Which kind of message (`live`, `replay`).
        message: &'static str,
        /// Frames received.
        count: usize,
        /// Accepted counts.
        expected: &'static str,
    },
    /// A frame has the wrong shape (sequence not 8 bytes, missing delimiter, non-UTF-8 topic).
    #[error("{frame} frame: {reason}")]
    BadFrame {
        /// Which frame (`seq`, `topic`, `delimiter`).
        frame: &'static str,
        /// What is wrong with it.
        reason: &'static str,
    },
}

impl WireError {
    /// Fixed metric label for this kind of failure.
    pub fn as_label(&self) -> &'static str {
        match self {
            WireError::Truncated { .. } => "truncated",
            WireError::UnexpectedType { .. } => "unexpected_type",
            WireError::IntOutOfRange { .. } => "int_out_of_range",
            WireError::InvalidUtf8 { .. } => "invalid_utf8",
            WireError::MissingField { .. } => "missing_field",
            WireError::LimitExceeded { .. } => "limit_exceeded",
            WireError::NestingTooDeep { .. } => "nesting_too_deep",
            WireError::Inconsistent { .. } => "inconsistent",
            WireError::TrailingBytes { .. } => "trailing_bytes",
            WireError::FrameCount { .. } => "frame_count",
            WireError::BadFrame { .. } => "bad_frame",
        }
    }
}
