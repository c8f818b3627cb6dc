//! The measuring client (one keep-alive connection per listener, cases interleaved), kvroute's
//! decision tallies and the Markdown report.

use super::*;

/// One measured case: a listener plus the headers each request carries.
pub(crate) struct Case {
    pub(crate) name: &'static str,
    url: String,
    pub(crate) client: Client<HttpConnector, Full<Bytes>>,
    /// Extra headers for request `i` of this case.
    pub(crate) headers: Box<dyn Fn(u64) -> Vec<(String, String)> + Send + Sync>,
    /// Latencies per repetition.
    pub(crate) samples: Vec<Vec<Duration>>,
    /// `tier/reason` the upstream echoed → count.
    pub(crate) decisions: BTreeMap<String, usize>,
    pub(crate) failures: usize,
    pub(crate) sent: u64,
    /// For a kvroute-ext-proc listener: its admin address (decision tally) and its index's
    /// admin address (to wait until the index holds a hit's first turn).
    pub(crate) kvroute: Option<KvrouteAdmin>,
}

/// Where a kvroute case's ext-proc and index answer admin requests.
#[derive(Debug, Clone, Copy)]
pub(crate) struct KvrouteAdmin {
    pub(crate) ext_proc: SocketAddr,
    pub(crate) index: SocketAddr,
}

impl Case {
    pub(crate) fn new(
        name: &'static str,
        listener: SocketAddr,
        headers: impl Fn(u64) -> Vec<(String, String)> + Send + Sync + 'static,
    ) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        Self {
            name,
            url: format!("http://{listener}/v1/chat/completions"),
            client: Client::builder(TokioExecutor::new()).build(connector),
            headers: Box::new(headers),
            samples: Vec::new(),
            decisions: BTreeMap::new(),
            failures: 0,
            sent: 0,
            kvroute: None,
        }
    }

    /// This case is a kvroute-ext-proc listener with these admin addresses.
    pub(crate) fn kvroute(mut self, ext_proc: SocketAddr, index: SocketAddr) -> Self {
        self.kvroute = Some(KvrouteAdmin { ext_proc, index });
        self
    }

    /// Sends one request; returns its latency (request start → whole response body).
    async fn send(&mut self, body: Bytes) -> anyhow::Result<Duration> {
        Ok(self.send_to(body).await?.0)
    }

    /// Sends one request; returns its latency and the upstream that answered.
    async fn send_to(&mut self, body: Bytes) -> anyhow::Result<(Duration, Option<usize>)> {
        let mut request =
            hyper::Request::post(&self.url).header("content-type", "application/json");
        for (name, value) in (self.headers)(self.sent) {
            request = request.header(name, value);
        }
        self.sent += 1;
        let request = request.body(Full::new(body))?;
        let started = Instant::now();
        let response = tokio::time::timeout(Duration::from_secs(10), self.client.request(request))
            .await
            .context("no answer within 10 s")??;
        let status = response.status();
        let decision = response
            .headers()
            .get(DECISION_HEADER)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        let upstream = response
            .headers()
            .get(UPSTREAM_HEADER)
            .and_then(|v| v.to_str().ok()?.parse().ok());
        let body = response.into_body().collect().await?.to_bytes();
        let elapsed = started.elapsed();
        if !status.is_success() {
            self.failures += 1;
            bail!(
                "{}: status {status}: {}",
                self.name,
                String::from_utf8_lossy(&body)
            );
        }
        if let Some(decision) = decision {
            *self.decisions.entry(decision).or_default() += 1;
        }
        Ok((elapsed, upstream))
    }
}

