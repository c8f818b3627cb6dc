//! Plain vs no-op ext_proc vs kvroute-ext-proc through one Envoy, with kvroute's
//! decision stages and counters.

use super::*;

pub(super) async fn extproc_bench(
    args: &Args,
    prompts: &PromptSource,
    ext_procs: &tokio::runtime::Handle,
) -> anyhow::Result<()> {
    let backends = Backends::start(!args.without_index, args.peer, prompts, ext_procs).await?;
    let config = three_listener_config(&backends);
    let envoy = Envoy::start(&config).await?;
    let listener = |name: &str| {
        envoy
            .listener(name)
            .with_context(|| format!("no listener {name}"))
    };
    let mut cases = vec![
        Case::new("plain", listener("plain")?, |_| Vec::new()),
        Case::new("noop-ext-proc", listener("noop")?, |_| Vec::new()),
        Case::new("fixed-picker", listener("fixed")?, |_| Vec::new()),
        Case::new("kvroute-ext-proc", listener("kvroute")?, |_| Vec::new())
            .kvroute(backends.kvroute_admin, backends.index_admin),
        Case::new("kvroute-embedded", listener("embedded")?, |_| Vec::new()).kvroute(
            backends.kvroute_embedded_admin,
            backends.embedded_index_admin,
        ),
    ];
    cases.retain(|c| {
        c.name == "plain" || args.cases.is_empty() || args.cases.iter().any(|n| n == c.name)
    });
    println!(
        "## extproc: Envoy {{plain, no-op ext_proc, kvroute-ext-proc}}, load {}\n",
        load_average()
    );
    for (workload, (tokens, samples)) in args
        .workloads
        .iter()
        .flat_map(|&w| args.sizes().into_iter().map(move |size| (w, size)))
    {
        let before = stage_totals(backends.kvroute_admin).await?;
        let before_embedded = stage_totals(backends.kvroute_embedded_admin).await?;
        let tallies = measure(
            &mut cases,
            Some(&backends.publishers),
            prompts,
            tokens,
            workload,
            args.reps,
            samples,
        )
        .await?;
        let stages = stage_means(&before, &stage_totals(backends.kvroute_admin).await?);
        let stages_embedded = stage_means(
            &before_embedded,
            &stage_totals(backends.kvroute_embedded_admin).await?,
        );
        println!(
            "### {tokens}-token chat, cache {}, {} reps × {samples} per case (load {})\n",
            match workload {
                Workload::Miss => "miss (new conversations)",
                Workload::Hit => "hit (next turn; the engine holds turn 1)",
            },
            args.reps,
            load_average()
        );
        report(
            &cases,
            "plain",
            &[
                ("kvroute-ext-proc", "noop-ext-proc"),
                ("kvroute-embedded", "noop-ext-proc"),
                ("fixed-picker", "noop-ext-proc"),
                ("kvroute-ext-proc", "fixed-picker"),
                ("kvroute-embedded", "fixed-picker"),
            ],
        );
        for (case, tally) in &tallies {
            println!("- {case} tally (ext-proc /metrics, measured requests): {tally}");
        }
        println!(
            "- own timings (warm-up and first turns included): kvroute-ext-proc: {stages}. kvroute-embedded: {stages_embedded}\n"
        );
    }
    let failures: usize = cases.iter().map(|c| c.failures).sum();
    let mut stream_failures = Vec::new();
    for listener in ["noop", "fixed", "kvroute", "embedded"] {
        let stat = format!("http.{listener}.ext_proc.streams_failed");
        stream_failures.push(format!(
            "{listener} {}",
            envoy.stat(&stat).await?.unwrap_or(0)
        ));
    }
    println!(
        "failed requests: {failures}; ext_proc streams_failed: {}\n",
        stream_failures.join(", ")
    );
    if let Some(peer) = backends.peer_admin {
        // What the peer heard: the measured picker's decisions, shared through the index.
        let text = metrics_text(peer).await?;
        let news: Vec<String> = metrics::samples(&text, "kvroute_extproc_peer_news_total", &[])
            .map(|(line, value)| {
                format!(
                    "{} {value}",
                    metrics::label(line, "outcome").unwrap_or_default()
                )
            })
            .collect();
        let age = histogram(&text, "kvroute_extproc_peer_news_age_seconds")
            .since(&StageHistogram::default())
            .unwrap_or_else(|| "none arrived".to_owned());
        println!(
            "peer's news (kvroute_extproc_peer_news_total): {}; their age on arrival \
             (kvroute_extproc_peer_news_age_seconds): {age}\n",
            news.join(", ")
        );
    }
    drop(envoy);
    drop(backends);
    Ok(())
}

