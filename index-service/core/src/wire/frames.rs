//! ZMQ framing: live 3-frame messages and the DEALER side of vLLM's replay protocol (spec §1.2, §1.4).

use super::{DecodedBatch, WireError, decode_engine_batch};
use crate::event::Engine;

/// Sequence value vLLM sends in a replay end marker (`(-1).to_bytes(8, "big", signed=True)`).
const END_MARKER_SEQ: [u8; 8] = [0xff; 8];

/// One reply message of a replay, as a DEALER receives it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplayItem<'a> {
    /// A buffered batch: its sequence number and undecoded payload (pass it to [`decode_engine_batch`]).
    Batch {
        /// The batch's sequence number.
        seq: u64,
        /// msgpack `KVEventBatch`.
        payload: &'a [u8],
    },
    /// The end marker: every buffered batch from the requested sequence on has been sent.
    End,
}

/// Decodes a vLLM live message `[topic, seq (8 bytes big-endian), payload]`.
///
/// Returns the topic (free text; llm-d uses `kv@<pod>@<model>`), the sequence number and the batch.
pub fn decode_message<F: AsRef<[u8]>>(
    frames: &[F],
) -> Result<(&str, u64, DecodedBatch), WireError> {
    decode_engine_message(Engine::Vllm, frames)
}

/// Decodes a live message of an engine of the family `engine` (SGLang frames its messages as
/// vLLM does).
pub fn decode_engine_message<F: AsRef<[u8]>>(
    engine: Engine,
    frames: &[F],
) -> Result<(&str, u64, DecodedBatch), WireError> {
    let [topic, seq, payload] = frames else {
        return Err(WireError::FrameCount {
            message: "live",
            count: frames.len(),
            expected: "3",
        });
    };
    let topic = std::str::from_utf8(topic.as_ref()).map_err(|_| WireError::BadFrame {
        frame: "topic",
        reason: "not UTF-8",
    })?;
    let seq = u64::from_be_bytes(seq_bytes(seq.as_ref())?);
    Ok((topic, seq, decode_engine_batch(engine, payload.as_ref())?))
}

/// Parses one replay reply message as received on a DEALER socket.
///
/// Accepts both layouts: `[b"", seq, payload]` (vLLM 0.9–0.25, SGLang up to 0.5.21) and
/// `[b"", topic, seq, payload]` (vLLM 0.26+, SGLang 0.5.22+), and their end markers (empty last
/// frame, seq all `0xff`: with an empty topic, as SGLang's default, a reply and the end marker
/// differ only there). The leading empty delimiter frame may already have been stripped.
pub fn parse_replay_frames<F: AsRef<[u8]>>(frames: &[F]) -> Result<ReplayItem<'_>, WireError> {
    let frames = match frames {
        [delimiter, rest @ ..] if rest.len() == 3 => {
            if !delimiter.as_ref().is_empty() {
                return Err(WireError::BadFrame {
                    frame: "delimiter",
                    reason: "first of 4 replay frames is not empty",
                });
            }
            rest
        }
        // Old layout with its delimiter, or the new one with an empty topic and no delimiter:
        // either way the empty first frame carries nothing.
        [delimiter, rest @ ..] if rest.len() == 2 && delimiter.as_ref().is_empty() => rest,
        other => other,
    };
    let (seq, payload) = match frames {
        [seq, payload] | [_, seq, payload] => (seq.as_ref(), payload.as_ref()),
        _ => {
            return Err(WireError::FrameCount {
                message: "replay",
                count: frames.len(),
                expected: "2 to 4",
            });
        }
    };
    let seq = seq_bytes(seq)?;
    if payload.is_empty() || seq == END_MARKER_SEQ {
        return Ok(ReplayItem::End);
    }
    Ok(ReplayItem::Batch {
        seq: u64::from_be_bytes(seq),
        payload,
    })
}

/// The replay request a DEALER sends: `[b"", start_seq (8 bytes big-endian)]`.
pub fn replay_request(start_seq: u64) -> [Vec<u8>; 2] {
    [Vec::new(), start_seq.to_be_bytes().to_vec()]
}

fn seq_bytes(frame: &[u8]) -> Result<[u8; 8], WireError> {
    frame.try_into().map_err(|_| WireError::BadFrame {
        frame: "seq",
        reason: "not 8 bytes",
    })
}