/// Sends `samples` requests per case per repetition, interleaved request by request with the
/// case order rotating, after a warm-up (cache misses). For [`Workload::Hit`] each repetition first
/// sends every kvroute case's conversations' first turns through that case (not measured), has the
/// engine that served each one publish its blocks, waits until the index holds them, and then
/// measures the conversations' next turns; then those engines evict the repetition's first turns
/// ([`evict`]). Returns the kvroute cases' decision tally over the measured requests only.
pub(crate) async fn measure(
    cases: &mut [Case],
    engines: Option<&[MockVllmPublisher]>,
    prompts: &PromptSource,
    tokens: usize,
    workload: Workload,
    reps: usize,
    samples: usize,
) -> anyhow::Result<BTreeMap<String, Tally>> {
    for _ in 0..WARMUP_PER_CASE {
        for case in cases.iter_mut() {
            case.send(prompts.miss_body(tokens)).await?;
        }
    }
    for case in cases.iter_mut() {
        case.decisions.clear();
        case.samples = vec![Vec::with_capacity(samples); reps];
    }
    let mut tallies: BTreeMap<String, Tally> = BTreeMap::new();
    let n = cases.len();
    for rep in 0..reps {
        // The measured bodies of this repetition, per case.
        let mut bodies: Vec<Vec<Bytes>> = Vec::with_capacity(n);
        // (engine, block keys) of every first turn published this repetition, in order.
        let mut published: Vec<(usize, Vec<u64>)> = Vec::new();
        for case in cases.iter_mut() {
            // The first turns are not measured: their decisions are not counted.
            let measured_decisions = case.decisions.clone();
            let mut case_bodies = Vec::with_capacity(samples);
            for _ in 0..samples {
                let conversation = prompts.conversation(tokens);
                if workload == Workload::Miss {
                    case_bodies.push(PromptSource::body(&conversation.first));
                    continue;
                }
                if let (Some(admin), Some(engines)) = (case.kvroute, engines) {
                    let (_, served) = case
                        .send_to(PromptSource::body(&conversation.first))
                        .await?;
                    let served = served.context("upstream did not say who it is")?;
                    let engine = engines.get(served).context("no such engine")?;
                    let keys = publish_stored(engine, prompts, &conversation.first).await?;
                    if let Err(error) = wait_indexed(admin.index, served, &keys).await {
                        let state = index_state(admin.index).await.unwrap_or_default();
                        return Err(error.context(format!("the index: {state}")));
                    }
                    published.push((served, keys));
                }
                case_bodies.push(PromptSource::body(&conversation.next));
            }
            case.decisions = measured_decisions;
            bodies.push(case_bodies);
            // A next turn follows its first turn's answer (generation: far longer than a whole
            // tokenization), so ext-proc's background work for the first turns has ended first.
            if workload == Workload::Hit
                && let Some(admin) = case.kvroute
            {
                wait_background_idle(admin.ext_proc).await?;
            }
        }
        let mut before = Vec::new();
        for case in cases.iter() {
            before.push(match case.kvroute {
                Some(admin) => Some(Tally::scrape(admin.ext_proc).await?),
                None => None,
            });
        }
        let mut queues: Vec<_> = bodies.into_iter().map(Vec::into_iter).collect();
        for i in 0..samples {
            for k in 0..n {
                let c = (i + k) % n;
                let body = queues[c].next().context("a case ran out of bodies")?;
                let latency = cases[c].send(body).await?;
                cases[c].samples[rep].push(latency);
            }
        }
        for (case, before) in cases.iter().zip(before) {
            if let (Some(admin), Some(before)) = (case.kvroute, before) {
                let delta = Tally::scrape(admin.ext_proc).await?.minus(&before);
                tallies.entry(case.name.to_owned()).or_default().add(&delta);
            }
        }
        if let Some(engines) = engines {
            let indexes: Vec<SocketAddr> = cases
                .iter()
                .filter_map(|c| c.kvroute.map(|a| a.index))
                .collect();
            evict(engines, &indexes, &published).await?;
        }
    }
    Ok(tallies)
}

