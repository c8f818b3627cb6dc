//! The engine simulators of a stack: their command lines, KV-event sources and faults.

#[allow(clippy::wildcard_imports)]
use super::*;

/// A one-token completion shorter than a block: an idle vLLM publishes queued events (a reset's
/// `AllBlocksCleared`) only with its next engine step, and this step stores no block. An engine
/// of several data-parallel ranks gets one per rank (`x-data-parallel-rank`): an idle rank steps
/// only for a request of its own (the others run dummy batches, which publish nothing).
pub(super) async fn nudge_engine(base_url: &str, ranks: u32) {
    let body = serde_json::json!({"model": MODEL, "prompt": "sync", "max_tokens": 1});
    let url = format!("{base_url}/v1/completions");
    if ranks <= 1 {
        let _ = http::post_json(&url, &body).await;
        return;
    }
    for rank in 0..ranks {
        let rank = rank.to_string();
        let header = [(kvroute_config::DATA_PARALLEL_RANK_HEADER, rank.as_str())];
        let _ = http::post_json_with_headers(&url, &body, &header).await;
    }
}

pub(super) fn replica_id(replica: usize) -> String {
    format!("sim-{replica}")
}

/// The ids of replica `id` with `ranks` data-parallel ranks: itself, or each rank's.
pub(super) fn rank_ids(id: &str, ranks: u32) -> Vec<String> {
    if ranks > 1 {
        (0..ranks)
            .map(|rank| kvroute_config::rank_replica_id(id, rank))
            .collect()
    } else {
        vec![id.to_owned()]
    }
}

/// The KV-event topic sim `replica` publishes on.
pub fn event_topic(replica: usize) -> String {
    format!("kv@{}@{MODEL}", replica_id(replica))
}

/// The ports a sim bound, to restart it on them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct SimPorts {
    pub(super) http: u16,
    pub(super) events: u16,
    pub(super) replay: u16,
}

impl SimPorts {
    pub(super) fn of(sim: &SimProcess) -> Option<Self> {
        let port =
            |endpoint: &Option<String>| endpoint.as_deref()?.rsplit(':').next()?.parse().ok();
        Some(Self {
            http: sim.ready.http.port(),
            events: port(&sim.ready.kv_events)?,
            replay: port(&sim.ready.replay)?,
        })
    }
}

/// A sim's flags; `ports` pins a restarted sim to the ports its predecessor bound (port 0 else).
/// Starts `options.replicas` sims as [`Stack::start`] does, without anything in front of them
/// (tests that put their own ext-proc and Envoy there).
pub async fn start_sims(options: &StackOptions) -> Result<Vec<SimProcess>, StackError> {
    let sim = locate(
        &binary_dir(options.bin_dir.as_deref()),
        "kvroute-engine-sim",
    )?;
    let binary = sim.display().to_string();
    let mut sims = Vec::with_capacity(options.replicas);
    for replica in 0..options.replicas {
        sims.push(SimProcess::spawn(&binary, &sim_args(options, replica, None)?).await?);
    }
    Ok(sims)
}

pub(super) fn sim_args(
    options: &StackOptions,
    replica: usize,
    ports: Option<SimPorts>,
) -> Result<Vec<String>, StackError> {
    let timing = &options.timing;
    let ranks = options.data_parallel_size.max(1);
    let (http, events, replay) = match ports {
        Some(p) => (p.http, p.events, p.replay),
        // Ranks offset rank 0's ports (as vLLM does), so those are fixed ahead: a run of free
        // ports, the publishers' then the replay sockets'.
        None if ranks > 1 => {
            let first = reserve_port_run(2 * ranks as usize)?;
            (0, first, first + ranks as u16)
        }
        None => (0, 0, 0),
    };
    let block_size = match options.events_faults.get(replica).copied().flatten() {
        Some(EventsFault::BlockSize(size)) => size,
        _ => options.block_size,
    };
    let events = serde_json::json!({
        "enable_kv_cache_events": true,
        "publisher": "zmq",
        "endpoint": format!("tcp://*:{events}"),
        "replay_endpoint": format!("tcp://*:{replay}"),
        "topic": event_topic(replica),
    });
    Ok([
        ("--port", http.to_string()),
        ("--model", tiny_model_dir().display().to_string()),
        ("--served-model-name", MODEL.to_owned()),
        ("--block-size", block_size.to_string()),
        ("--num-blocks", options.kv_blocks_per_replica.to_string()),
        ("--max-model-len", options.max_model_len.to_string()),
        ("--max-num-seqs", options.max_num_seqs.to_string()),
        ("--prefix-caching-hash-algo", options.hash_algo.clone()),
        ("--python-hash-seed", options.hash_seed.clone()),
        ("--ttft-overhead-ms", timing.ttft_overhead_ms.to_string()),
        (
            "--prefill-us-per-token",
            timing.prefill_us_per_token.to_string(),
        ),
        (
            "--decode-ms-per-token",
            timing.decode_ms_per_token.to_string(),
        ),
        ("--time-scale", timing.time_scale.to_string()),
        ("--kv-events-config", events.to_string()),
        ("--data-parallel-size", ranks.to_string()),
        ("--engine", options.engine_of(replica).as_label().to_owned()),
    ]
    .into_iter()
    .chain(
        options
            .sim_chat_templates
            .get(replica)
            .cloned()
            .flatten()
            .map(|template| ("--chat-template", template)),
    )
    .chain(
        options
            .replica_roles
            .get(replica)
            .copied()
            .flatten()
            .map(|role| {
                let config = serde_json::json!({"kv_connector": "NixlConnector",
                    "kv_role": role.kv_role(), "engine_id": replica_id(replica)});
                ("--kv-transfer-config", config.to_string())
            }),
    )
    .flat_map(|(flag, value)| [flag.to_owned(), value])
    .collect())
}

