//! ZMTP 3.0 on bytes, no I/O: the greeting, frames, and the handshake commands (RFC 23/ZMTP).
//!
//! Everything a peer sends is length-checked before anything is allocated for it: a frame header
//! declaring more than the caller's limit is an error as soon as its 9 header bytes are in, never
//! a reservation of the declared size.

use bytes::{Buf as _, Bytes, BytesMut};

use super::{MAX_COMMAND_BYTES, ProtocolError};

/// Greeting length: signature (10), version (2), mechanism (20), as-server (1), filler (31).
pub const GREETING_LEN: usize = 64;

/// Frame flag: more frames of this message follow.
const FLAG_MORE: u8 = 0x01;
/// Frame flag: the size is 8 bytes (else 1).
const FLAG_LONG: u8 = 0x02;
/// Frame flag: a command, not a message frame.
const FLAG_COMMAND: u8 = 0x04;

/// The only security mechanism kvroute speaks (vLLM's publisher sets none).
const MECHANISM_NULL: &[u8] = b"NULL";

/// The socket types kvroute's side of a connection can be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SocketType {
    /// Subscribes to an engine's PUB.
    Sub,
    /// Asks an engine's replay ROUTER.
    Dealer,
}

impl SocketType {
    /// The `Socket-Type` property value.
    pub fn name(self) -> &'static str {
        match self {
            SocketType::Sub => "SUB",
            SocketType::Dealer => "DEALER",
        }
    }

    /// Whether a peer of type `peer` may talk to this socket (RFC 23's compatibility table).
    pub fn accepts(self, peer: &[u8]) -> bool {
        let allowed: &[&[u8]] = match self {
            SocketType::Sub => &[b"PUB", b"XPUB"],
            SocketType::Dealer => &[b"ROUTER", b"DEALER", b"REP"],
        };
        allowed.iter().any(|name| name.eq_ignore_ascii_case(peer))
    }
}

/// Our greeting: ZMTP 3.0, NULL mechanism, client role.
///
/// 3.0 rather than 3.1: a 3.1 peer (libzmq 4.2+) downgrades to the lower version, and 3.0 takes
/// subscriptions as messages (`0x01` + topic), which every ZMTP 3 PUB understands.
pub fn greeting() -> [u8; GREETING_LEN] {
    let mut greeting = [0u8; GREETING_LEN];
    greeting[0] = 0xff;
    greeting[9] = 0x7f;
    greeting[10] = 3;
    greeting[11] = 0;
    greeting[12..12 + MECHANISM_NULL.len()].copy_from_slice(MECHANISM_NULL);
    greeting
}

/// Checks a peer's greeting: a ZMTP 3.x signature and the NULL mechanism.
pub fn check_greeting(greeting: &[u8; GREETING_LEN]) -> Result<(), ProtocolError> {
    if greeting[0] != 0xff || greeting[9] & 0x01 == 0 {
        return Err(ProtocolError::Handshake("not a ZMTP signature"));
    }
    if greeting[10] < 3 {
        return Err(ProtocolError::Handshake("ZMTP version below 3.0"));
    }
    let mechanism = &greeting[12..32];
    let name_len = mechanism
        .iter()
        .position(|&b| b == 0)
        .unwrap_or(mechanism.len());
    if &mechanism[..name_len] != MECHANISM_NULL {
        return Err(ProtocolError::Handshake(
            "security mechanism is not NULL (CURVE and PLAIN are not supported)",
        ));
    }
    Ok(())
}

/// One decoded frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frame {
    /// A message frame; `more` when the message goes on.
    Message {
        /// Frame body.
        body: Bytes,
        /// More frames of the same message follow.
        more: bool,
    },
    /// A command (READY, ERROR, PING, ...), body as sent.
    Command(Bytes),
}

/// Decodes frames from a read buffer, refusing any frame larger than a caller's limit.
#[derive(Debug, Clone, Copy, Default)]
pub struct FrameDecoder;

impl FrameDecoder {
    /// Takes the next whole frame off the front of `buf`, `Ok(None)` if more bytes are needed.
    ///
    /// `limit` bounds a message frame's body, [`MAX_COMMAND_BYTES`] a command's: a header
    /// declaring more is [`ProtocolError::Oversized`] before its body is read, so memory never
    /// follows what a peer declares.
    pub fn decode(&self, buf: &mut BytesMut, limit: usize) -> Result<Option<Frame>, ProtocolError> {
        let Some(&flags) = buf.first() else {
            return Ok(None);
        };
        if flags & !(FLAG_MORE | FLAG_LONG | FLAG_COMMAND) != 0 {
            return Err(ProtocolError::MalformedFrame("reserved flag bits set"));
        }
        if flags & FLAG_COMMAND != 0 && flags & FLAG_MORE != 0 {
            return Err(ProtocolError::MalformedFrame("command frame with MORE set"));
        }
        let (header_len, declared) = if flags & FLAG_LONG != 0 {
            let Some(size) = buf.get(1..9) else {
                return Ok(None);
            };
            let mut size_bytes = [0u8; 8];
            size_bytes.copy_from_slice(size);
            (9, u64::from_be_bytes(size_bytes))
        } else {
            let Some(&size) = buf.get(1) else {
                return Ok(None);
            };
            (2, u64::from(size))
        };
        let limit = if flags & FLAG_COMMAND != 0 {
            limit.min(MAX_COMMAND_BYTES)
        } else {
            limit
        };
        let size = usize::try_from(declared)
            .ok()
            .filter(|&size| size <= limit)
            .ok_or(ProtocolError::Oversized { declared, limit })?;
        // `buf.len() >= header_len` here, and the subtraction cannot overflow like an addition.
        if buf.len() - header_len < size {
            return Ok(None);
        }
        buf.advance(header_len);
        let body = buf.split_to(size).freeze();
        Ok(Some(if flags & FLAG_COMMAND != 0 {
            Frame::Command(body)
        } else {
            Frame::Message {
                body,
                more: flags & FLAG_MORE != 0,
            }
        }))
    }
}