/// Has each engine publish, as vLLM does when its KV cache needs the room, one `BlockRemoved`
/// per first turn in `published`, and waits until every index in `indexes` has applied them.
///
/// Without this the engine doubles would hold every first turn of the run, and all on one engine
/// (the conversations share a system prompt, so once an engine holds its blocks every later
/// first turn is routed there). A 32k turn is about 2,050 blocks: a few hundred fill the index's
/// `max_blocks_per_replica` (1,000,000 by default), the index refuses the next turn's blocks
/// (`replica_capacity`) and the wait for them times out. No engine's cache holds that much (16M
/// tokens: terabytes of KV for an 8B model), and an index that large would make every match
/// colder than in production. Evicting once the repetition's next turns are measured keeps each
/// of them a real hit. One repetition's first turns must still fit in the cap: about 480 at 32k
/// (half that with both kvroute cases, whose first turns both indexes see).
async fn evict(
    engines: &[MockVllmPublisher],
    indexes: &[SocketAddr],
    published: &[(usize, Vec<u64>)],
) -> anyhow::Result<()> {
    // Each engine's last turn: one engine's events are applied in order, so once the index no
    // longer holds that turn's blocks, it holds none of the engine's earlier turns either.
    let mut last: BTreeMap<usize, &[u64]> = BTreeMap::new();
    for (served, keys) in published {
        let engine = engines.get(*served).context("no such engine")?;
        let removed = BlockRemoved {
            block_hashes: keys.clone(),
            medium: Medium::Gpu,
            group_idx: Some(0),
        };
        publish(engine, KvEvent::BlockRemoved(removed)).await?;
        last.insert(*served, keys);
    }
    for &index in indexes {
        for (&engine, keys) in &last {
            wait_matched(index, engine, keys, "no longer holds", |matched| {
                matched == 0
            })
            .await?;
        }
    }
    Ok(())
}

/// Publishes, as `engine`'s vLLM would after prefilling `messages`, one `BlockStored` with the
/// prompt's full blocks; returns their keys.
async fn publish_stored(
    engine: &MockVllmPublisher,
    prompts: &PromptSource,
    messages: &serde_json::Value,
) -> anyhow::Result<Vec<u64>> {
    let (tokens, keys) = prompts.block_keys(messages)?;
    let block_size = prompts.block_size as usize;
    let stored = BlockStored {
        block_hashes: keys.clone(),
        parent_block_hash: None,
        token_ids: tokens[..keys.len() * block_size].to_vec(),
        block_size: prompts.block_size,
        medium: Medium::Gpu,
        extra_keys: Some(vec![None; keys.len()]),
        group_idx: Some(0),
        ..BlockStored::default()
    };
    publish(engine, KvEvent::BlockStored(stored)).await?;
    Ok(keys)
}

/// Publishes `event` alone in one batch, as `engine`'s vLLM would.
async fn publish(engine: &MockVllmPublisher, event: KvEvent) -> anyhow::Result<()> {
    let batch = EventBatch {
        ts: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)?
            .as_secs_f64(),
        dp_rank: Some(0),
        events: vec![event],
    };
    engine
        .publish(wire::encode_batch(&batch, Encoding::V0_32))
        .await?;
    Ok(())
}

/// Waits until ext-proc at `admin` has no whole tokenization for a later turn queued or running
/// (`kvroute_extproc_tokenize_background_queued` 0).
async fn wait_background_idle(admin: SocketAddr) -> anyhow::Result<()> {
    try_poll_until(
        "ext-proc's background tokenizations ended",
        INDEX_SETTLE,
        || async move {
            let text = metrics_text(admin).await.ok()?;
            text.lines()
                .find_map(|line| line.strip_prefix("kvroute_extproc_tokenize_background_queued "))
                .is_some_and(|value| value.trim() == "0")
                .then_some(())
        },
    )
    .await?;
    Ok(())
}

/// Waits until the index at `admin` says `engine-{engine}` holds every block of `keys`.
async fn wait_indexed(admin: SocketAddr, engine: usize, keys: &[u64]) -> anyhow::Result<()> {
    let all = keys.len() as u64;
    wait_matched(admin, engine, keys, "holds", |matched| matched == all).await
}

