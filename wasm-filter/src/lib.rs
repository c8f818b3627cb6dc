//! kvroute proxy-wasm filter: routes on headers alone so those requests skip the ext_proc round
//! trip, and keeps sessions sticky when kvroute-ext-proc is unreachable.
//!
//! One module, two instances in Envoy's HTTP filter chain, told apart by `role` in the plugin
//! configuration (see [`config`]):
//!
//! ```text
//! strip client routing headers → [fast_path] → ext_proc (skipped if marked) → [fallback] → router
//! ```
//!
//! * **fast_path** (before ext_proc): a trusted pin, else the replica learned for the session
//!   header, else the pool for the model header. A routed request gets the decision header
//!   (`x-gateway-destination-endpoint`, or `x-kvroute-cluster` for pools), the route cache cleared,
//!   and the marker `x-kvroute-fast-path: 1`, on which the chain skips ext_proc.
//! * **fallback** (after ext_proc): if ext_proc decided, remember session → decision in the shared
//!   learned table (this instance is where learning happens: it sees ext_proc's header on the
//!   request path, before any upstream is involved); if nobody decided, pick a replica by
//!   rendezvous hashing of the session so conversations stick while ext_proc is down.
//!
//! Lifecycle: Envoy loads the module once per worker VM; `on_configure` validates the JSON and
//! defines the counters (bad configuration is refused with one log line); each request runs one
//! plan from [`decision`]. The learned table ([`affinity_table`]) lives in proxy-wasm shared data,
//! shared by all VMs with the same `vm_id`, bounded by `affinity.slots * affinity.ways` entries.
//!
//! ```
//! use kvroute_wasm_filter::{AffinityTable, Config, FallbackPlan, plan_fallback};
//! use std::collections::HashMap;
//!
//! let config = Config::from_json(br#"{"role":"fallback","replicas":["10.0.0.1:8000","10.0.0.2:8000"]}"#)?;
//! let table = AffinityTable::new(&config.affinity);
//! let headers = HeaderMap(HashMap::from([("x-session-id", "conversation-42")]));
//! let FallbackPlan::Hashed(route) = plan_fallback(&config, &table, &headers) else { unreachable!() };
//! assert_eq!(route.header, "x-gateway-destination-endpoint");
//!
//! struct HeaderMap(HashMap<&'static str, &'static str>);
//! impl kvroute_wasm_filter::RequestHeaders for HeaderMap {
//!     fn header(&self, name: &str) -> Option<String> {
//!         self.0.get(name).map(|v| v.to_string())
//!     }
//! }
//! # Ok::<(), kvroute_config::ConfigError>(())
//! ```
#![deny(missing_docs)]

pub mod affinity_table;
pub mod config;
pub mod decision;
pub mod stats;

#[cfg(target_arch = "wasm32")]
mod filter;

pub use affinity_table::{AffinityTable, Bucket, SessionKey};
pub use config::{Config, Role};
pub use decision::{FallbackPlan, FastPathPlan, RequestHeaders, plan_fallback, plan_fast_path};
pub use stats::Stat;
