//! Envoy-only prefill/decode disaggregation (`disaggregation.mode: envoy`): ext-proc sends a
//! split request's prefill leg to the prefill replica itself, then answers Envoy with the decode
//! replica and the request body carrying the `kv_transfer_params` the prefill answered. No
//! sidecar runs on the engines.
//!
//! The legs are vLLM's NixlConnector protocol as llm-d's `pd-sidecar` and vLLM's toy proxy drive
//! it. The prefill leg is the client's body with `kv_transfer_params: {do_remote_decode: true,
//! do_remote_prefill: false, remote_engine_id: null, remote_block_ids: null, remote_host: null,
//! remote_port: null}`, `stream: false` without `stream_options`, the token limit at 1
//! (`max_output_tokens` for the Responses API, `max_tokens` for the others, and every other
//! limit field the client set), `min_tokens` and `min_completion_tokens` removed (a minimum
//! above the limit is refused); it goes to the prefill replica's address on the request's own
//! path. The decode leg is the client's body with the prefill answer's `kv_transfer_params`,
//! verbatim. Both carry one fresh `x-request-id` (vLLM names the request after it). Every field
//! either leg does not set keeps the text the client sent, byte for byte.
//!
//! Only `content-type` and `x-request-id` go with the prefill leg: the engine needs nothing
//! else, and a client's credentials are not ext-proc's to forward.
//!
//! A leg answered 502, 503 or 504, or whose connection is refused, is tried again (after 50 ms,
//! then twice as long each time) up to `prefill_retries` times; the whole leg ends within
//! `prefill_timeout`. A leg that fails in any way — or that finds the pool's
//! `max_concurrent_prefills` legs already running — leaves the request to be served whole on
//! the decode replica: it is counted by outcome (`disaggregation_prefill_legs_total`), logged
//! (throttled), and never an error the client sees. A decode leg must not carry parameters of a
//! prefill that did not finish: vLLM would fail it (HTTP 500) once the transfer failed.

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use kvroute_index_core::throttle::LogThrottle;
use parking_lot::Mutex;
use serde::Deserialize;
use serde::de::{Deserializer, MapAccess, Visitor};
use serde_json::value::RawValue;

use crate::config::PrefillLegSettings;
use crate::metrics::{Metrics, PoolLabel, PrefillLegLabels};
use crate::picker::PrefillLeg;
use crate::request::Endpoint;
use crate::tokenizer::http::{CallError, exchange_json};

/// The header naming a request on both legs (vLLM takes it as the request's base id).
pub const REQUEST_ID_HEADER: &str = "x-request-id";

/// What the prefill leg asks: compute the prompt, keep its blocks for a decode replica to pull.
pub const PREFILL_KV_TRANSFER_PARAMS: &str = r#"{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}"#;

/// Largest prefill answer read (one generated token; prompt log-probabilities can be large).
const MAX_PREFILL_ANSWER_BYTES: usize = 16 * 1024 * 1024;

/// Wait before the first retry of a leg; each next one waits twice as long.
const FIRST_RETRY_BACKOFF: Duration = Duration::from_millis(50);

/// Token-limit fields of the request APIs, each set to 1 on the prefill leg when present.
const LIMIT_FIELDS: [&str; 3] = ["max_tokens", "max_completion_tokens", "max_output_tokens"];

/// Fields the prefill leg sets or removes, besides the limits.
const PREFILL_REPLACED: [&str; 5] = [
    "kv_transfer_params",
    "stream",
    "stream_options",
    "min_tokens",
    "min_completion_tokens",
];

/// Why a split request is served whole after all (the `outcome` label, `ok` aside).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LegFailure {
    /// The pool's `max_concurrent_prefills` legs were running.
    Busy,
    /// No connection to the prefill replica, after the retries.
    Connect(String),
    /// The connection broke or the answer was unreadable.
    Transport(String),
    /// A non-success status (the last one, after retries of 502, 503 and 504).
    Status(u16),
    /// `prefill_timeout` passed.
    Timeout,
    /// A success answer without a `kv_transfer_params` object (the engine has no KV connector,
    /// or the request did not finish by length).
    NoParams,
    /// The request cannot be turned into a prefill leg (not a JSON object, or an endpoint
    /// whose token limit is not known).
    Unsupported(String),
}

impl LegFailure {
    /// Metric label.
    pub fn as_label(&self) -> &'static str {
        match self {
            Self::Busy => "busy",
            Self::Connect(_) => "connect_error",
            Self::Transport(_) => "transport_error",
            Self::Status(_) => "status",
            Self::Timeout => "timeout",
            Self::NoParams => "no_kv_transfer_params",
            Self::Unsupported(_) => "unsupported_request",
        }
    }
}