/// One stage's cumulative histogram in kvroute-ext-proc's `/metrics` (label sets summed).
#[derive(Debug, Clone, Default)]
struct StageHistogram {
    sum: f64,
    count: f64,
    /// (upper bound in seconds, cumulative count), ascending.
    buckets: Vec<(f64, f64)>,
}

/// The stages kvroute-ext-proc times itself.
const STAGES: [&str; 3] = ["decision", "tokenize", "match"];

/// kvroute-ext-proc's decision, tokenize and match histograms.
async fn stage_totals(admin: SocketAddr) -> anyhow::Result<Vec<StageHistogram>> {
    let text = metrics_text(admin).await?;
    Ok(STAGES
        .iter()
        .map(|stage| histogram(&text, &format!("kvroute_extproc_{stage}_duration_seconds")))
        .collect())
}

/// Histogram `name` of an exposition text, label sets summed.
fn histogram(text: &str, name: &str) -> StageHistogram {
    let mut buckets: BTreeMap<u64, f64> = BTreeMap::new();
    for (line, v) in metrics::samples(text, &format!("{name}_bucket"), &[]) {
        if let Some(le) = metrics::label(line, "le").and_then(|le| le.parse::<f64>().ok()) {
            *buckets.entry(le.to_bits()).or_default() += v;
        }
    }
    let mut buckets: Vec<(f64, f64)> = buckets
        .into_iter()
        .map(|(bits, n)| (f64::from_bits(bits), n))
        .collect();
    buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
    StageHistogram {
        sum: metrics::sum(text, &format!("{name}_sum"), &[]),
        count: metrics::sum(text, &format!("{name}_count"), &[]),
        buckets,
    }
}

/// Mean and median bucket of each stage between two [`stage_totals`] readings.
fn stage_means(before: &[StageHistogram], after: &[StageHistogram]) -> String {
    STAGES
        .iter()
        .zip(before.iter().zip(after.iter()))
        .filter_map(|(stage, (b, a))| Some(format!("{stage} {}", a.since(b)?)))
        .collect::<Vec<_>>()
        .join("; ")
}

impl StageHistogram {
    /// Mean, p50 and p99 (the upper bound of the bucket holding each) of what was observed
    /// since `before`; `None` when nothing was.
    fn since(&self, before: &StageHistogram) -> Option<String> {
        let count = self.count - before.count;
        if count <= 0.0 {
            return None;
        }
        let mean = 1e3 * (self.sum - before.sum) / count;
        let quantile = |q: f64| {
            self.buckets
                .iter()
                .zip(
                    before
                        .buckets
                        .iter()
                        .map(|x| x.1)
                        .chain(std::iter::repeat(0.0)),
                )
                .find(|((_, n), n0)| n - n0 >= q * count)
                .map(|((le, _), _)| 1e3 * le)
        };
        Some(match (quantile(0.5), quantile(0.99)) {
            (Some(p50), Some(p99)) => {
                format!("mean {mean:.3} ms, p50 ≤ {p50:.3} ms, p99 ≤ {p99:.3} ms")
            }
            _ => format!("mean {mean:.3} ms"),
        })
    }
}

