//! A minimal HTTP/1.1 client for tests (hyper), returning whole bodies.

use bytes::Bytes;
use http_body_util::{BodyExt as _, Full};
use hyper::{Method, Request, StatusCode};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

use super::HarnessError;

/// A complete response.
#[derive(Debug, Clone)]
pub struct HttpResponse {
    /// Status.
    pub status: StatusCode,
    /// Headers.
    pub headers: hyper::HeaderMap,
    /// Body.
    pub body: Bytes,
}

impl HttpResponse {
    /// The body as JSON.
    pub fn json(&self) -> Result<serde_json::Value, HarnessError> {
        serde_json::from_slice(&self.body).map_err(|e| HarnessError::Protocol {
            what: "http body".to_owned(),
            detail: format!("{e}: {}", String::from_utf8_lossy(&self.body)),
        })
    }

    /// Header `name` as text; empty when absent or not UTF-8.
    pub fn header(&self, name: &str) -> String {
        self.headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_owned()
    }

    /// The body as text.
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

fn client() -> Client<HttpConnector, Full<Bytes>> {
    Client::builder(TokioExecutor::new()).build_http()
}

async fn send(
    method: Method,
    url: &str,
    body: Option<Vec<u8>>,
    headers: &[(&str, &str)],
) -> Result<HttpResponse, HarnessError> {
    let fail = |detail: String| HarnessError::Protocol {
        what: url.to_owned(),
        detail,
    };
    let mut request = Request::builder().method(method).uri(url);
    if body.is_some() {
        request = request.header(hyper::header::CONTENT_TYPE, "application/json");
    }
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let request = request
        .body(Full::new(Bytes::from(body.unwrap_or_default())))
        .map_err(|e| fail(e.to_string()))?;
    let response = client()
        .request(request)
        .await
        .map_err(|e| fail(format!("{e:?}")))?;
    let (parts, body) = response.into_parts();
    let body = body
        .collect()
        .await
        .map_err(|e| fail(e.to_string()))?
        .to_bytes();
    Ok(HttpResponse {
        status: parts.status,
        headers: parts.headers,
        body,
    })
}

/// `GET url`.
pub async fn get(url: &str) -> Result<HttpResponse, HarnessError> {
    send(Method::GET, url, None, &[]).await
}

/// `POST url` with a JSON body.
pub async fn post_json(url: &str, body: &serde_json::Value) -> Result<HttpResponse, HarnessError> {
    send(Method::POST, url, Some(body.to_string().into_bytes()), &[]).await
}

/// `POST url` with a JSON body and `headers`.
pub async fn post_json_with_headers(
    url: &str,
    body: &serde_json::Value,
    headers: &[(&str, &str)],
) -> Result<HttpResponse, HarnessError> {
    send(
        Method::POST,
        url,
        Some(body.to_string().into_bytes()),
        headers,
    )
    .await
}

/// `POST url` with no body.
pub async fn post_empty(url: &str) -> Result<HttpResponse, HarnessError> {
    send(Method::POST, url, None, &[]).await
}