impl fmt::Display for LegFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Busy => f.write_str("max_concurrent_prefills legs already running"),
            Self::Connect(reason) => write!(f, "no connection: {reason}"),
            Self::Transport(reason) => write!(f, "no answer: {reason}"),
            Self::Status(status) => write!(f, "answered status {status}"),
            Self::Timeout => f.write_str("prefill_timeout passed"),
            Self::NoParams => f.write_str("answer without a kv_transfer_params object"),
            Self::Unsupported(reason) => write!(f, "request not sent: {reason}"),
        }
    }
}

/// What the decode replica gets after a prefill leg that finished.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecodeLeg {
    /// The client's body with the prefill's `kv_transfer_params`.
    pub body: Vec<u8>,
    /// The `x-request-id` the prefill leg carried.
    pub request_id: String,
}

/// Runs prefill legs: one HTTP client for every pool, a bound on the legs in flight per pool.
#[derive(Debug)]
pub struct Prefiller {
    client: Client<HttpConnector, Full<Bytes>>,
    in_flight: Mutex<HashMap<String, Arc<AtomicUsize>>>,
    metrics: Metrics,
    failures: LogThrottle,
}

impl Prefiller {
    /// A prefiller counting into `metrics`.
    pub fn new(metrics: Metrics) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        Self {
            client: Client::builder(TokioExecutor::new()).build(connector),
            in_flight: Mutex::default(),
            metrics,
            failures: LogThrottle::default(),
        }
    }

    /// Runs `leg` for the request `body` sent to `path`: what the decode replica gets, or
    /// `None` when the request is served whole (counted and logged).
    pub async fn run(
        &self,
        leg: &PrefillLeg,
        path: &str,
        endpoint: Endpoint,
        body: &[u8],
    ) -> Option<DecodeLeg> {
        let outcome = self.try_run(leg, path, endpoint, body).await;
        let label = match &outcome {
            Ok(_) => "ok",
            Err(failure) => failure.as_label(),
        };
        self.metrics
            .disaggregation_prefill_legs
            .get_or_create(&PrefillLegLabels {
                pool: leg.pool.clone(),
                outcome: label,
            })
            .inc();
        match outcome {
            Ok(decode) => Some(decode),
            Err(failure) => {
                if let Some(suppressed) = self.failures.allow() {
                    tracing::warn!(
                        pool = %leg.pool,
                        prefill = %leg.replica_id,
                        outcome = label,
                        suppressed,
                        "prefill leg failed ({failure}): served whole on the decode replica \
                         (counted in kvroute_extproc_disaggregation_prefill_legs_total)"
                    );
                }
                None
            }
        }
    }

    async fn try_run(
        &self,
        leg: &PrefillLeg,
        path: &str,
        endpoint: Endpoint,
        body: &[u8],
    ) -> Result<DecodeLeg, LegFailure> {
        let settings = leg.disaggregation.prefill;
        let prefill_body = prefill_body(body, endpoint).map_err(LegFailure::Unsupported)?;
        let url: http::Uri = format!("http://{}{path}", leg.address)
            .parse()
            .map_err(|e: http::uri::InvalidUri| LegFailure::Unsupported(e.to_string()))?;
        let _slot = self
            .slot(&leg.pool, settings.max_concurrent)
            .ok_or(LegFailure::Busy)?;
        let request_id = fresh_request_id();
        let attempts = self.attempts(
            &leg.pool,
            settings,
            url,
            &request_id,
            Bytes::from(prefill_body),
        );
        let span = kvroute_runtime::trace_span!(
            "kvroute.prefill",
            otel.kind = "client",
            kvroute.endpoint = %leg.address,
        );
        let answer = tokio::time::timeout(
            settings.timeout,
            tracing::Instrument::instrument(attempts, span),
        )
        .await
        .map_err(|_| LegFailure::Timeout)??;
        let params = answer_params(&answer).ok_or(LegFailure::NoParams)?;
        let body = decode_body(body, params).map_err(LegFailure::Unsupported)?;
        Ok(DecodeLeg { body, request_id })
    }

    /// A place among the pool's legs in flight, unless `max` are running.
    fn slot(&self, pool: &str, max: usize) -> Option<Slot> {
        let counter = Arc::clone(self.in_flight.lock().entry(pool.to_owned()).or_default());
        if counter.fetch_add(1, Ordering::AcqRel) >= max {
            counter.fetch_sub(1, Ordering::AcqRel);
            return None;
        }
        Some(Slot(counter))
    }

    /// The leg's attempts: a success answer's body, or why there is none.
    async fn attempts(
        &self,
        pool: &str,
        settings: PrefillLegSettings,
        url: http::Uri,
        request_id: &str,
        body: Bytes,
    ) -> Result<Bytes, LegFailure> {
        let headers = [(REQUEST_ID_HEADER, request_id)];
        let mut backoff = FIRST_RETRY_BACKOFF;
        let mut attempt = 0;
        loop {
            let failure = match exchange_json(
                &self.client,
                url.clone(),
                &headers,
                body.clone(),
                MAX_PREFILL_ANSWER_BYTES,
            )
            .await
            {
                Ok(answer) if answer.status.is_success() => return Ok(answer.body),
                Ok(answer) => LegFailure::Status(answer.status.as_u16()),
                Err(CallError::Connect(reason)) => LegFailure::Connect(reason),
                Err(CallError::Failed(reason)) => return Err(LegFailure::Transport(reason)),
            };
            let transient = matches!(
                failure,
                LegFailure::Connect(_) | LegFailure::Status(502..=504)
            );
            if !transient || attempt >= settings.retries {
                return Err(failure);
            }
            attempt += 1;
            self.metrics
                .disaggregation_prefill_retries
                .get_or_create(&PoolLabel {
                    pool: pool.to_owned(),
                })
                .inc();
            tokio::time::sleep(backoff).await;
            backoff = backoff.saturating_mul(2);
        }
    }
}

