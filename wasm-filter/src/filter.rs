//! Host glue: proxy-wasm contexts that read headers and shared data, call the plans in
//! [`crate::decision`], and apply them. Built only for `wasm32`.
//!
//! Every host call goes through `proxy_wasm::hostcalls` (which return `Result`) rather than the
//! SDK's trait helpers (which `unwrap` host errors and would trap the VM). Header values that are
//! not UTF-8 read as absent.

use std::rc::Rc;
use std::time::UNIX_EPOCH;

use log::{debug, error, info};
use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, BufferType, ContextType, LogLevel, MapType, MetricType, Status};

use crate::affinity_table::{AffinityTable, Bucket, LearnChange, SessionKey};
use crate::config::{Config, Role};
use crate::decision::{
    FallbackPlan, MARKER_VALUE, PinVerdict, RequestHeaders, Route, RouteReason, plan_fallback,
    plan_fast_path,
};
use crate::stats::Stat;

/// A write lost to another worker's concurrent write is retried this many times, then dropped
/// (counted): the next ext_proc decision for the session learns it again.
const MAX_SHARED_DATA_ATTEMPTS: usize = 3;

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Info);
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(Root { plugin: None }) });
}}

/// Everything a request needs, built once per (re)configuration.
struct Plugin {
    config: Config,
    table: AffinityTable,
    stats: Stats,
}

/// Counter handles, indexed by [`Stat::index`]; `None` if the host refused to define one.
struct Stats([Option<u32>; Stat::ALL.len()]);

impl Stats {
    fn define() -> Self {
        Stats(Stat::ALL.map(|stat| hostcalls::define_metric(MetricType::Counter, stat.name()).ok()))
    }

    fn add(&self, stat: Stat, n: u32) {
        if let Some(Some(id)) = self.0.get(stat.index()) {
            // A failed increment only loses a sample; nothing to do about it per request.
            let _ = hostcalls::increment_metric(*id, i64::from(n));
        }
    }

    fn inc(&self, stat: Stat) {
        self.add(stat, 1);
    }
}

struct Root {
    plugin: Option<Rc<Plugin>>,
}

impl Context for Root {}

