//! W3C Trace Context (`traceparent`, `tracestate`): the one parser and printer every kvroute
//! binary uses to continue a caller's trace and to pass its own on.
//!
//! A malformed `traceparent` is ignored (the request is served as an untraced one); the first
//! one a process sees is logged as a warning, later ones at debug.

use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};

/// The W3C header (and gRPC metadata key) carrying the parent span.
pub const TRACEPARENT: &str = "traceparent";
/// The W3C header carrying vendor trace state, passed on unchanged.
pub const TRACESTATE: &str = "tracestate";

/// Longest `tracestate` kept (the W3C limit is 32 members; 512 bytes is what a vendor may rely on
/// being propagated). A longer one is dropped, not cut.
const MAX_TRACESTATE_BYTES: usize = 512;

/// A parsed `traceparent`: the caller's trace, the span the request came from, its flags.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceParent {
    /// 16 bytes, never all zero.
    pub trace_id: [u8; 16],
    /// The parent span's 8 bytes, never all zero.
    pub span_id: [u8; 8],
    /// Trace flags; bit 0 is `sampled`.
    pub flags: u8,
}

/// Why a `traceparent` was ignored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum MalformedTraceParent {
    /// Not `version-traceid-parentid-flags` in lowercase hex of the right lengths.
    #[error("not version-traceid-parentid-flags in lowercase hex")]
    Shape,
    /// Version `ff`, or version `00` with more after the flags.
    #[error("invalid version")]
    Version,
    /// An all-zero trace or parent id.
    #[error("all-zero trace or parent id")]
    ZeroId,
}

impl MalformedTraceParent {
    /// Label for logs.
    pub fn as_label(self) -> &'static str {
        match self {
            Self::Shape => "shape",
            Self::Version => "version",
            Self::ZeroId => "zero_id",
        }
    }
}

impl TraceParent {
    /// Parses a `traceparent` value as W3C Trace Context level 1 reads it: a later version may
    /// carry more fields after the flags, which are ignored.
    pub fn parse(value: &str) -> Result<Self, MalformedTraceParent> {
        let value = value.trim_matches([' ', '\t']);
        let bytes = value.as_bytes();
        if bytes.len() < 55
            || bytes[2] != b'-'
            || bytes[35] != b'-'
            || bytes[52] != b'-'
            || (bytes.len() > 55 && bytes[55] != b'-')
        {
            return Err(MalformedTraceParent::Shape);
        }
        let version = hex_byte(&bytes[0..2]).ok_or(MalformedTraceParent::Shape)?;
        if version == 0xff || (version == 0 && bytes.len() != 55) {
            return Err(MalformedTraceParent::Version);
        }
        let mut trace_id = [0u8; 16];
        let mut span_id = [0u8; 8];
        hex_into(&bytes[3..35], &mut trace_id).ok_or(MalformedTraceParent::Shape)?;
        hex_into(&bytes[36..52], &mut span_id).ok_or(MalformedTraceParent::Shape)?;
        let flags = hex_byte(&bytes[53..55]).ok_or(MalformedTraceParent::Shape)?;
        if trace_id == [0; 16] || span_id == [0; 8] {
            return Err(MalformedTraceParent::ZeroId);
        }
        Ok(Self {
            trace_id,
            span_id,
            flags,
        })
    }

    /// Whether the caller sampled the trace (flag bit 0).
    pub fn sampled(&self) -> bool {
        self.flags & 1 == 1
    }

    /// The trace id as 32 lowercase hex digits.
    pub fn trace_id_hex(&self) -> String {
        hex(&self.trace_id)
    }
}

/// `00-<trace id>-<span id>-<flags>`, the version-0 form.
impl fmt::Display for TraceParent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "00-{}-{}-{:02x}",
            hex(&self.trace_id),
            hex(&self.span_id),
            self.flags
        )
    }
}