/// Waits until the index at `admin` answers a match of `keys` with a number of leading blocks
/// of `engine-{engine}` (0 when it lists no such replica) for which `done` holds; `what` says
/// what that means, for the error.
async fn wait_matched(
    admin: SocketAddr,
    engine: usize,
    keys: &[u64],
    what: &str,
    done: impl Fn(u64) -> bool,
) -> anyhow::Result<()> {
    let client: Client<HttpConnector, Full<Bytes>> =
        Client::builder(TokioExecutor::new()).build_http();
    let body = Bytes::from(serde_json::json!({"model": MODEL, "prompt_keys": keys}).to_string());
    let id = format!("engine-{engine}");
    let url: hyper::Uri = format!("http://{admin}/v1/match").parse()?;
    let done = &done;
    try_poll_until(
        &format!("{id} {what} a published turn"),
        INDEX_SETTLE,
        || {
            let request = hyper::Request::post(url.clone())
                .header("content-type", "application/json")
                .body(Full::new(body.clone()));
            let client = client.clone();
            let id = id.clone();
            async move {
                let response = client.request(request.ok()?).await.ok()?;
                let bytes = response.into_body().collect().await.ok()?.to_bytes();
                let answer: serde_json::Value = serde_json::from_slice(&bytes).ok()?;
                let matched = answer["replicas"]
                    .as_array()?
                    .iter()
                    .find(|r| r["id"] == id.as_str())
                    .map_or(Some(0), |r| r["matched_blocks"].as_u64())?;
                done(matched).then_some(())
            }
        },
    )
    .await?;
    Ok(())
}

/// The index's held blocks per replica and its refused blocks by reason (`/metrics`), for an
/// error that says why a published turn did not arrive.
async fn index_state(admin: SocketAddr) -> anyhow::Result<String> {
    let text = metrics_text(admin).await?;
    let held = metrics::samples(&text, "kvroute_index_replica_blocks", &[]);
    let refused = metrics::samples(&text, "kvroute_index_blocks_rejected_total", &[])
        .filter(|&(_, value)| value > 0.0);
    Ok(held
        .chain(refused)
        .map(|(line, _)| line)
        .collect::<Vec<_>>()
        .join("; "))
}

/// kvroute-ext-proc's decision and fallback counters (`/metrics`), by label set.
#[derive(Debug, Clone, Default)]
pub(crate) struct Tally {
    /// `tier/reason` → decisions.
    pub(crate) decisions: BTreeMap<String, f64>,
    /// `stage/cause` → fallbacks.
    fallbacks: BTreeMap<String, f64>,
    /// Token source (`tokenize_duration_seconds{kind}`: `leading`, `tokenizer`, `cache`, …) →
    /// tokenizations; a decision that needed the whole prompt after its leading part counts twice.
    pub(crate) sources: BTreeMap<String, f64>,
}

impl Tally {
    async fn scrape(admin: SocketAddr) -> anyhow::Result<Self> {
        Ok(Self::from_text(&metrics_text(admin).await?))
    }

    /// The tally of one scrape of ext-proc's metrics (Prometheus text).
    pub(crate) fn from_text(text: &str) -> Self {
        let mut tally = Self::default();
        let families = [
            (
                "kvroute_extproc_decisions_total",
                &mut tally.decisions,
                ["tier", "reason"],
            ),
            (
                "kvroute_extproc_fallbacks_total",
                &mut tally.fallbacks,
                ["stage", "cause"],
            ),
            (
                "kvroute_extproc_tokenize_duration_seconds_count",
                &mut tally.sources,
                ["kind", ""],
            ),
        ];
        for (family, into, [first, second]) in families {
            for (line, value) in metrics::samples(text, family, &[]) {
                let label = |name| metrics::label(line, name).unwrap_or_default();
                let key = match second {
                    "" => label(first).to_owned(),
                    second => format!("{}/{}", label(first), label(second)),
                };
                *into.entry(key).or_default() += value;
            }
        }
        tally
    }

    pub(crate) fn minus(&self, before: &Self) -> Self {
        let diff = |after: &BTreeMap<String, f64>, before: &BTreeMap<String, f64>| {
            after
                .iter()
                .map(|(k, v)| (k.clone(), v - before.get(k).copied().unwrap_or(0.0)))
                .filter(|(_, v)| *v > 0.0)
                .collect()
        };
        Self {
            decisions: diff(&self.decisions, &before.decisions),
            fallbacks: diff(&self.fallbacks, &before.fallbacks),
            sources: diff(&self.sources, &before.sources),
        }
    }

    fn add(&mut self, other: &Self) {
        for (k, v) in &other.decisions {
            *self.decisions.entry(k.clone()).or_default() += v;
        }
        for (k, v) in &other.fallbacks {
            *self.fallbacks.entry(k.clone()).or_default() += v;
        }
        for (k, v) in &other.sources {
            *self.sources.entry(k.clone()).or_default() += v;
        }
    }
}

