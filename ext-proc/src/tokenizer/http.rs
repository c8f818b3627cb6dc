//! The network tokenizers' one HTTP call: a JSON POST within a timeout, its answer read as token
//! ids and its failures mapped to the tokenizer's error.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

use std::future::Future;
use std::pin::Pin;

use crate::error::TokenizeError;

/// Largest accepted `/tokenize` or render response body.
const MAX_TOKENIZE_RESPONSE_BYTES: usize = 64 * 1024 * 1024;

/// Reads what the tokenizer wants (token ids, with what else the answer carries) out of a
/// success answer's body (a reason on failure).
pub(super) type ReadAnswer<T> = fn(&[u8]) -> Result<T, String>;

/// Makes a failed call's error from its URL and reason.
pub(super) type CallFailed = fn(String, String) -> TokenizeError;

/// An HTTP client that POSTs JSON tokenize requests, each call bounded by one timeout.
#[derive(Debug, Clone)]
pub(super) struct TokenizeClient {
    client: Client<HttpConnector, Full<Bytes>>,
    timeout: Duration,
}

impl TokenizeClient {
    /// A client whose every call ends within `timeout`.
    pub(super) fn new(timeout: Duration) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        Self {
            client: Client::builder(TokioExecutor::new()).build(connector),
            timeout,
        }
    }

    /// POSTs `body` to `url` and reads the answer with `read`, within the timeout
    /// ([`TokenizeError::Timeout`] past it); any other failure is `failed(url, reason)`.
    pub(super) fn post<T: Send + 'static>(
        &self,
        url: http::Uri,
        body: Bytes,
        read: ReadAnswer<T>,
        failed: CallFailed,
    ) -> Pin<Box<dyn Future<Output = Result<T, TokenizeError>> + Send>> {
        let (client, timeout) = (self.client.clone(), self.timeout);
        Box::pin(async move {
            let call = async {
                let answer = post_json(client, url.clone(), body).await?;
                read(&answer)
            };
            match tokio::time::timeout(timeout, call).await {
                Ok(Ok(tokens)) => Ok(tokens),
                Ok(Err(reason)) => Err(failed(url.to_string(), reason)),
                Err(_) => Err(TokenizeError::Timeout { after: timeout }),
            }
        })
    }
}

/// POSTs a JSON `body` (only `content-type` set: no client header is forwarded) and returns
/// the success response's body, at most [`MAX_TOKENIZE_RESPONSE_BYTES`] (also `kvroute-check
/// --explain`'s one call).
pub(crate) async fn post_json(
    client: Client<HttpConnector, Full<Bytes>>,
    url: http::Uri,
    body: Bytes,
) -> Result<Bytes, String> {
    let answer = exchange_json(&client, url, &[], body, MAX_TOKENIZE_RESPONSE_BYTES)
        .await
        .map_err(|e| match e {
            CallError::Connect(reason) | CallError::Failed(reason) => reason,
        })?;
    if !answer.status.is_success() {
        return Err(format!("status {}", answer.status));
    }
    Ok(answer.body)
}

/// A JSON POST's answer, whatever its status.
#[derive(Debug)]
pub(crate) struct JsonAnswer {
    /// Its status.
    pub(crate) status: http::StatusCode,
    /// Its body, whole.
    pub(crate) body: Bytes,
}

/// Why a JSON POST got no answer.
#[derive(Debug)]
pub(crate) enum CallError {
    /// No connection was made (refused, unreachable): the request never reached the server.
    Connect(String),
    /// Anything later: the connection broke, the answer was too large or unreadable.
    Failed(String),
}

/// POSTs a JSON `body` with `content-type` and `headers` only (no client header is forwarded)
/// and reads the whole answer, at most `limit` bytes of body.
pub(crate) async fn exchange_json(
    client: &Client<HttpConnector, Full<Bytes>>,
    url: http::Uri,
    headers: &[(&str, &str)],
    body: Bytes,
    limit: usize,
) -> Result<JsonAnswer, CallError> {
    let mut request =
        http::Request::post(url).header(http::header::CONTENT_TYPE, "application/json");
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let request = request
        .body(Full::new(body))
        .map_err(|e| CallError::Failed(e.to_string()))?;
    let response = client.request(request).await.map_err(|e| {
        if e.is_connect() {
            CallError::Connect(format!("{e:#}"))
        } else {
            CallError::Failed(format!("{e:#}"))
        }
    })?;
    let status = response.status();
    let body = http_body_util::Limited::new(response.into_body(), limit)
        .collect()
        .await
        .map_err(|e| CallError::Failed(e.to_string()))?
        .to_bytes();
    Ok(JsonAnswer { status, body })
}
