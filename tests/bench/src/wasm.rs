//! Wasm fast path vs ext_proc path vs plain, through the shipped full chain.

use super::*;

pub(super) async fn wasm_bench(
    args: &Args,
    prompts: &PromptSource,
    ext_procs: &tokio::runtime::Handle,
) -> anyhow::Result<()> {
    let module = std::env::var_os("KVROUTE_WASM")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| {
            workspace_root().join("target/wasm32-wasip1/wasm/kvroute_wasm_filter.wasm")
        });
    ensure!(
        module.is_file(),
        "{} missing: cargo build --profile wasm --target wasm32-wasip1 -p kvroute-wasm-filter",
        module.display()
    );
    let backends = Backends::start(!args.without_index, false, prompts, ext_procs).await?;
    let config = full_chain_config(&backends, &module)?;
    let envoy = Envoy::start(&config).await?;
    let listener = |name: &str| {
        envoy
            .listener(name)
            .with_context(|| format!("no listener {name}"))
    };
    let kvroute = listener("kvroute")?;
    let session = |value: String| vec![("x-session-id".to_owned(), value)];
    let mut cases = vec![
        Case::new("plain", listener("plain")?, |_| Vec::new()),
        // A new session per request: fast-path miss → ext_proc decides → the fallback filter learns.
        Case::new("ext_proc path (first turns)", kvroute, move |i| {
            session(format!("new-{i}"))
        }),
        // One session, learned during warm-up: every later turn is a fast-path hit.
        Case::new("wasm fast path (later turns)", kvroute, move |_| {
            session("returning".to_owned())
        }),
    ];
    println!(
        "## wasm: shipped envoy/kvroute-full-chain.yaml (+ a plain listener), load {}\n",
        load_average()
    );
    let stat = |name: &str| {
        let envoy = &envoy;
        let name = format!("wasmcustom.kvroute_wasm_{name}");
        async move { envoy.stat(&name).await.map(|v| v.unwrap_or(0)) }
    };
    for (tokens, samples) in args.sizes() {
        // Fresh session names per size.
        let prefix = format!("{tokens}-");
        cases[1].headers =
            Box::new(move |i| vec![("x-session-id".to_owned(), format!("{prefix}new-{i}"))]);
        let hits_before = stat("fast_path_session_hits_total").await?;
        let decisions_before = stat("extproc_decisions_total").await?;
        measure(
            &mut cases,
            None,
            prompts,
            tokens,
            Workload::Miss,
            args.reps,
            samples,
        )
        .await?;
        let hits = stat("fast_path_session_hits_total").await? - hits_before;
        let decisions = stat("extproc_decisions_total").await? - decisions_before;
        println!(
            "### {tokens}-token prompts, {} reps × {samples} per case (load {})\n",
            args.reps,
            load_average()
        );
        report(
            &cases,
            "plain",
            &[
                (
                    "wasm fast path (later turns)",
                    "ext_proc path (first turns)",
                ),
                ("wasm fast path (later turns)", "plain"),
            ],
        );
        let per_case = (WARMUP_PER_CASE + args.reps * samples) as u64;
        // The returning session's first turn (first size only) also asks ext_proc.
        let learn_turn = u64::from(Some(tokens) == args.sizes().first().map(|s| s.0));
        println!(
            "- check: fast-path session hits {hits} (expected ≥ {}), ext_proc decisions {decisions} (expected {})\n",
            per_case - 1,
            per_case + learn_turn
        );
    }
    let failures: usize = cases.iter().map(|c| c.failures).sum();
    println!("failed requests: {failures}\n");
    drop(envoy);
    drop(backends);
    Ok(())
}

/// The shipped full chain with real addresses (as `tests/tests/suite/wasm_filter.rs` renders it)
/// plus a `plain` listener onto the same replica pool.
fn full_chain_config(backends: &Backends, module: &std::path::Path) -> anyhow::Result<String> {
    let shipped = workspace_root().join("envoy/kvroute-full-chain.yaml");
    let mut config = std::fs::read_to_string(&shipped)?;
    let [a, b] = [backends.upstreams[0].port(), backends.upstreams[1].port()];
    let substitutions = [
        ("WASM_FILTER_PATH".to_owned(), module.display().to_string()),
        ("port_value: 9901".to_owned(), "port_value: 0".to_owned()),
        ("port_value: 8080".to_owned(), "port_value: 0".to_owned()),
        ("18001".to_owned(), a.to_string()),
        ("18002".to_owned(), b.to_string()),
        ("18003".to_owned(), a.to_string()),
        ("50051".to_owned(), backends.kvroute.port().to_string()),
    ];
    for (from, to) in substitutions {
        ensure!(
            config.contains(&from),
            "{} no longer contains {from:?}",
            shipped.display()
        );
        config = config.replace(&from, &to);
    }
    let mut yaml: serde_yaml::Value = serde_yaml::from_str(&config)?;
    let plain: serde_yaml::Value = serde_yaml::from_str(
        r#"
name: plain
address: {socket_address: {address: 127.0.0.1, port_value: 0}}
per_connection_buffer_limit_bytes: 1048576
filter_chains:
- filters:
  - name: envoy.filters.network.http_connection_manager
    typed_config:
      "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
      stat_prefix: plain
      route_config:
        virtual_hosts:
        - name: all
          domains: ["*"]
          routes:
          - match: {prefix: "/"}
            route: {cluster: kvroute_replicas, timeout: 0s}
      http_filters:
      - name: envoy.filters.http.router
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
"#,
    )?;
    yaml["static_resources"]["listeners"]
        .as_sequence_mut()
        .context("static_resources.listeners is not a list")?
        .push(plain);
    Ok(serde_yaml::to_string(&yaml)?)
}