/// A caller's trace context: its `traceparent` and the `tracestate` that came with it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemoteContext {
    /// The caller's span.
    pub parent: TraceParent,
    /// Vendor state, passed on unchanged (`None` when absent, empty or over 512 bytes).
    pub state: Option<String>,
}

impl RemoteContext {
    /// The context carried by a `traceparent` value and its `tracestate`; `None` when
    /// `traceparent` is malformed (logged once per process as a warning, then at debug).
    pub fn from_values(traceparent: &str, tracestate: Option<&str>, source: &str) -> Option<Self> {
        match TraceParent::parse(traceparent) {
            Ok(parent) => Some(Self {
                parent,
                state: tracestate
                    .map(str::trim)
                    .filter(|s| !s.is_empty() && s.len() <= MAX_TRACESTATE_BYTES)
                    .map(str::to_owned),
            }),
            Err(error) => {
                log_malformed(error, source);
                None
            }
        }
    }

    /// The trace context of a request that may carry it twice: as HTTP headers (`header`:
    /// `traceparent` and `tracestate`) and as the gRPC metadata of the stream it came on
    /// (`metadata`, where Envoy puts the context of its own span). The header wins; a malformed
    /// one is ignored, and then the metadata's is used.
    pub fn from_header_or_metadata(
        header: Option<(&str, Option<&str>)>,
        metadata: Option<(&str, Option<&str>)>,
    ) -> Option<Self> {
        header
            .and_then(|(parent, state)| Self::from_values(parent, state, "header"))
            .or_else(|| {
                metadata.and_then(|(parent, state)| Self::from_values(parent, state, "metadata"))
            })
    }

    /// The context in a tonic request's metadata (`traceparent`, `tracestate`), if any and well
    /// formed.
    pub fn from_metadata(metadata: &tonic::metadata::MetadataMap) -> Option<Self> {
        let parent = metadata.get(TRACEPARENT)?.to_str().ok()?;
        let state = metadata
            .get(TRACESTATE)
            .and_then(|value| value.to_str().ok());
        Self::from_values(parent, state, "metadata")
    }
}

/// Whether a malformed `traceparent` was logged as a warning already.
static MALFORMED_WARNED: AtomicBool = AtomicBool::new(false);

fn log_malformed(error: MalformedTraceParent, source: &str) {
    if MALFORMED_WARNED.swap(true, Ordering::Relaxed) {
        tracing::debug!(
            reason = error.as_label(),
            source,
            "malformed traceparent ignored"
        );
    } else {
        tracing::warn!(
            reason = error.as_label(),
            source,
            "malformed traceparent ignored (logged once; later ones at debug)"
        );
    }
}

/// Lowercase hex of `bytes`.
pub fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut out = String::with_capacity(bytes.len() * 2);
    for byte in bytes {
        out.push(char::from(DIGITS[usize::from(byte >> 4)]));
        out.push(char::from(DIGITS[usize::from(byte & 0xf)]));
    }
    out
}

/// A lowercase hex digit's value (W3C: uppercase is invalid).
fn hex_digit(digit: u8) -> Option<u8> {
    match digit {
        b'0'..=b'9' => Some(digit - b'0'),
        b'a'..=b'f' => Some(digit - b'a' + 10),
        _ => None,
    }
}

fn hex_byte(pair: &[u8]) -> Option<u8> {
    Some(hex_digit(pair[0])? << 4 | hex_digit(pair[1])?)
}

