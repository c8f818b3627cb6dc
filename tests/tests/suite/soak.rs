//! The chaos soak: continuous multi-turn chat traffic through real Envoy to three
//! engine simulators while, on a fixed schedule, kvroute-index, kvroute-ext-proc, the
//! kvroute-agent and an engine are SIGKILLed and restarted, and an engine's KV-event stream is
//! cut and resumed. One implementation, two lengths:
//!
//! - `chaos_soak_short` (~40 s of chaos) runs with the suite;
//! - `chaos_soak_long` is ignored; the 3-minute run of BENCHMARKS.md is
//!   `KVROUTE_SOAK_SECS=180 cargo nextest run -p kvroute-tests --run-ignored only -E 'test(chaos_soak_long)' --no-capture`
//!   (after `cargo build --bins`, with the env of `scripts/setup.sh`).
//!
//! The replicas: `sim-0` subscribed to by the index directly, `sim-1` too but through a TCP link
//! the soak cuts, `sim-2` fed through the agent. Asserted:
//!
//! - **0 failed client requests**: every request gets a 2xx with a completion. Envoy fails open
//!   past a dead ext-proc (the shipped config's `failure_mode_allow: true`); a dead or restarting
//!   engine's refused connection, or a request it reset, is retried on another endpoint (the
//!   stack's `engine_retries`: `retry_on: connect-failure,refused-stream,reset`). The requests
//!   are not streamed: Envoy cannot retry a response whose headers already went to the client,
//!   so a stream cut mid-answer by an engine crash is a failure no proxy can hide.
//! - **Convergence**: after every fault is healed, each replica's blocks in the index equal the
//!   engine's own (`/debug/blocks`, read twice around the index read with the same
//!   `published_batches`, so the engine did not change meanwhile) with the replica `ready`,
//!   within [`converge_bound`]; and again at the end, with the traffic stopped.
//! - **Memory**: the peak RSS (`VmRSS` of `/proc/<pid>/status`, sampled every 250 ms) of each
//!   kvroute process stays under its [`rss_bound_mib`].
//!
//! The figures (requests, failures, retries, faults, convergence p50/max, peak RSS) are printed.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use kvroute_test_support::{deadline, try_poll_until};
use kvroute_tests::harness::{http, metrics};
use kvroute_tests::stack::{MODEL, Routing, Stack, StackOptions};
use parking_lot::Mutex;
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::common;

/// Chaos time of the short form.
const SHORT: Duration = Duration::from_secs(40);
/// Chaos time of the long form unless `KVROUTE_SOAK_SECS` says otherwise.
const LONG: Duration = Duration::from_secs(180);
/// A fault starts every this often (the schedule, not synchronisation).
const FAULT_EVERY: Duration = Duration::from_secs(5);
/// How long a killed process stays dead, or a cut stream cut, before it is healed.
const DOWN_FOR: Duration = Duration::from_secs(1);
/// After a fault is healed, every replica's blocks in the index equal the engine's within this:
/// after a [`DOWN_FOR`] outage the index's (100 ms, doubling) and the agent's (≤ 200 ms)
/// reconnect backoffs retry within ~0.6 s of the heal, then one replay or snapshot; 5 s leaves
/// room for a loaded machine (the measured convergence: BENCHMARKS.md, "Chaos soak").
fn converge_bound() -> Duration {
    deadline(Duration::from_secs(5))
}
/// Conversations running at once.
const CONVERSATIONS: usize = 4;
/// User turns per conversation before it starts over with a new one.
const TURNS: usize = 6;
/// RSS samples.
const RSS_EVERY: Duration = Duration::from_millis(250);

/// The replica whose event stream is cut.
const CUT_REPLICA: usize = 1;
/// The replica the agent feeds.
const AGENT_REPLICA: usize = 2;