impl RootContext for Root {
    fn on_configure(&mut self, plugin_configuration_size: usize) -> bool {
        let bytes = hostcalls::get_buffer(
            BufferType::PluginConfiguration,
            0,
            plugin_configuration_size,
        )
        .ok()
        .flatten()
        .unwrap_or_default();
        match Config::from_json(&bytes) {
            Ok(config) => {
                info!(
                    "configured role={:?} session_header={} replicas={} table_capacity={}",
                    config.role,
                    config.session_header,
                    config.replicas.len(),
                    u64::from(config.affinity.slots) * u64::from(config.affinity.ways)
                );
                let table = AffinityTable::new(&config.affinity);
                self.plugin = Some(Rc::new(Plugin {
                    config,
                    table,
                    stats: Stats::define(),
                }));
                true
            }
            Err(e) => {
                error!("rejecting plugin configuration ({}): {e}", e.as_label());
                false
            }
        }
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        // The SDK traps on `None`; without a plugin (never configured) the filter passes through.
        Some(Box::new(Filter {
            plugin: self.plugin.clone(),
        }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

struct Filter {
    plugin: Option<Rc<Plugin>>,
}

impl Context for Filter {}

impl HttpContext for Filter {
    fn on_http_request_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        if let Some(plugin) = &self.plugin {
            match plugin.config.role {
                Role::FastPath => fast_path(plugin),
                Role::Fallback => fallback(plugin),
            }
        }
        Action::Continue
    }
}

/// Request headers as the decision functions see them.
struct HostHeaders;

impl RequestHeaders for HostHeaders {
    fn header(&self, name: &str) -> Option<String> {
        let bytes = hostcalls::get_map_value_bytes(MapType::HttpRequestHeaders, name).ok()??;
        String::from_utf8(bytes).ok()
    }
}

fn fast_path(plugin: &Plugin) {
    let now = now_ms();
    let plan = plan_fast_path(
        &plugin.config,
        &plugin.table,
        &HostHeaders,
        now.unwrap_or(0),
        |key| {
            // Without a clock no entry can be judged fresh: skip affinity, ext_proc decides.
            now.and_then(|now| {
                read_bucket(plugin, key).and_then(|b| b.lookup(key.fingerprint, now).cloned())
            })
        },
    );
    for header in &plan.strip {
        let _ = hostcalls::remove_map_value(MapType::HttpRequestHeaders, header);
    }
    match plan.pin {
        PinVerdict::Absent => {}
        PinVerdict::Honoured => plugin.stats.inc(Stat::PinsHonoured),
        PinVerdict::Ignored(why) => {
            debug!("pin header ignored ({})", why.as_label());
            plugin.stats.inc(Stat::PinsIgnored);
        }
    }
    let Some(route) = plan.route else {
        plugin.stats.inc(Stat::FastPathMisses);
        return;
    };
    plugin.stats.inc(Stat::FastPathHits);
    match route.reason {
        RouteReason::Session => plugin.stats.inc(Stat::FastPathSessionHits),
        RouteReason::ModelPool => plugin.stats.inc(Stat::FastPathModelRoutes),
        RouteReason::Pin | RouteReason::Fallback => {}
    }
    // Marker first: the route is re-selected (and ext_proc's skip matcher evaluated) on the final headers.
    let _ = hostcalls::set_map_value(
        MapType::HttpRequestHeaders,
        &plugin.config.marker_header,
        Some(MARKER_VALUE),
    );
    apply_route(plugin, &route);
    if let (Some((key, replica)), Some(now)) = (plan.refresh, now) {
        learn(plugin, key, &replica, now);
    }
}

fn fallback(plugin: &Plugin) {
    match plan_fallback(&plugin.config, &plugin.table, &HostHeaders) {
        FallbackPlan::FastPathRouted => {}
        FallbackPlan::ExtProcDecided { learn: to_learn } => {
            plugin.stats.inc(Stat::ExtProcDecisions);
            if let (Some((key, replica)), Some(now)) = (to_learn, now_ms()) {
                learn(plugin, key, &replica, now);
            }
        }
        FallbackPlan::Hashed(route) => {
            plugin.stats.inc(Stat::FallbackDecisions);
            apply_route(plugin, &route);
        }
        FallbackPlan::Unkeyed => plugin.stats.inc(Stat::FallbackUnkeyed),
    }
}

/// Writes the decision header and re-selects the route. The Rust SDK speaks ABI 0.2.1, for which
/// Envoy 1.40 still clears the route cache on any header write; newer ABIs do not, so call the
/// Envoy foreign function explicitly.
fn apply_route(plugin: &Plugin, route: &Route<'_>) {
    let _ = hostcalls::set_map_value(
        MapType::HttpRequestHeaders,
        route.header,
        Some(&route.value),
    );
    if let Err(status) = hostcalls::call_foreign_function("clear_route_cache", None) {
        debug!("clear_route_cache failed: {status:?}");
        plugin.stats.inc(Stat::RouteCacheClearErrors);
    }
}

/// The session's bucket, or `None` when it is absent or unreadable (unreadable is counted).
fn read_bucket(plugin: &Plugin, key: SessionKey) -> Option<Bucket> {
    let (bytes, _cas) = hostcalls::get_shared_data(&plugin.table.shared_data_key(key)).ok()?;
    decode_counted(plugin, &bytes?)
}

fn decode_counted(plugin: &Plugin, bytes: &[u8]) -> Option<Bucket> {
    match Bucket::decode(bytes) {
        Ok(bucket) => Some(bucket),
        Err(e) => {
            debug!("unreadable affinity bucket ({}): {e}", e.as_label());
            plugin.stats.inc(Stat::AffinityErrors);
            None
        }
    }
}

/// Read-modify-write of one bucket with compare-and-swap; an unreadable bucket is overwritten.
fn learn(plugin: &Plugin, key: SessionKey, replica: &str, now: u64) {
    let shared_key = plugin.table.shared_data_key(key);
    for _ in 0..MAX_SHARED_DATA_ATTEMPTS {
        let Ok((bytes, cas)) = hostcalls::get_shared_data(&shared_key) else {
            plugin.stats.inc(Stat::AffinityErrors);
            return;
        };
        let mut bucket = bytes
            .and_then(|b| decode_counted(plugin, &b))
            .unwrap_or_default();
        let outcome = plugin.table.learn(&mut bucket, key, replica, now);
        if !outcome.is_write() {
            return;
        }
        match hostcalls::set_shared_data(&shared_key, Some(&bucket.encode()), cas) {
            Ok(()) => {
                match outcome.change {
                    LearnChange::Inserted => plugin.stats.inc(Stat::AffinityLearned),
                    LearnChange::Refreshed | LearnChange::Replaced => {
                        plugin.stats.inc(Stat::AffinityUpdated)
                    }
                    LearnChange::Unchanged => {}
                }
                plugin.stats.add(Stat::AffinityEvictions, outcome.evicted);
                return;
            }
            Err(Status::CasMismatch) => continue,
            Err(_) => break,
        }
    }
    plugin.stats.inc(Stat::AffinityErrors);
}

fn now_ms() -> Option<u64> {
    let since_epoch = hostcalls::get_current_time()
        .ok()?
        .duration_since(UNIX_EPOCH)
        .ok()?;
    u64::try_from(since_epoch.as_millis()).ok()
}