/// Each replica's event source: what a sim reported it bound, or what the caller gave.
pub(super) fn event_sources(
    sims: &[SimProcess],
    external: &[ExternalReplica],
) -> Result<Vec<EventSource>, StackError> {
    let mut sources = Vec::with_capacity(sims.len() + external.len());
    for (i, sim) in sims.iter().enumerate() {
        let missing = |what: &str| StackError::Component {
            component: "kvroute-engine-sim",
            detail: format!("{} reported no {what} endpoint", replica_id(i)),
            log: sim.log(),
        };
        let endpoint = sim
            .ready
            .kv_events
            .clone()
            .ok_or_else(|| missing("KV events"))?;
        let replay = sim.ready.replay.clone().ok_or_else(|| missing("replay"))?;
        sources.push(EventSource {
            endpoint,
            mode: EventsMode::Connect,
            replay,
            topic: event_topic(i),
        });
    }
    sources.extend(external.iter().map(|engine| EventSource {
        endpoint: engine.events.clone(),
        mode: engine.events_mode,
        replay: engine.replay.clone(),
        topic: engine.topic.clone(),
    }));
    Ok(sources)
}

/// Rewrites the event sources of faulted sims ([`StackOptions::events_faults`]).
pub(super) fn apply_events_faults(
    options: &StackOptions,
    sources: &mut [EventSource],
) -> Result<(), StackError> {
    for (i, source) in sources.iter_mut().enumerate() {
        if options.events_faults.get(i).copied().flatten() == Some(EventsFault::Unreachable) {
            source.endpoint = format!("tcp://127.0.0.1:{}", reserve_port()?);
            source.replay = format!("tcp://127.0.0.1:{}", reserve_port()?);
        }
    }
    Ok(())
}

/// The index's config: every replica subscribed to, except [`StackOptions::agent_replicas`], which
/// the agent (its token in `agent_token`) owns.
pub(super) fn index_config(
    options: &StackOptions,
    sources: &[EventSource],
    agent_token: Option<&Path>,
) -> String {
    let mut replicas = String::new();
    for (i, source) in sources.iter().enumerate() {
        let ranks = options.data_parallel_size.max(1);
        if options.agent_replicas.contains(&i) {
            replicas.push_str(&format!(
                "  - {{id: {}, pool: {MODEL}, events: {{data_parallel_size: {ranks}}}}}\n",
                replica_id(i)
            ));
            continue;
        }
        replicas.push_str(&format!(
            "  - id: {id}\n    pool: {MODEL}\n    events: {{endpoint: \"{endpoint}\", \
             mode: {mode}, replay_endpoint: \"{replay}\", topic: \"{topic}\", \
             data_parallel_size: {ranks}, engine: {engine}, \
             reconnect_backoff_max: {RECONNECT_BACKOFF_MAX}}}\n",
            id = replica_id(i),
            engine = options.engine_of(i).as_label(),
            endpoint = source.endpoint,
            mode = source.mode.as_label(),
            replay = source.replay,
            topic = source.topic,
        ));
    }
    format!(
        "listen: {{grpc: \"127.0.0.1:0\", admin: \"127.0.0.1:0\"}}\n\
         pools:\n- {{{pool}}}\n\
         replicas:\n{replicas}{agents}",
        pool = pool_schema(options),
        agents = agent_token.map_or_else(String::new, |token| format!(
            "agents:\n  - {{id: {AGENT_ID}, token_file: \"{}\", replicas: [{}]}}\n",
            token.display(),
            agent_replica_ids(options).join(", ")
        )),
    )
}
