//! Picker decisions per CPU second, in-process.

use super::*;

/// What the picker bench's requests are.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum PickerStream {
    /// Chat streams with reuse ([`PromptSource::chat_stream`]): new and resumed conversations of
    /// four applications, each with its system prompt and tool definitions.
    Reuse,
    /// Every request a new conversation, nothing shared but the system prompt's first words.
    Unique,
}

/// Loops `Picker::decide` (body parse → tokenize → keys → [index Match] → score) on a
/// current-thread runtime in a thread of its own, for each prompt size, without an index, with an
/// in-process kvroute-index over gRPC and with it embedded. After each decision the chosen engine
/// publishes the prompt's new blocks, as vLLM would once it has computed them, and the bench waits
/// until ext-proc's background lane is idle, so every whole tokenization a decision leaves behind
/// is done and counted (none skipped). The picker's CPU is that of every thread of the process but
/// the index service's and the engines' (their runtime, threads named `bench-index`): the decision
/// thread, its blocking pool and the background lane. The index's own CPU (serving `Match` over
/// gRPC, applying the engines' events) is a column of its own. The baseline is the body parse
/// alone, which any picker that reads the request pays.
pub(super) fn picker_bench(
    prompts: &PromptSource,
    sizes: &[usize],
    indexes: &[PickerIndex],
    decisions_1k: usize,
    stream: PickerStream,
    cold: bool,
) -> anyhow::Result<()> {
    println!(
        "## picker: decide() in-process, one thread at a time, {} requests, caches {}, load {}\n",
        match stream {
            PickerStream::Reuse =>
                "chat streams with reuse (⅓ new conversations, ⅔ resumed; 4 applications' system prompts and tools)",
            PickerStream::Unique => "unique",
        },
        if cold {
            "evicted before each decision"
        } else {
            "warm"
        },
        load_average()
    );
    println!(
        "| prompt | index | decisions | mean tokens | wall s | picker CPU s | decisions / CPU s | µs CPU / decision | µs / decision | index CPU s | tiers | tokens from |"
    );
    println!("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|");
    for &tokens in sizes {
        let count = (decisions_1k * SIZES[0] / tokens).max(20);
        // One more than measured: the first is the untimed warm-up.
        let requests = match stream {
            PickerStream::Reuse => prompts.chat_stream(tokens, count + 1)?,
            PickerStream::Unique => (0..=count)
                .map(|_| prompts.unique_request(tokens))
                .collect::<anyhow::Result<_>>()?,
        };
        let requests = std::sync::Arc::new(requests);
        let mean_tokens =
            requests[1..].iter().map(|r| r.tokens.len()).sum::<usize>() / (requests.len() - 1);
        let baseline = parse_baseline(&requests[1..])?;
        let first_turns = requests[1..].iter().filter(|r| r.turn == 1).count();
        println!(
            "| {tokens} | baseline: body parse alone | {} | {mean_tokens} | | | {:.0} | {:.1} | {:.1} | | {first_turns} first turns, {} resumed | |",
            requests.len() - 1,
            1.0 / baseline.as_secs_f64(),
            baseline.as_secs_f64() * 1e6,
            baseline.as_secs_f64() * 1e6,
            requests.len() - 1 - first_turns,
        );
        for &index in indexes {
            let row = std::thread::scope(|scope| {
                std::thread::Builder::new()
                    .name("bench-picker".to_owned())
                    .spawn_scoped(scope, || picker_run(prompts, &requests, index, cold))?
                    .join()
                    .map_err(|_| anyhow::anyhow!("picker thread panicked"))?
            })?;
            let decisions = row.decisions as f64;
            println!(
                "| {tokens} | {} | {} | {mean_tokens} | {:.2} | {:.3} | {:.0} | {:.0} | {:.0} | {:.3} | {} | {} |",
                match index {
                    PickerIndex::None => "none (events: false)",
                    PickerIndex::Grpc => "kvroute-index in-process, Match over gRPC",
                    PickerIndex::Embedded => "embedded (`index.embedded`: Match in memory)",
                },
                row.decisions,
                row.wall.as_secs_f64(),
                row.cpu.as_secs_f64(),
                decisions / row.cpu.as_secs_f64(),
                1e6 * row.cpu.as_secs_f64() / decisions,
                1e6 * row.deciding.as_secs_f64() / decisions,
                row.index_cpu.as_secs_f64(),
                tally_line(&row.tally.decisions),
                tally_line(&row.tally.sources),
            );
        }
    }
    println!();
    Ok(())
}

