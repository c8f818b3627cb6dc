//! Picker decisions per CPU second, in-process.

use super::*;

/// Loops `Picker::decide` (body parse → tokenize → keys → [index Match] → score) on a
/// current-thread runtime in a thread of its own, for each prompt size, without and with an
/// in-process kvroute-index. CPU time is the whole process's (`/proc/self/stat`): tokenization runs
/// on the blocking pool and the index serves in-process, and both belong to a decision's cost.
pub(super) fn picker_bench(
    prompts: &PromptSource,
    decisions_1k: usize,
    cold: bool,
) -> anyhow::Result<()> {
    println!(
        "## picker: decide() in-process, one thread at a time, caches {}, load {}\n",
        if cold {
            "evicted before each decision"
        } else {
            "warm"
        },
        load_average()
    );
    println!(
        "| prompt | index | decisions | wall s | CPU s | decisions / CPU s | decisions / wall s | µs / decision | tiers |"
    );
    println!("|---|---|---:|---:|---:|---:|---:|---:|---|");
    for tokens in SIZES {
        let count = (decisions_1k * SIZES[0] / tokens).max(10);
        for index in [PickerIndex::None, PickerIndex::Grpc, PickerIndex::Embedded] {
            let bodies: Vec<Bytes> = (0..count).map(|_| prompts.miss_body(tokens)).collect();
            let row = std::thread::scope(|scope| {
                scope
                    .spawn(|| picker_run(prompts, &bodies, index, cold))
                    .join()
                    .map_err(|_| anyhow::anyhow!("picker thread panicked"))?
            })?;
            println!(
                "| {tokens} | {} | {} | {:.2} | {:.2} | {:.0} | {:.0} | {:.0} | {:?} |",
                match index {
                    PickerIndex::None => "none (events: false)",
                    PickerIndex::Grpc => "kvroute-index in-process, Match over gRPC",
                    PickerIndex::Embedded => "embedded (`index.embedded`: Match in memory)",
                },
                row.decisions,
                row.wall.as_secs_f64(),
                row.cpu.as_secs_f64(),
                row.decisions as f64 / row.cpu.as_secs_f64(),
                row.decisions as f64 / row.wall.as_secs_f64(),
                1e6 * row.deciding.as_secs_f64() / row.decisions as f64,
                row.tiers,
            );
        }
    }
    println!();
    Ok(())
}

struct PickerRun {
    decisions: usize,
    wall: Duration,
    /// Time inside parse + `decide` alone.
    deciding: Duration,
    cpu: Duration,
    tiers: BTreeMap<String, usize>,
}

/// How the picker bench's decisions reach the index.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PickerIndex {
    None,
    Grpc,
    Embedded,
}