/// Peak RSS allowed per process (MiB) over the whole run, per process name.
fn rss_bound_mib(process: &str) -> Option<u64> {
    match process {
        "kvroute-index" => Some(64),
        "kvroute-ext-proc" => Some(160),
        "kvroute-agent" => Some(48),
        _ => None,
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Fault {
    KillIndex,
    KillExtProc,
    KillAgent,
    KillEngine(usize),
    CutEvents(usize),
}

impl Fault {
    /// The schedule, repeated: every component, and both an index-fed and the agent-fed engine.
    const CYCLE: [Fault; 6] = [
        Fault::KillEngine(0),
        Fault::KillIndex,
        Fault::CutEvents(CUT_REPLICA),
        Fault::KillExtProc,
        Fault::KillAgent,
        Fault::KillEngine(AGENT_REPLICA),
    ];

    fn label(self) -> String {
        match self {
            Fault::KillIndex => "kill kvroute-index".to_owned(),
            Fault::KillExtProc => "kill kvroute-ext-proc".to_owned(),
            Fault::KillAgent => "kill kvroute-agent".to_owned(),
            Fault::KillEngine(i) => format!("kill engine sim-{i}"),
            Fault::CutEvents(i) => format!("cut sim-{i}'s event stream"),
        }
    }

    fn inject(self, stack: &mut Stack) {
        match self {
            Fault::KillIndex => stack.kill_index(),
            Fault::KillExtProc => stack.kill_ext_proc(),
            Fault::KillAgent => stack.kill_agent(),
            Fault::KillEngine(i) => stack.kill_sim(i),
            Fault::CutEvents(i) => stack.cut_events(i),
        }
        .unwrap_or_else(|e| panic!("{}: {e}", self.label()));
    }

    async fn heal(self, stack: &mut Stack) {
        match self {
            Fault::KillIndex => stack.restart_index().await,
            Fault::KillExtProc => stack.restart_ext_proc().await,
            Fault::KillAgent => stack.restart_agent().await,
            Fault::KillEngine(i) => stack.restart_sim(i).await,
            Fault::CutEvents(i) => stack.resume_events(i),
        }
        .unwrap_or_else(|e| panic!("healing {}: {e}\n{}", self.label(), stack.logs()));
    }
}

/// What the clients saw.
#[derive(Debug, Default)]
struct Traffic {
    ok: AtomicU64,
    failures: Mutex<Vec<String>>,
}

/// A user turn: distinct per conversation so each conversation has its own prefix.
fn user_turn(conversation: &str, turn: usize) -> String {
    format!(
        "{conversation}, turn {turn}: please summarise the incident report for the {} region and \
         list what the on-call engineer should check next, in order of urgency.",
        ["north", "south", "east", "west", "central"][turn % 5]
    )
}

/// One client: conversations of [`TURNS`] turns, each turn sent with the whole history, the
/// engine's answer appended; until `stop`.
async fn client(url: String, client_id: usize, traffic: Arc<Traffic>, stop: CancellationToken) {
    let mut conversation = 0usize;
    while !stop.is_cancelled() {
        let name = format!("Client {client_id} conversation {conversation}");
        let mut messages = vec![json!({"role": "system", "content": format!(
            "You are the operations assistant of team {client_id}-{conversation}. Answer briefly, \
             cite the runbook section, and never invent metrics that were not given to you."
        )})];
        for turn in 0..TURNS {
            if stop.is_cancelled() {
                return;
            }
            messages.push(json!({"role": "user", "content": user_turn(&name, turn)}));
            let body = json!({"model": MODEL, "messages": messages, "max_tokens": 12});
            let outcome = http::post_json(&format!("{url}/v1/chat/completions"), &body).await;
            let answer = match outcome {
                Ok(response) if response.status.is_success() => {
                    response.json().ok().and_then(|v| {
                        v["choices"][0]["message"]["content"]
                            .as_str()
                            .map(str::to_owned)
                    })
                }
                Ok(response) => {
                    traffic.failures.lock().push(format!(
                        "{}: {} {}",
                        name,
                        response.status,
                        response.text()
                    ));
                    None
                }
                Err(error) => {
                    traffic.failures.lock().push(format!("{name}: {error}"));
                    None
                }
            };
            match answer {
                Some(text) => {
                    traffic.ok.fetch_add(1, Ordering::Relaxed);
                    messages.push(json!({"role": "assistant", "content": text}));
                }
                // A failed turn ends the conversation (already counted).
                None => break,
            }
        }
        conversation += 1;
    }
}

/// Peak RSS per process name and half of the run, sampled from the pids the fault loop keeps
/// current (a restarted process counts under its name).
#[derive(Debug)]
struct Memory {
    pids: Mutex<Vec<(String, u32)>>,
    /// Samples after this count in the second half.
    second_half: Instant,
    peak_kib: Mutex<BTreeMap<String, [u64; 2]>>,
}

fn rss_kib(pid: u32) -> Option<u64> {
    metrics::proc_status_kib(pid, "VmRSS")
}

async fn sample_memory(memory: Arc<Memory>, stop: CancellationToken) {
    let mut tick = tokio::time::interval(RSS_EVERY);
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        let pids = memory.pids.lock().clone();
        for (name, pid) in pids {
            if let Some(kib) = rss_kib(pid) {
                let half = usize::from(Instant::now() >= memory.second_half);
                let mut peaks = memory.peak_kib.lock();
                let peak = &mut peaks.entry(name).or_default()[half];
                *peak = (*peak).max(kib);
            }
        }
    }
}

/// The index's view of one replica: its blocks and whether it is `ready`.
async fn index_view(admin: &str, id: &str) -> Option<(BTreeSet<u64>, bool)> {
    let blocks = common::index_blocks(admin, id).await?;
    let replicas = http::get(&format!("{admin}/v1/replicas"))
        .await
        .ok()?
        .json()
        .ok()?;
    let ready = replicas
        .as_array()?
        .iter()
        .any(|r| r["id"] == id && r["state"] == "ready");
    Some((blocks, ready))
}

/// An engine's blocks with its published-batch count.
async fn engine_view(sim_url: &str) -> Option<(u64, BTreeSet<u64>)> {
    let answer: Value = http::get(&format!("{sim_url}/debug/blocks"))
        .await
        .ok()?
        .json()
        .ok()?;
    let blocks = answer["blocks"]
        .as_array()?
        .iter()
        .map(|b| b["hash"].as_u64())
        .collect::<Option<_>>()?;
    Some((answer["published_batches"].as_u64()?, blocks))
}

/// Whether the index holds exactly the engine's blocks for replica `id`, ready, at a moment the
/// engine did not change (its batch count the same before and after the index read).
async fn replica_converged(admin: &str, id: &str, sim_url: &str) -> bool {
    let Some((before, engine)) = engine_view(sim_url).await else {
        return false;
    };
    let Some((index, ready)) = index_view(admin, id).await else {
        return false;
    };
    let Some((after, _)) = engine_view(sim_url).await else {
        return false;
    };
    ready && before == after && index == engine
}

/// Waits until every replica has converged at least once since the call; the time it took.
async fn converge(stack: &Stack, what: &str, within: Duration) -> Duration {
    let started = Instant::now();
    let admin = stack.index_admin_url().unwrap();
    let replicas: Vec<(String, String)> = stack
        .replica_ids()
        .into_iter()
        .zip(stack.sim_urls())
        .collect();
    let pending = Arc::new(Mutex::new(replicas));
    let result = try_poll_until(what, within, || {
        let (admin, pending) = (admin.clone(), Arc::clone(&pending));
        async move {
            let todo = pending.lock().clone();
            let mut left = Vec::new();
            for (id, url) in todo {
                if !replica_converged(&admin, &id, &url).await {
                    left.push((id, url));
                }
            }
            let done = left.is_empty();
            *pending.lock() = left;
            done.then_some(())
        }
    })
    .await;
    if let Err(error) = result {
        let mut detail = String::new();
        let left = pending.lock().clone();
        for (id, url) in &left {
            let engine = engine_view(url).await;
            let index = index_view(&admin, id).await;
            detail.push_str(&format!(
                "{id}: engine {:?} blocks (batches {:?}); index {:?} blocks, ready {:?}; only in \
                 the engine {:?}; only in the index {:?}\n",
                engine.as_ref().map(|(_, b)| b.len()),
                engine.as_ref().map(|(n, _)| *n),
                index.as_ref().map(|(b, _)| b.len()),
                index.as_ref().map(|(_, r)| *r),
                engine
                    .as_ref()
                    .zip(index.as_ref())
                    .map(|((_, e), (i, _))| e.difference(i).count()),
                engine
                    .as_ref()
                    .zip(index.as_ref())
                    .map(|((_, e), (i, _))| i.difference(e).count()),
            ));
        }
        panic!("{error}\n{detail}\n{}", stack.logs());
    }
    started.elapsed()
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let rank = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[rank.min(sorted.len() - 1)]
}

async fn soak(chaos_for: Duration) {
    let mut stack = Stack::start(StackOptions {
        replicas: 3,
        routing: Routing::Kvroute,
        agent_replicas: vec![AGENT_REPLICA],
        cuttable_event_streams: vec![CUT_REPLICA],
        engine_retries: true,
        ..StackOptions::default()
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    converge(&stack, "initial convergence", converge_bound()).await;

    let url = stack.url(Routing::Kvroute).unwrap();
    let traffic = Arc::new(Traffic::default());
    let memory = Arc::new(Memory {
        pids: Mutex::default(),
        second_half: Instant::now() + chaos_for / 2,
        peak_kib: Mutex::default(),
    });
    *memory.pids.lock() = stack.process_ids();
    let stop = CancellationToken::new();
    let tasks = TaskTracker::new();
    for client_id in 0..CONVERSATIONS {
        tasks.spawn(client(
            url.clone(),
            client_id,
            Arc::clone(&traffic),
            stop.clone(),
        ));
    }
    tasks.spawn(sample_memory(Arc::clone(&memory), stop.clone()));

    let started = Instant::now();
    let mut convergence: BTreeMap<Fault, Vec<Duration>> = BTreeMap::new();
    let mut schedule = tokio::time::interval(FAULT_EVERY);
    schedule.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    schedule.tick().await;
    for fault in Fault::CYCLE.iter().copied().cycle() {
        schedule.tick().await;
        if started.elapsed() + FAULT_EVERY > chaos_for {
            break;
        }
        fault.inject(&mut stack);
        *memory.pids.lock() = stack.process_ids();
        // The outage itself: traffic runs on meanwhile.
        tokio::time::sleep(DOWN_FOR).await;
        fault.heal(&mut stack).await;
        *memory.pids.lock() = stack.process_ids();
        let took = converge(
            &stack,
            &format!("convergence after {}", fault.label()),
            converge_bound(),
        )
        .await;
        eprintln!(
            "{:>6.1?} {}: converged in {took:?}",
            started.elapsed(),
            fault.label()
        );
        convergence.entry(fault).or_default().push(took);
    }
    let chaos = started.elapsed();
    stop.cancel();
    tasks.close();
    tasks.wait().await;
    let quiet = converge(
        &stack,
        "convergence with the traffic stopped",
        converge_bound(),
    )
    .await;

    // Figures.
    let ok = traffic.ok.load(Ordering::Relaxed);
    let failures = traffic.failures.lock().clone();
    let retries = stack
        .envoy()
        .stat("cluster.llm_pool.upstream_rq_retry")
        .await
        .unwrap()
        .unwrap_or(0);
    let fail_open = stack
        .envoy()
        .stat("http.kvroute.ext_proc.failure_mode_allowed")
        .await
        .unwrap()
        .unwrap_or(0);
    let mut all: Vec<Duration> = convergence.values().flatten().copied().collect();
    all.sort();
    let faults = all.len();
    eprintln!(
        "soak: {chaos:.1?} of chaos, {faults} faults ({}), {} requests, {} failed, {retries} \
         Envoy retries, {fail_open} ext_proc fail-opens; convergence p50 {:?}, max {:?}, at the \
         end {quiet:?}",
        convergence
            .iter()
            .map(|(f, t)| format!("{} ×{}", f.label(), t.len()))
            .collect::<Vec<_>>()
            .join(", "),
        ok + failures.len() as u64,
        failures.len(),
        percentile(&all, 0.5),
        all.last().copied().unwrap_or_default(),
    );
    for (fault, times) in &convergence {
        let mut times = times.clone();
        times.sort();
        eprintln!(
            "  {}: p50 {:?}, max {:?}",
            fault.label(),
            percentile(&times, 0.5),
            times.last().copied().unwrap_or_default()
        );
    }
    let peaks = memory.peak_kib.lock().clone();
    let mib = |kib: u64| kib as f64 / 1024.0;
    for (name, [first, second]) in &peaks {
        eprintln!(
            "  peak RSS {name}: {:.1} MiB (first half {:.1}, second half {:.1})",
            mib(*first.max(second)),
            mib(*first),
            mib(*second)
        );
    }
    // How far each engine's stream got since its last start: an index or agent that joins
    // replays from 0, so more than the replay buffer (10,000 batches) could not be caught up.
    for (id, url) in stack.replica_ids().iter().zip(stack.sim_urls()) {
        let batches = engine_view(&url).await.map(|(n, _)| n);
        eprintln!("  {id}: {batches:?} event batches since its last start");
    }

    assert!(
        failures.is_empty(),
        "{} of {} client requests failed; first: {:#?}\n{}",
        failures.len(),
        ok + failures.len() as u64,
        &failures[..failures.len().min(5)],
        stack.logs()
    );
    let every_kind: BTreeSet<String> = convergence
        .keys()
        .map(|f| format!("{:?}", std::mem::discriminant(f)))
        .collect();
    assert_eq!(
        every_kind.len(),
        5,
        "every kind of fault ran: {convergence:?}"
    );
    assert!(ok >= 100, "the traffic ran: {ok} requests");
    for name in ["kvroute-index", "kvroute-ext-proc", "kvroute-agent"] {
        let peak = peaks.get(name).map_or(0, |[a, b]| *a.max(b));
        assert!(peak > 0, "no RSS sample of {name}");
        let bound = rss_bound_mib(name).unwrap() * 1024;
        assert!(
            peak <= bound,
            "{name} peaked at {} KiB, over its {bound} KiB bound",
            peak
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_soak_short() {
    soak(SHORT).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "3 minutes; run: KVROUTE_SOAK_SECS=180 cargo nextest run -p kvroute-tests \
            --run-ignored only -E 'test(chaos_soak_long)' --no-capture"]
async fn chaos_soak_long() {
    let secs = std::env::var("KVROUTE_SOAK_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .map_or(LONG, Duration::from_secs);
    soak(secs).await;
}