/// `key n, key n` of a tally.
fn tally_line(tally: &BTreeMap<String, f64>) -> String {
    tally
        .iter()
        .map(|(key, n)| format!("{key} {n}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// CPU time of one body parse, the mean over every request of `requests` parsed enough times for
/// the thread's CPU clock to resolve it.
fn parse_baseline(requests: &[StreamRequest]) -> anyhow::Result<Duration> {
    const PASSES: usize = 20;
    let before = this_thread_cpu()?;
    for _ in 0..PASSES {
        for request in requests {
            std::hint::black_box(request::parse(&request.body, Endpoint::ChatCompletions)?);
        }
    }
    Ok((this_thread_cpu()? - before) / (PASSES * requests.len()) as u32)
}

struct PickerRun {
    decisions: usize,
    wall: Duration,
    /// Time inside parse + `decide` alone.
    deciding: Duration,
    /// CPU of every thread but the index service's and the engines'.
    cpu: Duration,
    /// CPU of the index service's and the engines' threads.
    index_cpu: Duration,
    tally: Tally,
}

/// How the picker bench's decisions reach the index.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum PickerIndex {
    /// No index (`events: false`): the approximate tier.
    None,
    /// kvroute-index in-process, `Match` over gRPC.
    Grpc,
    /// `index.embedded`: `Match` in memory.
    Embedded,
}

/// Served requests handed to the engines at once.
const SERVED_BATCH: usize = 8;

/// Name of the index service's and the engines' threads, whose CPU is not the picker's.
const INDEX_THREADS: &str = "bench-index";

fn picker_run(
    prompts: &PromptSource,
    requests: &std::sync::Arc<Vec<StreamRequest>>,
    mode: PickerIndex,
    cold: bool,
) -> anyhow::Result<PickerRun> {
    // The index service and the engines' publishers on a runtime of their own, so their CPU is
    // told apart from the picker's.
    let index_runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name(INDEX_THREADS)
        .enable_all()
        .build()?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .max_blocking_threads(1)
        .build()?;
    runtime.block_on(async {
        let upstreams: Vec<SocketAddr> =
            vec!["127.0.0.1:18001".parse()?, "127.0.0.1:18002".parse()?];
        let (served, engines) = tokio::sync::mpsc::unbounded_channel::<Vec<(usize, usize)>>();
        let mut engines_task = None;
        let mut index = None;
        if mode != PickerIndex::None {
            let block_size = prompts.block_size;
            let (started, publishers) = index_runtime
                .spawn(async move {
                    let (publishers, replicas) = start_engines(2).await?;
                    let config = kvroute_index::config::Config::from_yaml(&index_yaml(
                        &replicas, block_size,
                    ))?;
                    let server = kvroute_index::server::IndexServer::start(config).await?;
                    anyhow::Ok((server, publishers))
                })
                .await??;
            engines_task = Some(index_runtime.spawn(serve_blocks(
                std::sync::Arc::clone(requests),
                publishers,
                engines,
                block_size as usize,
            )));
            index = Some(started);
        }
        let index_mode = match (&index, mode) {
            (Some(index), PickerIndex::Grpc) => IndexMode::Remote(index.grpc_addr()),
            _ => IndexMode::None,
        };
        let mut config = kvroute_ext_proc::Config::from_yaml(&ext_proc_config(
            &upstreams,
            &index_mode,
            &prompts.model_dir,
            prompts.block_size,
        ))?;
        let tasks = TaskTracker::new();
        if mode == PickerIndex::Embedded {
            // `ExtProc::bind` does this for `index.embedded`; here the index is already running.
            config.pools[0].events = true;
        }
        let mut picker_runtime = kvroute_ext_proc::Runtime::build(config, None, &tasks)?;
        if let (Some(index), PickerIndex::Embedded) = (&index, mode) {
            picker_runtime = picker_runtime.with_local_index(index.matcher());
        }
        let mut registry = prometheus_client::registry::Registry::default();
        let metrics = kvroute_ext_proc::metrics::Metrics::register(&mut registry);
        let background = metrics.tokenize_background_queued.clone();
        let picker = kvroute_ext_proc::Picker::new(picker_runtime, metrics, tasks.clone());
        let tally = || -> anyhow::Result<Tally> {
            let mut text = String::new();
            prometheus_client::encoding::text::encode(&mut text, &registry)?;
            Ok(Tally::from_text(&text))
        };

        // Which engine a decision chose.
        let engine_of = |decision: kvroute_ext_proc::Decision| {
            upstreams
                .iter()
                .position(|a| *a == decision.address)
                .context("decision names no upstream")
        };
        // One untimed decision: connects the index client, starts the blocking pool.
        let warm = request::parse(&requests[0].body, Endpoint::ChatCompletions)?;
        let engine = engine_of(picker.decide(&warm, None).await?)?;
        if index.is_some() {
            let _ = served.send(vec![(0, engine)]);
        }
        idle(&background).await;
        // Served requests are handed to the engines a few at a time: waking their runtime is a
        // cost of the bench, not of the picker, and it is paid on the picker's thread.
        let mut batch = Vec::with_capacity(SERVED_BATCH);

        let tally_before = tally()?;
        let cpu_before = threads_cpu()?;
        let started = Instant::now();
        // Larger than any last-level cache here; one write per cache line evicts the picker's data.
        let mut evictor = if cold {
            vec![0u8; 32 << 20]
        } else {
            Vec::new()
        };
        let mut deciding = Duration::ZERO;
        for (i, request) in requests.iter().enumerate().skip(1) {
            for line in evictor.iter_mut().step_by(64) {
                *line = line.wrapping_add(1);
            }
            std::hint::black_box(&mut evictor);
            let decision_started = Instant::now();
            let parsed = request::parse(&request.body, Endpoint::ChatCompletions)?;
            let decision = picker.decide(&parsed, None).await?;
            deciding += decision_started.elapsed();
            let engine = engine_of(decision)?;
            if index.is_some() {
                batch.push((i, engine));
                if batch.len() == SERVED_BATCH {
                    let _ = served.send(std::mem::replace(
                        &mut batch,
                        Vec::with_capacity(SERVED_BATCH),
                    ));
                }
            }
            idle(&background).await;
        }
        let wall = started.elapsed();
        let (cpu, index_cpu) = cpu_since(&cpu_before, &threads_cpu()?);
        let tally = tally()?.minus(&tally_before);
        drop(picker);
        tasks.close();
        drop(served);
        if let Some(engines) = engines_task {
            let publishers = engines.await??;
            for publisher in publishers {
                publisher.shutdown().await;
            }
        }
        if let Some(index) = index {
            index.shutdown().await;
        }
        Ok(PickerRun {
            decisions: requests.len() - 1,
            wall,
            deciding,
            cpu,
            index_cpu,
            tally,
        })
    })
}

/// Waits until ext-proc's background lane has no whole tokenization queued or running.
async fn idle(queued: &prometheus_client::metrics::gauge::Gauge) {
    while queued.get() > 0 {
        tokio::time::sleep(Duration::from_micros(100)).await;
    }
}

/// The engines: for each `(request, engine)` served, that engine publishes the prompt's full
/// blocks it did not hold yet, in one `BlockStored` chained to the last block it held, as vLLM
/// does after computing a prompt. Returns the publishers when the channel closes.
async fn serve_blocks(
    requests: std::sync::Arc<Vec<StreamRequest>>,
    publishers: Vec<MockVllmPublisher>,
    mut served: tokio::sync::mpsc::UnboundedReceiver<Vec<(usize, usize)>>,
    block_size: usize,
) -> anyhow::Result<Vec<MockVllmPublisher>> {
    let mut held: Vec<std::collections::HashSet<u64>> = vec![Default::default(); publishers.len()];
    while let Some(batch) = served.recv().await {
        for (request, engine) in batch {
            publish_new_blocks(
                &requests,
                &publishers,
                &mut held,
                request,
                engine,
                block_size,
            )
            .await?;
        }
    }
    Ok(publishers)
}

/// Has `engine` publish the full blocks of `request`'s prompt it does not hold yet.
async fn publish_new_blocks(
    requests: &[StreamRequest],
    publishers: &[MockVllmPublisher],
    held: &mut [std::collections::HashSet<u64>],
    request: usize,
    engine: usize,
    block_size: usize,
) -> anyhow::Result<()> {
    let request = requests.get(request).context("no such request")?;
    let publisher = publishers.get(engine).context("no such engine")?;
    let first_new = request
        .keys
        .iter()
        .position(|key| !held[engine].contains(key))
        .unwrap_or(request.keys.len());
    if first_new == request.keys.len() {
        return Ok(());
    }
    held[engine].extend(&request.keys[first_new..]);
    let stored = BlockStored {
        block_hashes: request.keys[first_new..].to_vec(),
        parent_block_hash: first_new.checked_sub(1).map(|i| request.keys[i]),
        token_ids: request.tokens[first_new * block_size..request.keys.len() * block_size].to_vec(),
        block_size: block_size as u32,
        medium: Medium::Gpu,
        extra_keys: Some(vec![None; request.keys.len() - first_new]),
        group_idx: Some(0),
        ..BlockStored::default()
    };
    let batch = EventBatch {
        ts: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)?
            .as_secs_f64(),
        dp_rank: Some(0),
        events: vec![KvEvent::BlockStored(stored)],
    };
    publisher
        .publish(wire::encode_batch(&batch, Encoding::V0_32))
        .await?;
    Ok(())
}

/// CPU time of each live thread of this process (`/proc/self/task/*/schedstat`, nanoseconds), by
/// thread id, with whether it is one of the [`INDEX_THREADS`].
fn threads_cpu() -> anyhow::Result<BTreeMap<u32, (bool, Duration)>> {
    let mut threads = BTreeMap::new();
    for entry in std::fs::read_dir("/proc/self/task")? {
        let path = entry?.path();
        let Some(tid) = path.file_name().and_then(|n| n.to_str()?.parse().ok()) else {
            continue;
        };
        // A thread that ended since the listing has no files left: it is not counted.
        let (Ok(name), Ok(schedstat)) = (
            std::fs::read_to_string(path.join("comm")),
            std::fs::read_to_string(path.join("schedstat")),
        ) else {
            continue;
        };
        let nanos: u64 = schedstat
            .split_whitespace()
            .next()
            .context("empty schedstat")?
            .parse()?;
        threads.insert(
            tid,
            (name.starts_with(INDEX_THREADS), Duration::from_nanos(nanos)),
        );
    }
    Ok(threads)
}

/// CPU spent between two [`threads_cpu`] snapshots by the picker's threads and by the index's
/// (a thread born between them counts from zero).
fn cpu_since(
    before: &BTreeMap<u32, (bool, Duration)>,
    after: &BTreeMap<u32, (bool, Duration)>,
) -> (Duration, Duration) {
    let (mut picker, mut index) = (Duration::ZERO, Duration::ZERO);
    for (tid, &(is_index, now)) in after {
        let spent = now.saturating_sub(before.get(tid).map_or(Duration::ZERO, |&(_, t)| t));
        if is_index {
            index += spent;
        } else {
            picker += spent;
        }
    }
    (picker, index)
}

/// CPU time of the calling thread (`/proc/thread-self/schedstat`, nanoseconds).
fn this_thread_cpu() -> anyhow::Result<Duration> {
    let schedstat = std::fs::read_to_string("/proc/thread-self/schedstat")?;
    Ok(Duration::from_nanos(
        schedstat
            .split_whitespace()
            .next()
            .context("empty schedstat")?
            .parse()?,
    ))
}

/// Pool sizes of the fleet bench.
const FLEET_SIZES: [usize; 3] = [16, 256, 1024];

/// One decision in this many, the first ones, is warm-up and left out of the fleet bench's
/// latencies.
const FLEET_WARMUP_SHARE: usize = 10;

/// How decision latency and memory grow with the pool: `decide` over pools of 16, 256 and 1,024
/// replicas (static, no index: the approximate tier's routed-prefix memory and the load board
/// are the per-replica state a decision reads), on 1k-token chats where half the requests repeat
/// an earlier conversation's prompt (so prefixes are remembered across the pool).
///
/// Latency is measured with the sizes interleaved in one process, decision by decision (one
/// picker per size, each request decided by every picker in turn): a shared host's noise — another
/// job on the core, a slow page fault — then falls on every size alike, and the ratio of their
/// p99s compares the pools rather than the moments they ran in (run one after the other, that
/// ratio swung by ±0.4 from run to run), with the allocator's defaults. Memory is measured with
/// each size alone in a fresh process ([`fleet_one`]) that returns freed pages at once, so one
/// size's freed pages, kept by the allocator, do not hide the next one's growth: memory per
/// replica is the slope of the resident growth between the smallest and the largest pool.
/// Those runs' latencies are printed too, as a cross-check. The first tenth of each size's
/// decisions is left out; over a few thousand decisions the tokenizer's caches are still
/// filling, and its slow first encodings set every size's p99 alike (16,000 decisions measure
/// the steady state).
pub(super) fn fleet_bench(
    model_dir: &std::path::Path,
    block_size: u32,
    decisions: usize,
) -> anyhow::Result<()> {
    println!(
        "## fleet: decide() over pools of {FLEET_SIZES:?} replicas, 1k-token chats (half repeats), load {}\n",
        load_average()
    );
    let run = |sizes: &[usize], for_memory: bool| -> anyhow::Result<Vec<FleetOne>> {
        let list: Vec<String> = sizes.iter().map(usize::to_string).collect();
        let mut command = std::process::Command::new(std::env::current_exe()?);
        command
            .arg("--bench=fleet")
            .arg(format!("--fleet-replicas={}", list.join(",")))
            .arg(format!("--picker-decisions={decisions}"))
            .arg(format!("--block-size={block_size}"))
            .arg("--model-dir")
            .arg(model_dir);
        if for_memory {
            // Freed pages go back to the system at once: resident growth then tracks live state.
            // (Not for latency: a large pool's per-decision vectors would then fault their
            // pages in anew every time, which the allocator's default spares them.)
            command.env("MIMALLOC_PURGE_DELAY", "0");
        }
        let output = command.output()?;
        let stdout = String::from_utf8_lossy(&output.stdout);
        let measured = stdout
            .lines()
            .filter_map(|line| line.strip_prefix("fleet-one "))
            .map(FleetOne::parse)
            .collect::<anyhow::Result<Vec<_>>>()?;
        if measured.len() != sizes.len() {
            anyhow::bail!(
                "the run over {sizes:?} replicas printed {} results ({}): {}",
                measured.len(),
                output.status,
                String::from_utf8_lossy(&output.stderr)
            );
        }
        Ok(measured)
    };
    let together = run(&FLEET_SIZES, false)?;
    let alone = FLEET_SIZES
        .iter()
        .map(|&replicas| Ok(run(&[replicas], true)?.remove(0)))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let (Some(base), Some(base_alone)) = (together.first(), alone.first()) else {
        anyhow::bail!("no pool size measured");
    };
    println!(
        "| replicas | decisions | p50 µs | p99 µs | p99 / p99 at {} | alone, freed pages returned at once: p50 / p99 µs, p99 / p99 at {} | resident growth, alone |",
        FLEET_SIZES[0], FLEET_SIZES[0]
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|");
    for (one, lone) in together.iter().zip(&alone) {
        println!(
            "| {} | {} | {:.0} | {:.0} | {:.2} | {:.0} / {:.0}, {:.2} | {:.1} MiB |",
            one.replicas,
            one.decisions,
            one.p50_us,
            one.p99_us,
            one.p99_us / base.p99_us,
            lone.p50_us,
            lone.p99_us,
            lone.p99_us / base_alone.p99_us,
            lone.growth_bytes / f64::from(1 << 20)
        );
    }
    if let (Some(small), Some(large)) = (alone.first(), alone.last()) {
        println!(
            "\nmemory per replica (resident growth, {} vs {} replicas): {:.1} KiB\n",
            large.replicas,
            small.replicas,
            (large.growth_bytes - small.growth_bytes)
                / 1024.0
                / (large.replicas - small.replicas) as f64
        );
    }
    Ok(())
}

/// One pool size's result, as a `fleet-one` line carries it.
struct FleetOne {
    replicas: usize,
    decisions: usize,
    p50_us: f64,
    p99_us: f64,
    growth_bytes: f64,
}

impl FleetOne {
    fn parse(line: &str) -> anyhow::Result<Self> {
        let fields: Vec<f64> = line
            .split_whitespace()
            .map(str::parse)
            .collect::<Result<_, _>>()
            .with_context(|| format!("malformed fleet-one line {line:?}"))?;
        let [replicas, decisions, p50_us, p99_us, growth_bytes] = fields[..] else {
            anyhow::bail!("malformed fleet-one line {line:?}");
        };
        Ok(Self {
            replicas: replicas as usize,
            decisions: decisions as usize,
            p50_us,
            p99_us,
            growth_bytes,
        })
    }
}

/// Pool sizes of [`fleet_bench`], in this process, interleaved decision by decision: prints one
/// `fleet-one <replicas> <decisions> <p50 µs> <p99 µs> <resident growth bytes>` line per size,
/// the growth measured from before the pickers are built to after the run, with the pickers and
/// their state alive (one size's own only when it runs alone).
pub(super) fn fleet_one(
    prompts: &PromptSource,
    decisions: usize,
    sizes: &[usize],
) -> anyhow::Result<()> {
    let fresh: Vec<Bytes> = (0..decisions / 2)
        .map(|_| prompts.miss_body(SIZES[0]))
        .collect();
    // Every other request repeats one of the earlier conversations.
    let bodies: Vec<Bytes> = fresh
        .iter()
        .enumerate()
        .flat_map(|(i, body)| [body.clone(), fresh[i / 2].clone()])
        .collect();
    // Its own runtime on a thread of its own (the bench's runtime is running this).
    let (per_size, growth) = std::thread::scope(|scope| {
        scope
            .spawn(|| fleet_run(prompts, &bodies, sizes))
            .join()
            .map_err(|_| anyhow::anyhow!("fleet thread panicked"))?
    })?;
    for (replicas, latencies) in sizes.iter().zip(per_size) {
        // The first tenth warms caches and allocator pools up: left out, as the replay leaves
        // out its first requests (kept in, they raised every size's p99 alike and squeezed the
        // ratio between sizes toward 1).
        let mut latencies = latencies[latencies.len() / FLEET_WARMUP_SHARE..].to_vec();
        latencies.sort_unstable();
        let at = |q: f64| latencies[((latencies.len() - 1) as f64 * q) as usize];
        println!(
            "fleet-one {replicas} {} {:.1} {:.1} {growth}",
            latencies.len(),
            at(0.5).as_secs_f64() * 1e6,
            at(0.99).as_secs_f64() * 1e6,
        );
    }
    Ok(())
}

/// Each size's decision latencies, and the resident growth from before the pickers were built
/// to after the run (pickers alive). Every request is decided by each size's picker in turn,
/// starting one further along for each request, so no size always runs right after the parse
/// of a new body or right before the next.
fn fleet_run(
    prompts: &PromptSource,
    bodies: &[Bytes],
    sizes: &[usize],
) -> anyhow::Result<(Vec<Vec<Duration>>, u64)> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .max_blocking_threads(1)
        .build()?;
    runtime.block_on(async {
        let rss_before = resident_bytes()?;
        let tasks = TaskTracker::new();
        let mut pickers = Vec::with_capacity(sizes.len());
        for &replicas in sizes {
            let upstreams: Vec<SocketAddr> = (0..replicas)
                .map(|i| SocketAddr::from(([127, 0, 0, 1], 20_000 + i as u16)))
                .collect();
            let config = kvroute_ext_proc::Config::from_yaml(&ext_proc_config(
                &upstreams,
                &IndexMode::None,
                &prompts.model_dir,
                prompts.block_size,
            ))?;
            let runtime = kvroute_ext_proc::Runtime::build(config, None, &tasks)?;
            let mut registry = prometheus_client::registry::Registry::default();
            let metrics = kvroute_ext_proc::metrics::Metrics::register(&mut registry);
            let picker = kvroute_ext_proc::Picker::new(runtime, metrics, tasks.clone());
            let warm = request::parse(&bodies[0], Endpoint::ChatCompletions)?;
            drop(picker.decide(&warm, None).await?);
            pickers.push(picker);
        }
        let mut latencies = vec![Vec::with_capacity(bodies.len()); sizes.len()];
        // Decisions stay in flight (their guards held) as under load, 64 per picker.
        let mut held: Vec<std::collections::VecDeque<_>> = sizes
            .iter()
            .map(|_| std::collections::VecDeque::new())
            .collect();
        for (turn, body) in bodies[1..].iter().enumerate() {
            for step in 0..sizes.len() {
                let which = (turn + step) % sizes.len();
                let started = Instant::now();
                let parsed = request::parse(body, Endpoint::ChatCompletions)?;
                let decision = pickers[which].decide(&parsed, None).await?;
                latencies[which].push(started.elapsed());
                held[which].push_back(decision);
                if held[which].len() > 64 {
                    held[which].pop_front();
                }
            }
        }
        drop(held);
        let growth = resident_bytes()?.saturating_sub(rss_before);
        drop(pickers);
        tasks.close();
        Ok((latencies, growth))
    })
}

/// This process's resident set size (`/proc/self/statm`, pages of 4 KiB).
fn resident_bytes() -> anyhow::Result<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm")?;
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .context("malformed /proc/self/statm")?
        .parse()?;
    Ok(pages * 4096)
}