fn picker_run(
    prompts: &PromptSource,
    bodies: &[Bytes],
    mode: PickerIndex,
    cold: bool,
) -> anyhow::Result<PickerRun> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .max_blocking_threads(1)
        .build()?;
    runtime.block_on(async {
        let upstreams: Vec<SocketAddr> = vec!["127.0.0.1:18001".parse()?, "127.0.0.1:18002".parse()?];
        let mut publishers = Vec::new();
        let mut index = None;
        if mode != PickerIndex::None {
            let mut replicas = String::new();
            for i in 0..2 {
                let publisher = MockVllmPublisher::start(MockPublisherConfig {
                    topic: "kv@".to_owned(),
                    ..MockPublisherConfig::loopback()
                })
                .await?;
                replicas.push_str(&format!(
                    "  - {{id: engine-{i}, pool: {MODEL}, events: {{endpoint: \"{}\", replay_endpoint: \"{}\", topic: \"kv@\"}}}}\n",
                    publisher.pub_endpoint().context("publisher endpoint")?,
                    publisher.replay_endpoint().context("replay endpoint")?,
                ));
                publishers.push(publisher);
            }
            let config = kvroute_index::config::Config::from_yaml(&index_yaml(
                &replicas,
                prompts.block_size,
            ))?;
            index = Some(kvroute_index::server::IndexServer::start(config).await?);
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
        let mut runtime = kvroute_ext_proc::Runtime::build(config, None, &tasks)?;
        if let (Some(index), PickerIndex::Embedded) = (&index, mode) {
            runtime = runtime.with_local_index(index.matcher());
        }
        let mut registry = prometheus_client::registry::Registry::default();
        let metrics = kvroute_ext_proc::metrics::Metrics::register(&mut registry);
        let picker = kvroute_ext_proc::Picker::new(runtime, metrics, tasks.clone());

        // One untimed decision: connects the index client, starts the blocking pool.
        let mut tiers = BTreeMap::new();
        let warm = request::parse(&bodies[0], Endpoint::ChatCompletions)?;
        drop(picker.decide(&warm, None).await?);

        let cpu_before = process_cpu()?;
        let started = Instant::now();
        // Larger than any last-level cache here; one write per cache line evicts the picker's data.
        let mut evictor = if cold { vec![0u8; 32 << 20] } else { Vec::new() };
        let mut deciding = Duration::ZERO;
        for body in &bodies[1..] {
            for line in evictor.iter_mut().step_by(64) {
                *line = line.wrapping_add(1);
            }
            std::hint::black_box(&mut evictor);
            let decision_started = Instant::now();
            let parsed = request::parse(body, Endpoint::ChatCompletions)?;
            let decision = picker.decide(&parsed, None).await?;
            deciding += decision_started.elapsed();
            *tiers
                .entry(format!("{}/{}", decision.tier.as_label(), decision.reason))
                .or_insert(0usize) += 1;
        }
        let wall = started.elapsed();
        let cpu = process_cpu()? - cpu_before;
        tasks.close();
        if let Some(index) = index {
            index.shutdown().await;
        }
        for publisher in publishers {
            publisher.shutdown().await;
        }
        Ok(PickerRun {
            decisions: bodies.len() - 1,
            wall,
            deciding,
            cpu,
            tiers,
        })
    })
}

/// User + system CPU time of this process so far (`/proc/self/stat`, in clock ticks of 1/100 s).
fn process_cpu() -> anyhow::Result<Duration> {
    const TICKS_PER_SECOND: f64 = 100.0;
    let stat = std::fs::read_to_string("/proc/self/stat")?;
    // Fields after the parenthesised command name; utime and stime are fields 14 and 15.
    let rest = stat
        .rsplit_once(')')
        .context("malformed /proc/self/stat")?
        .1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| -> anyhow::Result<f64> {
        Ok(fields
            .get(i)
            .context("short /proc/self/stat")?
            .parse::<f64>()?)
    };
    Ok(Duration::from_secs_f64(
        (ticks(11)? + ticks(12)?) / TICKS_PER_SECOND,
    ))
}

/// Pool sizes of the fleet bench.
const FLEET_SIZES: [usize; 3] = [16, 256, 1024];

/// How decision latency and memory grow with the pool: `decide` over pools of 16, 256 and 1,024
/// replicas (static, no index: the approximate tier's routed-prefix memory and the load board
/// are the per-replica state a decision reads), on 1k-token chats where half the requests repeat
/// an earlier conversation's prompt (so prefixes are remembered across the pool). Each size runs
/// in a fresh process of its own ([`fleet_one`]), so one size's freed pages, kept by the
/// allocator, do not hide the next one's growth: memory per replica is the slope of the resident
/// growth between the smallest and the largest pool.
pub(super) fn fleet_bench(
    model_dir: &std::path::Path,
    block_size: u32,
    decisions: usize,
) -> anyhow::Result<()> {
    println!(
        "## fleet: decide() over pools of {FLEET_SIZES:?} replicas, 1k-token chats (half repeats), each size in a fresh process, load {}\n",
        load_average()
    );
    println!(
        "| replicas | decisions | p50 µs | p99 µs | p99 / p99 at {} | resident growth |",
        FLEET_SIZES[0]
    );
    println!("|---:|---:|---:|---:|---:|---:|");
    let exe = std::env::current_exe()?;
    let mut measured = Vec::new();
    for replicas in FLEET_SIZES {
        let output = std::process::Command::new(&exe)
            .arg("--bench=fleet")
            .arg(format!("--fleet-replicas={replicas}"))
            .arg(format!("--picker-decisions={decisions}"))
            .arg(format!("--block-size={block_size}"))
            .arg("--model-dir")
            .arg(model_dir)
            // Freed pages go back to the system at once: resident growth then tracks live state.
            .env("MIMALLOC_PURGE_DELAY", "0")
            .output()?;
        let stdout = String::from_utf8_lossy(&output.stdout);
        let line = stdout
            .lines()
            .find_map(|line| line.strip_prefix("fleet-one "))
            .with_context(|| {
                format!(
                    "the {replicas}-replica run printed no result ({}): {}",
                    output.status,
                    String::from_utf8_lossy(&output.stderr)
                )
            })?;
        let fields: Vec<f64> = line
            .split_whitespace()
            .map(str::parse)
            .collect::<Result<_, _>>()
            .with_context(|| format!("malformed fleet-one line {line:?}"))?;
        let [count, p50, p99, growth] = fields[..] else {
            anyhow::bail!("malformed fleet-one line {line:?}");
        };
        let base = measured.first().map_or(p99, |&(_, _, p99, _)| p99);
        println!(
            "| {replicas} | {count} | {p50:.0} | {p99:.0} | {:.2} | {:.1} MiB |",
            p99 / base,
            growth / f64::from(1 << 20)
        );
        measured.push((replicas, p50, p99, growth));
    }
    if let (Some(&(small, .., small_growth)), Some(&(large, .., large_growth))) =
        (measured.first(), measured.last())
    {
        println!(
            "\nmemory per replica (resident growth, {large} vs {small} replicas): {:.1} KiB\n",
            (large_growth - small_growth) / 1024.0 / (large - small) as f64
        );
    }
    Ok(())
}

