//! Typed forms of the custom resources the chart renders, written from their published API
//! definitions (GIE `inference.networking.k8s.io/v1` InferencePool, Gateway API v1 HTTPRoute,
//! Envoy AI Gateway v1alpha1 AIGatewayRoute). They hold the fields kvroute's manifests use, and
//! refuse every other key (`deny_unknown_fields`), so a key that is not in the API fails here
//! rather than being dropped by the API server's pruning.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::{Deserialize, Serialize};

/// InferencePool's group/version.
pub const INFERENCE_POOL_API_VERSION: &str = "inference.networking.k8s.io/v1";
/// HTTPRoute's group/version.
pub const GATEWAY_API_VERSION: &str = "gateway.networking.k8s.io/v1";
/// AIGatewayRoute's group/version.
pub const AI_GATEWAY_API_VERSION: &str = "aigateway.envoyproxy.io/v1beta1";

/// A GIE InferencePool: the model server pods and their endpoint picker.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct InferencePool {
    /// `inference.networking.k8s.io/v1`.
    pub api_version: String,
    /// `InferencePool`.
    pub kind: String,
    /// Name, namespace, labels.
    pub metadata: ObjectMeta,
    /// The pool.
    pub spec: InferencePoolSpec,
}

/// `InferencePool.spec`.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct InferencePoolSpec {
    /// Which pods are members (labels only).
    pub selector: LabelSelector,
    /// The members' serving port (exactly one).
    pub target_ports: Vec<Port>,
    /// The endpoint picker.
    pub endpoint_picker_ref: EndpointPickerRef,
}

/// GIE's label selector: `matchLabels` only.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct LabelSelector {
    /// Labels a member pod carries.
    pub match_labels: BTreeMap<String, String>,
}

/// A port number.
#[derive(Debug, Clone, Copy, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Port {
    /// 1–65535.
    pub number: u16,
}

/// `spec.endpointPickerRef`.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct EndpointPickerRef {
    /// API group of the referent (`""`: core).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group: Option<String>,
    /// Kind of the referent (default `Service`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    /// Name of the referent.
    pub name: String,
    /// The picker's port (default 9002).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port: Option<Port>,
    /// What the gateway does when the picker does not answer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure_mode: Option<FailureMode>,
}

/// `endpointPickerRef.failureMode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
pub enum FailureMode {
    /// The gateway picks an endpoint itself.
    FailOpen,
    /// The request fails.
    FailClose,
}

/// A Gateway API HTTPRoute.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct HttpRoute {
    /// `gateway.networking.k8s.io/v1`.
    pub api_version: String,
    /// `HTTPRoute`.
    pub kind: String,
    /// Name, namespace, labels.
    pub metadata: ObjectMeta,
    /// The route.
    pub spec: HttpRouteSpec,
}

/// `HTTPRoute.spec`.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct HttpRouteSpec {
    /// The Gateways it attaches to.
    pub parent_refs: Vec<ParentReference>,
    /// Host names it serves.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hostnames: Option<Vec<String>>,
    /// Its rules.
    pub rules: Vec<HttpRouteRule>,
}

/// A route's parent (a Gateway).
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ParentReference {
    /// API group (default `gateway.networking.k8s.io`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group: Option<String>,
    /// Kind (default `Gateway`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    /// Name.
    pub name: String,
    /// Namespace (default: the route's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    /// A listener of the Gateway.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub section_name: Option<String>,
}

/// One HTTPRoute rule.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct HttpRouteRule {
    /// What requests it takes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub matches: Option<Vec<RouteMatch>>,
    /// Where they go.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backend_refs: Option<Vec<BackendRef>>,
    /// Request and backend-request timeouts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeouts: Option<Timeouts>,
}

/// A request match (path and headers).
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RouteMatch {
    /// Path match.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<ValueMatch>,
    /// Header matches.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub headers: Option<Vec<HeaderMatch>>,
}

/// `{type, value}` (a path match).
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ValueMatch {
    /// `Exact`, `PathPrefix`, `RegularExpression`.
    #[serde(rename = "type")]
    pub kind: String,
    /// The value.
    pub value: String,
}

/// `{type, name, value}` (a header match).
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct HeaderMatch {
    /// `Exact` or `RegularExpression`.
    #[serde(rename = "type")]
    pub kind: String,
    /// Header name.
    pub name: String,
    /// Header value.
    pub value: String,
}

/// A backend (a Service, or an InferencePool).
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct BackendRef {
    /// API group (`""`: core).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group: Option<String>,
    /// Kind (default `Service`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    /// Name.
    pub name: String,
    /// Namespace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    /// Port (Services).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port: Option<u16>,
    /// Share of the rule's traffic.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight: Option<u32>,
}

/// `rules[].timeouts`.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Timeouts {
    /// The whole request.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request: Option<String>,
    /// One try to the backend.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backend_request: Option<String>,
}

/// An Envoy AI Gateway AIGatewayRoute.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct AiGatewayRoute {
    /// `aigateway.envoyproxy.io/v1beta1` (the storage version; `v1alpha1` is deprecated).
    pub api_version: String,
    /// `AIGatewayRoute`.
    pub kind: String,
    /// Name, namespace, labels.
    pub metadata: ObjectMeta,
    /// The route.
    pub spec: AiGatewayRouteSpec,
}

/// `AIGatewayRoute.spec`.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct AiGatewayRouteSpec {
    /// The Gateways it attaches to.
    pub parent_refs: Vec<ParentReference>,
    /// Its rules.
    pub rules: Vec<AiGatewayRouteRule>,
}

/// One AIGatewayRoute rule.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct AiGatewayRouteRule {
    /// What requests it takes (headers, e.g. `x-ai-eg-model`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub matches: Option<Vec<RouteMatch>>,
    /// Where they go.
    pub backend_refs: Vec<BackendRef>,
}
