//! kvroute-index: the KV block index behind kvroute's routing decisions.
//!
//! (Skeleton: being implemented.)

pub mod event;

/// Generated gRPC types and client/server for `kvroute.index.v1` (see `proto/`).
#[allow(missing_docs, clippy::all, clippy::pedantic)]
pub mod api {
    tonic::include_proto!("kvroute.index.v1");
}
