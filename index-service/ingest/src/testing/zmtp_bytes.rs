//! ZMTP 3.0 bytes written out by hand, for peers that must not share kvroute's codec: hostile
//! peers in tests, fuzz seeds, the transport bench's publisher.

/// A ZMTP 3.0 greeting with the NULL mechanism.
pub fn greeting() -> Vec<u8> {
    let mut greeting = vec![0u8; 64];
    greeting[0] = 0xff;
    greeting[9] = 0x7f;
    greeting[10] = 3;
    greeting[12..16].copy_from_slice(b"NULL");
    greeting
}

/// A READY command frame announcing `socket_type` (`PUB`, `ROUTER`, ...).
pub fn ready(socket_type: &str) -> Vec<u8> {
    let mut body = vec![5];
    body.extend_from_slice(b"READY");
    body.push(11);
    body.extend_from_slice(b"Socket-Type");
    body.extend_from_slice(&(socket_type.len() as u32).to_be_bytes());
    body.extend_from_slice(socket_type.as_bytes());
    let mut frame = Vec::new();
    push_frame(&mut frame, &body, 0x04);
    frame
}

/// Appends one frame with `flags` (0x01 more, 0x04 command); the size form follows the body.
pub fn push_frame(out: &mut Vec<u8>, body: &[u8], flags: u8) {
    match u8::try_from(body.len()) {
        Ok(len) => out.extend([flags, len]),
        Err(_) => {
            out.push(flags | 0x02);
            out.extend((body.len() as u64).to_be_bytes());
        }
    }
    out.extend_from_slice(body);
}

/// A message's frames, MORE set on all but the last.
pub fn message(frames: &[&[u8]]) -> Vec<u8> {
    let mut out = Vec::new();
    for (i, frame) in frames.iter().enumerate() {
        push_frame(&mut out, frame, u8::from(i + 1 < frames.len()));
    }
    out
}

/// What a peer of `socket_type` sends: greeting, READY, then one message.
pub fn peer_stream(socket_type: &str, frames: &[&[u8]]) -> Vec<u8> {
    let mut out = greeting();
    out.extend(ready(socket_type));
    out.extend(message(frames));
    out
}