/// A leg counted among its pool's legs in flight until dropped.
struct Slot(Arc<AtomicUsize>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A fresh request id, formatted as a random (version 4) UUID as llm-d's sidecar sends it.
fn fresh_request_id() -> String {
    let bits = rand::random::<u128>();
    let bits = (bits & !(0xf << 76) & !(0x3 << 62)) | (0x4 << 76) | (0x2 << 62);
    let hex = format!("{bits:032x}");
    format!(
        "{}-{}-{}-{}-{}",
        &hex[..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..]
    )
}

/// The `kv_transfer_params` object of a prefill answer, as it was sent.
fn answer_params(answer: &[u8]) -> Option<&RawValue> {
    #[derive(Deserialize)]
    struct Answer<'a> {
        #[serde(borrow)]
        kv_transfer_params: Option<&'a RawValue>,
    }
    let params = serde_json::from_slice::<Answer<'_>>(answer)
        .ok()?
        .kv_transfer_params?;
    params.get().starts_with('{').then_some(params)
}

/// The prefill leg's body for a request to `endpoint` (see the module docs).
pub fn prefill_body(body: &[u8], endpoint: Endpoint) -> Result<Vec<u8>, String> {
    let own_limit = match endpoint {
        Endpoint::Responses => "max_output_tokens",
        Endpoint::Completions | Endpoint::ChatCompletions | Endpoint::Messages => "max_tokens",
        Endpoint::Other => {
            return Err("not a completion, chat, responses or messages request".into());
        }
    };
    let TopLevel(fields) = top_level(body)?;
    let mut limits: Vec<&str> = LIMIT_FIELDS
        .iter()
        .copied()
        .filter(|limit| fields.iter().any(|(key, _)| key == limit))
        .collect();
    if !limits.contains(&own_limit) {
        limits.push(own_limit);
    }
    let kept = fields
        .iter()
        .filter(|(key, _)| {
            !PREFILL_REPLACED.contains(&key.as_str()) && !limits.contains(&key.as_str())
        })
        .map(|(key, value)| (key.as_str(), value.get()));
    let set = [
        ("kv_transfer_params", PREFILL_KV_TRANSFER_PARAMS),
        ("stream", "false"),
    ]
    .into_iter()
    .chain(limits.iter().map(|limit| (*limit, "1")));
    Ok(write_object(kept.chain(set)))
}

/// The decode leg's body: the client's, with `params` as its `kv_transfer_params`.
pub fn decode_body(body: &[u8], params: &RawValue) -> Result<Vec<u8>, String> {
    let TopLevel(fields) = top_level(body)?;
    let kept = fields
        .iter()
        .filter(|(key, _)| key != "kv_transfer_params")
        .map(|(key, value)| (key.as_str(), value.get()));
    Ok(write_object(kept.chain(std::iter::once((
        "kv_transfer_params",
        params.get(),
    )))))
}

/// `fields` (keys, and values' JSON text) as one JSON object, keys escaped.
fn write_object<'a>(fields: impl Iterator<Item = (&'a str, &'a str)>) -> Vec<u8> {
    let mut out = Vec::new();
    out.push(b'{');
    for (i, (key, value)) in fields.enumerate() {
        if i > 0 {
            out.push(b',');
        }
        // A string always serialises.
        let _ = serde_json::to_writer(&mut out, key);
        out.push(b':');
        out.extend_from_slice(value.as_bytes());
    }
    out.push(b'}');
    out
}

/// A JSON object's top-level fields in order, each value's text as it was sent.
struct TopLevel<'a>(Vec<(String, &'a RawValue)>);

fn top_level(body: &[u8]) -> Result<TopLevel<'_>, String> {
    serde_json::from_slice(body).map_err(|e| format!("body is not a JSON object: {e}"))
}

impl<'de> Deserialize<'de> for TopLevel<'de> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Fields;
        impl<'de> Visitor<'de> for Fields {
            type Value = TopLevel<'de>;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON object")
            }

            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                let mut fields = Vec::new();
                while let Some((key, value)) = map.next_entry::<String, &'de RawValue>()? {
                    fields.push((key, value));
                }
                Ok(TopLevel(fields))
            }
        }
        deserializer.deserialize_map(Fields)
    }
}

#[cfg(test)]
mod tests;