impl std::fmt::Display for Tally {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let list = |map: &BTreeMap<String, f64>| {
            if map.is_empty() {
                return "none".to_owned();
            }
            map.iter()
                .map(|(k, v)| format!("{k} {v:.0}"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        write!(
            f,
            "decisions (tier/reason): {}; fallbacks (stage/cause): {}; tokens from: {}",
            list(&self.decisions),
            list(&self.fallbacks),
            list(&self.sources)
        )
    }
}

/// The text of kvroute-ext-proc's `/metrics`.
pub(crate) async fn metrics_text(admin: SocketAddr) -> anyhow::Result<String> {
    let client: Client<HttpConnector, Full<Bytes>> =
        Client::builder(TokioExecutor::new()).build_http();
    let response = client
        .get(format!("http://{admin}/metrics").parse()?)
        .await?;
    Ok(String::from_utf8(
        response.into_body().collect().await?.to_bytes().to_vec(),
    )?)
}

fn percentile(sorted: &[Duration], q: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

/// p50 and p99 of `samples`.
pub(crate) fn quantiles(samples: &[Duration]) -> (Duration, Duration) {
    let mut sorted = samples.to_vec();
    sorted.sort();
    (percentile(&sorted, 0.50), percentile(&sorted, 0.99))
}

pub(crate) fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// Prints per-case p50/p99 (all repetitions pooled), added latency over `baseline`, and the
/// per-repetition ratios `numerator / denominator`, of the totals and of the added latency.
pub(crate) fn report(cases: &[Case], baseline: &str, ratios: &[(&str, &str)]) {
    let find = |name: &str| cases.iter().find(|c| c.name == name);
    let pooled = |case: &Case| quantiles(&case.samples.concat());
    let Some(base) = find(baseline) else { return };
    let (base50, base99) = pooled(base);
    println!("| case | n | p50 ms | p99 ms | added p50 ms | added p99 ms | p50 per rep (ms) |");
    println!("|---|---:|---:|---:|---:|---:|---|");
    for case in cases {
        let (p50, p99) = pooled(case);
        let per_rep: Vec<String> = case
            .samples
            .iter()
            .map(|s| format!("{:.3}", ms(quantiles(s).0)))
            .collect();
        println!(
            "| {} | {} | {:.3} | {:.3} | {:+.3} | {:+.3} | {} |",
            case.name,
            case.samples.iter().map(Vec::len).sum::<usize>(),
            ms(p50),
            ms(p99),
            ms(p50) - ms(base50),
            ms(p99) - ms(base99),
            per_rep.join(", ")
        );
    }
    println!();
    for (num, den) in ratios {
        let (Some(num_case), Some(den_case)) = (find(num), find(den)) else {
            continue;
        };
        let ratio_of = |q: usize| {
            let per_rep: Vec<String> = num_case
                .samples
                .iter()
                .zip(&den_case.samples)
                .zip(&base.samples)
                .map(|((n, d), b)| {
                    let pick = |s: &[Duration]| {
                        let (p50, p99) = quantiles(s);
                        ms(if q == 50 { p50 } else { p99 })
                    };
                    format!(
                        "{:.2}× (added {:.2}×)",
                        pick(n) / pick(d),
                        (pick(n) - pick(b)) / (pick(d) - pick(b))
                    )
                })
                .collect();
            per_rep.join(", ")
        };
        let (n50, n99) = pooled(num_case);
        let (d50, d99) = pooled(den_case);
        println!(
            "- {num}/{den}: p50 {:.2}× (added {:.2}×), p99 {:.2}× (added {:.2}×) pooled; per rep p50: {}; per rep p99: {}",
            ms(n50) / ms(d50),
            (ms(n50) - ms(base50)) / (ms(d50) - ms(base50)),
            ms(n99) / ms(d99),
            (ms(n99) - ms(base99)) / (ms(d99) - ms(base99)),
            ratio_of(50),
            ratio_of(99),
        );
    }
    for case in cases.iter().filter(|c| !c.decisions.is_empty()) {
        println!(
            "- {} decisions (tier/reason): {:?}",
            case.name, case.decisions
        );
    }
    println!();
}

pub(crate) fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "?".to_owned())
}