/// Appends one frame to `out`.
pub fn encode_frame(out: &mut Vec<u8>, body: &[u8], more: bool, command: bool) {
    let mut flags = 0;
    if more {
        flags |= FLAG_MORE;
    }
    if command {
        flags |= FLAG_COMMAND;
    }
    match u8::try_from(body.len()) {
        Ok(size) => {
            out.push(flags);
            out.push(size);
        }
        Err(_) => {
            out.push(flags | FLAG_LONG);
            out.extend_from_slice(&(body.len() as u64).to_be_bytes());
        }
    }
    out.extend_from_slice(body);
}

/// Appends a multi-frame message to `out`.
pub fn encode_message<F: AsRef<[u8]>>(out: &mut Vec<u8>, frames: &[F]) {
    for (i, frame) in frames.iter().enumerate() {
        encode_frame(out, frame.as_ref(), i + 1 < frames.len(), false);
    }
}

/// The READY command announcing our socket type.
pub fn ready_command(socket_type: SocketType) -> Vec<u8> {
    let mut body = Vec::with_capacity(32);
    push_short_string(&mut body, b"READY");
    push_short_string(&mut body, b"Socket-Type");
    let value = socket_type.name().as_bytes();
    body.extend_from_slice(&(value.len() as u32).to_be_bytes());
    body.extend_from_slice(value);
    body
}

fn push_short_string(out: &mut Vec<u8>, s: &[u8]) {
    // Only called with our own short constants.
    out.push(s.len() as u8);
    out.extend_from_slice(s);
}

/// A command's name and data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Command<'a> {
    /// Command name (`READY`, `ERROR`, `PING`, `SUBSCRIBE`, ...).
    pub name: &'a [u8],
    /// What follows the name.
    pub data: &'a [u8],
}

/// Splits a command body into name and data.
pub fn parse_command(body: &[u8]) -> Result<Command<'_>, ProtocolError> {
    let (&name_len, rest) = body
        .split_first()
        .ok_or(ProtocolError::MalformedFrame("empty command"))?;
    let name_len = usize::from(name_len);
    if rest.len() < name_len {
        return Err(ProtocolError::MalformedFrame(
            "command name runs past the frame",
        ));
    }
    let (name, data) = rest.split_at(name_len);
    Ok(Command { name, data })
}

/// The value of property `wanted` (case-insensitive) in a READY command's data, if present.
pub fn ready_property<'a>(
    data: &'a [u8],
    wanted: &[u8],
) -> Result<Option<&'a [u8]>, ProtocolError> {
    let mut rest = data;
    while let Some((&name_len, tail)) = rest.split_first() {
        let name_len = usize::from(name_len);
        let (name, tail) = tail
            .split_at_checked(name_len)
            .ok_or(ProtocolError::MalformedFrame(
                "READY property name runs past the frame",
            ))?;
        let (value_len, tail) =
            tail.split_first_chunk::<4>()
                .ok_or(ProtocolError::MalformedFrame(
                    "READY property without a value length",
                ))?;
        let value_len = usize::try_from(u32::from_be_bytes(*value_len))
            .map_err(|_| ProtocolError::MalformedFrame("READY property value too long"))?;
        let (value, tail) =
            tail.split_at_checked(value_len)
                .ok_or(ProtocolError::MalformedFrame(
                    "READY property value runs past the frame",
                ))?;
        if name.eq_ignore_ascii_case(wanted) {
            return Ok(Some(value));
        }
        rest = tail;
    }
    Ok(None)
}