/// One pool size of [`fleet_bench`], in this process: prints `fleet-one <decisions> <p50 µs>
/// <p99 µs> <resident growth bytes>`, the growth measured from before the picker is built to
/// after the run, with the picker and its state alive.
pub(super) fn fleet_one(
    prompts: &PromptSource,
    decisions: usize,
    replicas: usize,
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
    let (mut latencies, growth) = std::thread::scope(|scope| {
        scope
            .spawn(|| fleet_run(prompts, &bodies, replicas))
            .join()
            .map_err(|_| anyhow::anyhow!("fleet thread panicked"))?
    })?;
    latencies.sort_unstable();
    let at = |q: f64| latencies[((latencies.len() - 1) as f64 * q) as usize];
    println!(
        "fleet-one {} {:.1} {:.1} {growth}",
        latencies.len(),
        at(0.5).as_secs_f64() * 1e6,
        at(0.99).as_secs_f64() * 1e6,
    );
    Ok(())
}

/// The decisions' latencies, and the resident growth from before the picker was built to after
/// the run (picker alive).
fn fleet_run(
    prompts: &PromptSource,
    bodies: &[Bytes],
    replicas: usize,
) -> anyhow::Result<(Vec<Duration>, u64)> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .max_blocking_threads(1)
        .build()?;
    runtime.block_on(async {
        let rss_before = resident_bytes()?;
        let upstreams: Vec<SocketAddr> = (0..replicas)
            .map(|i| SocketAddr::from(([127, 0, 0, 1], 20_000 + i as u16)))
            .collect();
        let config = kvroute_ext_proc::Config::from_yaml(&ext_proc_config(
            &upstreams,
            &IndexMode::None,
            &prompts.model_dir,
            prompts.block_size,
        ))?;
        let tasks = TaskTracker::new();
        let runtime = kvroute_ext_proc::Runtime::build(config, None, &tasks)?;
        let mut registry = prometheus_client::registry::Registry::default();
        let metrics = kvroute_ext_proc::metrics::Metrics::register(&mut registry);
        let picker = kvroute_ext_proc::Picker::new(runtime, metrics, tasks.clone());
        let warm = request::parse(&bodies[0], Endpoint::ChatCompletions)?;
        drop(picker.decide(&warm, None).await?);
        let mut latencies = Vec::with_capacity(bodies.len());
        // Decisions stay in flight (their guards held) as under load, 64 at a time.
        let mut held = std::collections::VecDeque::new();
        for body in &bodies[1..] {
            let started = Instant::now();
            let parsed = request::parse(body, Endpoint::ChatCompletions)?;
            let decision = picker.decide(&parsed, None).await?;
            latencies.push(started.elapsed());
            held.push_back(decision);
            if held.len() > 64 {
                held.pop_front();
            }
        }
        drop(held);
        let growth = resident_bytes()?.saturating_sub(rss_before);
        drop(picker);
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