/// One Envoy, listeners `plain`, `noop`, `kvroute` → cluster `replicas` (the shipped
/// override_host pool); the two ext_proc filters use the shipped full chain's ext_proc settings.
fn three_listener_config(backends: &Backends) -> String {
    let listener = |name: &str, ext_proc: Option<&str>| {
        let filter = ext_proc.map_or_else(String::new, |cluster| {
            format!(
                r#"
          - name: envoy.filters.http.ext_proc
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor
              grpc_service: {{envoy_grpc: {{cluster_name: {cluster}}}, timeout: 1s}}
              processing_mode: {{request_header_mode: SEND, request_body_mode: BUFFERED, response_header_mode: SEND, response_body_mode: NONE}}
              message_timeout: 1s
              failure_mode_allow: false
              mutation_rules: {{allow_expression: {{regex: "^(x-gateway-.*|x-kvroute-cluster|x-kvroute-decision|content-length)$"}}}}
              metadata_options:
                receiving_namespaces: {{untyped: ["envoy.lb"]}}
                forwarding_namespaces: {{untyped: ["envoy.lb"]}}"#
            )
        });
        format!(
            r#"
  - name: {name}
    address: {{socket_address: {{address: 127.0.0.1, port_value: 0}}}}
    per_connection_buffer_limit_bytes: 4194304
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: {name}
          route_config:
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes:
              - match: {{prefix: "/"}}
                route: {{cluster: replicas, timeout: 0s}}
          http_filters:{filter}
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"#
        )
    };
    let grpc_cluster = |name: &str, addr: SocketAddr| {
        format!(
            r#"
  - name: {name}
    type: STATIC
    connect_timeout: 1s
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config: {{http2_protocol_options: {{}}}}
    load_assignment:
      cluster_name: {name}
      endpoints: [{{lb_endpoints: [{{endpoint: {{address: {{socket_address: {{address: {}, port_value: {}}}}}}}}}]}}]"#,
            addr.ip(),
            addr.port()
        )
    };
    let endpoints: String = backends
        .upstreams
        .iter()
        .map(|a| {
            format!(
                "\n        - endpoint: {{address: {{socket_address: {{address: {}, port_value: {}}}}}}}",
                a.ip(),
                a.port()
            )
        })
        .collect();
    format!(
        r#"admin:
  address: {{socket_address: {{address: 127.0.0.1, port_value: 0}}}}
static_resources:
  listeners:{}{}{}{}{}
  clusters:{}{}{}{}
  - name: replicas
    type: STATIC
    connect_timeout: 1s
    load_assignment:
      cluster_name: replicas
      endpoints:
      - lb_endpoints:{endpoints}
    load_balancing_policy:
      policies:
      - typed_extension_config:
          name: envoy.load_balancing_policies.override_host
          typed_config:
            "@type": type.googleapis.com/envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost
            override_host_sources:
            - metadata: {{key: envoy.lb, path: [{{key: x-gateway-destination-endpoint}}]}}
            - header: x-gateway-destination-endpoint
            selected_host_key: {{key: envoy.lb, path: [{{key: x-gateway-destination-endpoint-served}}]}}
            fallback_policy:
              policies:
              - typed_extension_config:
                  name: envoy.load_balancing_policies.least_request
                  typed_config:
                    "@type": type.googleapis.com/envoy.extensions.load_balancing_policies.least_request.v3.LeastRequest
"#,
        listener("plain", None),
        listener("noop", Some("noop_ext_proc")),
        listener("fixed", Some("fixed_ext_proc")),
        listener("kvroute", Some("kvroute_ext_proc")),
        listener("embedded", Some("embedded_ext_proc")),
        grpc_cluster("noop_ext_proc", backends.noop.addr()),
        grpc_cluster("fixed_ext_proc", backends.fixed.addr()),
        grpc_cluster("embedded_ext_proc", backends.kvroute_embedded),
        grpc_cluster("kvroute_ext_proc", backends.kvroute),
    )
}