/// The reason carried by an ERROR command's data (lossy, for logs).
pub fn error_reason(data: &[u8]) -> String {
    let reason = data
        .split_first()
        .and_then(|(&len, rest)| rest.get(..usize::from(len)))
        .unwrap_or_default();
    String::from_utf8_lossy(reason).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decode_all(bytes: &[u8], limit: usize) -> Result<Vec<Frame>, ProtocolError> {
        let mut buf = BytesMut::from(bytes);
        let mut frames = Vec::new();
        while let Some(frame) = FrameDecoder.decode(&mut buf, limit)? {
            frames.push(frame);
        }
        Ok(frames)
    }

    #[test]
    fn frames_round_trip_short_and_long() {
        let long = vec![7u8; 300];
        let mut bytes = Vec::new();
        encode_message(&mut bytes, &[b"topic".as_slice(), &long, b""]);
        encode_frame(&mut bytes, b"\x04PING", false, true);
        let frames = decode_all(&bytes, 1024).unwrap();
        assert_eq!(
            frames,
            vec![
                Frame::Message {
                    body: Bytes::from_static(b"topic"),
                    more: true
                },
                Frame::Message {
                    body: Bytes::from(long),
                    more: true
                },
                Frame::Message {
                    body: Bytes::new(),
                    more: false
                },
                Frame::Command(Bytes::from_static(b"\x04PING")),
            ]
        );
    }

    #[test]
    fn a_huge_declared_frame_is_refused_from_its_header_alone() {
        // The probe that aborted the index: a long command frame declaring 2^40 bytes.
        let header = [0x06, 0, 0, 0x01, 0, 0, 0, 0, 0];
        let mut buf = BytesMut::from(header.as_slice());
        let capacity_before = buf.capacity();
        assert_eq!(
            FrameDecoder.decode(&mut buf, 16 << 20),
            Err(ProtocolError::Oversized {
                declared: 1 << 40,
                limit: MAX_COMMAND_BYTES
            })
        );
        assert_eq!(buf.capacity(), capacity_before, "nothing reserved");
        let mut buf = BytesMut::from([0x02, 0, 0, 0, 0x01, 0, 0, 0, 0].as_slice());
        assert_eq!(
            FrameDecoder.decode(&mut buf, 16 << 20),
            Err(ProtocolError::Oversized {
                declared: 1 << 32,
                limit: 16 << 20
            })
        );
        // u64::MAX does not overflow anything either.
        let mut buf =
            BytesMut::from([0x02, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff].as_slice());
        assert_eq!(FrameDecoder.decode(&mut buf, usize::MAX), Ok(None));
    }

    #[test]
    fn partial_frames_wait_for_more_bytes() {
        let mut bytes = Vec::new();
        encode_frame(&mut bytes, &[1u8; 400], false, false);
        for cut in 0..bytes.len() {
            let mut buf = BytesMut::from(&bytes[..cut]);
            assert_eq!(
                FrameDecoder.decode(&mut buf, 1024),
                Ok(None),
                "cut at {cut}"
            );
            assert_eq!(buf.len(), cut, "nothing consumed");
        }
    }

    #[test]
    fn malformed_flags_are_refused() {
        assert!(matches!(
            decode_all(&[0x08, 0], 10),
            Err(ProtocolError::MalformedFrame(_))
        ));
        assert!(matches!(
            decode_all(&[0x05, 0], 10),
            Err(ProtocolError::MalformedFrame(_))
        ));
    }

    proptest::proptest! {
        /// Any bytes, fed in any chunking: the decoder never panics, never hands out a frame
        /// over the limit, and never holds more than what arrived.
        #[test]
        fn arbitrary_bytes_never_exceed_the_limit(
            bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..2048),
            chunk in 1usize..64,
            limit in 0usize..512,
        ) {
            let mut buf = BytesMut::new();
            'feed: for piece in bytes.chunks(chunk) {
                buf.extend_from_slice(piece);
                loop {
                    match FrameDecoder.decode(&mut buf, limit) {
                        Ok(Some(Frame::Message { body, .. })) => proptest::prop_assert!(body.len() <= limit),
                        Ok(Some(Frame::Command(body))) => {
                            proptest::prop_assert!(body.len() <= limit.min(MAX_COMMAND_BYTES));
                        }
                        Ok(None) => break,
                        Err(_) => break 'feed,
                    }
                }
                proptest::prop_assert!(buf.len() <= bytes.len());
            }
        }
    }

    #[test]
    fn greeting_checks() {
        let ours = greeting();
        assert_eq!(check_greeting(&ours), Ok(()));
        let mut curve = ours;
        curve[12..17].copy_from_slice(b"CURVE");
        assert!(check_greeting(&curve).is_err());
        let mut old = ours;
        old[10] = 2;
        assert!(check_greeting(&old).is_err());
        let mut garbage = ours;
        garbage[0] = 0x41;
        assert!(check_greeting(&garbage).is_err());
    }

    #[test]
    fn ready_properties_are_parsed_with_bounds() {
        let ready = ready_command(SocketType::Dealer);
        let command = parse_command(&ready).unwrap();
        assert_eq!(command.name, b"READY");
        assert_eq!(
            ready_property(command.data, b"socket-type").unwrap(),
            Some(b"DEALER".as_slice())
        );
        // A value length past the end of the frame.
        let mut bad = vec![11];
        bad.extend_from_slice(b"Socket-Type");
        bad.extend_from_slice(&u32::MAX.to_be_bytes());
        assert!(ready_property(&bad, b"Socket-Type").is_err());
        assert!(parse_command(&[9, b'R']).is_err());
        assert!(SocketType::Sub.accepts(b"PUB"));
        assert!(!SocketType::Sub.accepts(b"SUB"));
        assert!(SocketType::Dealer.accepts(b"ROUTER"));
    }
}