fn hex_into(digits: &[u8], out: &mut [u8]) -> Option<()> {
    for (byte, pair) in out.iter_mut().zip(digits.chunks_exact(2)) {
        *byte = hex_byte(pair)?;
    }
    Some(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const VALID: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";

    #[test]
    fn a_valid_traceparent_round_trips() {
        let parent = TraceParent::parse(VALID).unwrap();
        assert_eq!(parent.trace_id_hex(), "0af7651916cd43dd8448eb211c80319c");
        assert_eq!(hex(&parent.span_id), "b7ad6b7169203331");
        assert!(parent.sampled());
        assert_eq!(parent.to_string(), VALID);
    }

    #[test]
    fn a_later_version_may_carry_more_fields() {
        let value = "01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00-what-comes";
        let parent = TraceParent::parse(value).unwrap();
        assert!(!parent.sampled());
        assert_eq!(parent.to_string(), VALID.replace("-01", "-00"));
    }

    #[test]
    fn malformed_traceparents_are_refused_by_reason() {
        let cases = [
            ("", MalformedTraceParent::Shape),
            ("garbage", MalformedTraceParent::Shape),
            (
                "00-0AF7651916CD43DD8448EB211C80319C-b7ad6b7169203331-01",
                MalformedTraceParent::Shape,
            ),
            (
                "00-0af7651916cd43dd8448eb211c80319c-b7ad6b716920333-01",
                MalformedTraceParent::Shape,
            ),
            (
                "00_0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
                MalformedTraceParent::Shape,
            ),
            (
                "ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
                MalformedTraceParent::Version,
            ),
            (
                "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-extra",
                MalformedTraceParent::Version,
            ),
            (
                "00-00000000000000000000000000000000-b7ad6b7169203331-01",
                MalformedTraceParent::ZeroId,
            ),
            (
                "00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01",
                MalformedTraceParent::ZeroId,
            ),
            // Multi-byte UTF-8 where hex should be: refused, never a panic on a char boundary.
            (
                "00-0af7651916cd43dd8448eb211c8031é-b7ad6b7169203331-01",
                MalformedTraceParent::Shape,
            ),
        ];
        for (value, reason) in cases {
            assert_eq!(TraceParent::parse(value), Err(reason), "{value:?}");
        }
    }

    #[test]
    fn the_header_wins_over_the_stream_metadata() {
        let from_envoy = "00-11111111111111111111111111111111-2222222222222222-01";
        let context = RemoteContext::from_header_or_metadata(
            Some((VALID, Some("vendor=1"))),
            Some((from_envoy, None)),
        )
        .unwrap();
        assert_eq!(context.parent, TraceParent::parse(VALID).unwrap());
        assert_eq!(context.state.as_deref(), Some("vendor=1"));

        let context =
            RemoteContext::from_header_or_metadata(None, Some((from_envoy, Some("")))).unwrap();
        assert_eq!(context.parent, TraceParent::parse(from_envoy).unwrap());
        assert_eq!(context.state, None, "an empty tracestate is none");
    }

    #[test]
    fn a_malformed_header_falls_back_to_the_metadata_and_nothing_is_none() {
        let from_envoy = "00-11111111111111111111111111111111-2222222222222222-01";
        let context = RemoteContext::from_header_or_metadata(
            Some(("00-nonsense", None)),
            Some((from_envoy, None)),
        )
        .unwrap();
        assert_eq!(context.parent, TraceParent::parse(from_envoy).unwrap());
        assert_eq!(
            RemoteContext::from_header_or_metadata(Some(("00-nonsense", None)), None),
            None
        );
        assert_eq!(RemoteContext::from_header_or_metadata(None, None), None);
    }

    #[test]
    fn the_context_is_read_from_grpc_metadata() {
        let mut metadata = tonic::metadata::MetadataMap::new();
        assert_eq!(RemoteContext::from_metadata(&metadata), None);
        metadata.insert(TRACEPARENT, VALID.parse().unwrap());
        metadata.insert(TRACESTATE, "a=b".parse().unwrap());
        let context = RemoteContext::from_metadata(&metadata).unwrap();
        assert_eq!(context.parent.to_string(), VALID);
        assert_eq!(context.state.as_deref(), Some("a=b"));
    }

    #[test]
    fn an_oversized_tracestate_is_dropped() {
        let state = "a=".to_owned() + &"b".repeat(MAX_TRACESTATE_BYTES);
        let context = RemoteContext::from_values(VALID, Some(&state), "header").unwrap();
        assert_eq!(context.state, None);
    }
}
