//! An ext_proc client that drives kvroute-ext-proc as Envoy's `BUFFERED` body mode does: one
//! stream per HTTP request, request headers, then the whole body in one message; the answer to
//! the body is the routing decision (header mutations) or an immediate response.

use std::net::SocketAddr;
use std::time::Duration;

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue};
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    HttpBody, HttpHeaders, ProcessingRequest, ProcessingResponse, ProtocolConfiguration,
    processing_request, processing_response,
};

use super::HarnessError;

/// Largest ext_proc message either side sends (Envoy buffers bodies up to its own limit).
const MAX_MESSAGE_BYTES: usize = 64 * 1024 * 1024;

/// What ext-proc answered to a request's body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExtProcAnswer {
    /// Routed: the headers it set on the upstream request (`x-gateway-destination-endpoint`,
    /// `x-kvroute-decision: tier/reason`, ...).
    Routed(Vec<(String, String)>),
    /// Refused with this HTTP status.
    Immediate(u32),
}

impl ExtProcAnswer {
    /// The value of a header it set, if routed.
    pub fn header(&self, name: &str) -> Option<&str> {
        match self {
            Self::Routed(headers) => headers
                .iter()
                .find(|(key, _)| key == name)
                .map(|(_, value)| value.as_str()),
            Self::Immediate(_) => None,
        }
    }
}

/// A client of one ext-proc's gRPC listener (one HTTP/2 connection, shared by its streams).
#[derive(Debug, Clone)]
pub struct ExtProcClient {
    client: ExternalProcessorClient<tonic::transport::Channel>,
    timeout: Duration,
}

impl ExtProcClient {
    /// Connects to `grpc`; every exchange must finish within `timeout`.
    pub async fn connect(grpc: SocketAddr, timeout: Duration) -> Result<Self, HarnessError> {
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{grpc}"))
            .map_err(|e| protocol(grpc, e.to_string()))?
            .connect()
            .await
            .map_err(|e| protocol(grpc, e.to_string()))?;
        let client = ExternalProcessorClient::new(channel)
            .max_decoding_message_size(MAX_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_MESSAGE_BYTES);
        Ok(Self { client, timeout })
    }

    /// One `POST path` with `body`, as Envoy sends it in `BUFFERED` mode.
    pub async fn buffered(&self, path: &str, body: Vec<u8>) -> Result<ExtProcAnswer, HarnessError> {
        tokio::time::timeout(self.timeout, self.exchange(path, body))
            .await
            .map_err(|_| HarnessError::Timeout {
                what: format!("ext_proc answer to POST {path}"),
                after: self.timeout,
            })?
    }

    async fn exchange(&self, path: &str, body: Vec<u8>) -> Result<ExtProcAnswer, HarnessError> {
        let bad = |detail: String| HarnessError::Protocol {
            what: "ext_proc stream".to_owned(),
            detail,
        };
        let header = |key: &str, value: &str| HeaderValue {
            key: key.to_owned(),
            raw_value: value.as_bytes().to_vec(),
            ..HeaderValue::default()
        };
        let headers = ProcessingRequest {
            protocol_config: Some(ProtocolConfiguration {
                request_body_mode: BodySendMode::Buffered as i32,
                response_body_mode: BodySendMode::None as i32,
                ..ProtocolConfiguration::default()
            }),
            request: Some(processing_request::Request::RequestHeaders(HttpHeaders {
                headers: Some(HeaderMap {
                    headers: vec![
                        header(":path", path),
                        header(":method", "POST"),
                        header("content-type", "application/json"),
                    ],
                }),
                end_of_stream: false,
                ..HttpHeaders::default()
            })),
            ..ProcessingRequest::default()
        };
        let body = ProcessingRequest {
            request: Some(processing_request::Request::RequestBody(HttpBody {
                body,
                end_of_stream: true,
                ..HttpBody::default()
            })),
            ..ProcessingRequest::default()
        };
        let (tx, rx) = tokio::sync::mpsc::channel(2);
        tx.send(headers)
            .await
            .map_err(|_| bad("stream closed".into()))?;
        let mut responses = self
            .client
            .clone()
            .process(tokio_stream::wrappers::ReceiverStream::new(rx))
            .await
            .map_err(|e| bad(e.to_string()))?
            .into_inner();
        match next(&mut responses).await?.response {
            Some(processing_response::Response::RequestHeaders(_)) => {}
            Some(processing_response::Response::ImmediateResponse(refused)) => {
                return Ok(ExtProcAnswer::Immediate(
                    refused.status.map_or(0, |s| s.code as u32),
                ));
            }
            other => return Err(bad(format!("answer to the headers: {other:?}"))),
        }
        tx.send(body)
            .await
            .map_err(|_| bad("stream closed".into()))?;
        match next(&mut responses).await?.response {
            Some(processing_response::Response::RequestBody(answer)) => {
                let set = answer
                    .response
                    .and_then(|common| common.header_mutation)
                    .map(|mutation| mutation.set_headers)
                    .unwrap_or_default();
                Ok(ExtProcAnswer::Routed(
                    set.into_iter()
                        .filter_map(|option| option.header)
                        .map(|h| (h.key, String::from_utf8_lossy(&h.raw_value).into_owned()))
                        .collect(),
                ))
            }
            Some(processing_response::Response::ImmediateResponse(refused)) => Ok(
                ExtProcAnswer::Immediate(refused.status.map_or(0, |s| s.code as u32)),
            ),
            other => Err(bad(format!("answer to the body: {other:?}"))),
        }
    }
}

async fn next(
    responses: &mut tonic::Streaming<ProcessingResponse>,
) -> Result<ProcessingResponse, HarnessError> {
    let bad = |detail: String| HarnessError::Protocol {
        what: "ext_proc stream".to_owned(),
        detail,
    };
    responses
        .message()
        .await
        .map_err(|e| bad(e.to_string()))?
        .ok_or_else(|| bad("stream ended".into()))
}

fn protocol(grpc: SocketAddr, detail: String) -> HarnessError {
    HarnessError::Protocol {
        what: format!("ext_proc at {grpc}"),
        detail,
    }
}
