//! Through real Envoy, kvroute-ext-proc and kvroute-index in front of five sims: the replicas
//! the index cannot vouch for — one whose event feed never connected, one whose feed was cut
//! (disconnected), one publishing another block size (flagged), one whose kvroute-agent died
//! (stale) — are not precise, and routing
//! treats them as approximate: a follow-up of a prompt they served goes back to them on the
//! approximate tier (ext-proc's routed-prefix memory) and hits their cache, counted in
//! ext-proc's `decisions_total{tier="approximate"}` and `nonprecise_replicas_total{state}`,
//! while the healthy replica's follow-ups stay precise.
//!
//! Which replica served is read from the sims; the decision from `x-kvroute-decision`.
//! Needs the binaries: `cargo build --bins` first.

use std::time::Duration;

use kvroute_test_support::{deadline, poll_until, try_poll_until};
use kvroute_tests::harness::{http, metrics};
use kvroute_tests::stack::{DebugHeaders, EventsFault, Stack, StackOptions};
use serde_json::Value;

use super::routing::{ext_proc_metrics, route_decided, text};

/// How long a test waits for the index to reach a state.
fn settle() -> Duration {
    deadline(Duration::from_secs(20))
}
/// Replica roles, in replica order.
const HEALTHY: usize = 0;
const NEVER_CONNECTED: usize = 1;
const CUT: usize = 2;
const WRONG_BLOCK_SIZE: usize = 3;
const AGENT_GONE: usize = 4;
const REPLICAS: usize = 5;
/// Prompts tried until each replica has served one first (load ties break at random: five
/// replicas all get one within a few; 60 misses one with probability ~1e-5).
const MAX_PROMPTS: u64 = 60;

/// `/v1/replicas` entry of `id`.
async fn replica(admin: &str, id: &str) -> Option<Value> {
    let all: Value = http::get(&format!("{admin}/v1/replicas"))
        .await
        .ok()?
        .json()
        .ok()?;
    all.as_array()?.iter().find(|r| r["id"] == id).cloned()
}

async fn wait_state(stack: &Stack, replica_index: usize, state: &str) {
    let admin = stack.index_admin_url().unwrap();
    let id = &stack.replica_ids()[replica_index];
    let reached = try_poll_until(&format!("{id} {state}"), settle(), || async {
        (replica(&admin, id).await?["state"] == state).then_some(())
    })
    .await;
    if let Err(error) = reached {
        let now = replica(&admin, id).await;
        panic!("{error}: {now:?}\n{}", stack.logs());
    }
}

#[tokio::test]
async fn replicas_the_index_cannot_vouch_for_are_routed_on_the_approximate_tier() {
    let mut faults = vec![None; REPLICAS];
    faults[NEVER_CONNECTED] = Some(EventsFault::Unreachable);
    // The pool (index and ext-proc) says 32.
    faults[WRONG_BLOCK_SIZE] = Some(EventsFault::BlockSize(16));
    let mut stack = Stack::start(StackOptions {
        replicas: REPLICAS,
        debug_headers: DebugHeaders::Always,
        events_faults: faults,
        agent_replicas: vec![AGENT_GONE],
        cuttable_event_streams: vec![CUT],
        ..StackOptions::default()
    })
    .await
    .unwrap();
    let admin = stack.index_admin_url().unwrap();
    let ids = stack.replica_ids();
    // The stack waited for the proxied feed to be ready; now cut it (and keep it cut).
    stack.cut_events(CUT).unwrap();
    wait_state(&stack, CUT, "disconnected").await;
    wait_state(&stack, NEVER_CONNECTED, "never_connected").await;
    wait_state(&stack, HEALTHY, "ready").await;
    // The agent feeding the last replica dies: past the index's agent_stale_grace it is stale.
    stack.kill_agent().unwrap();
    wait_state(&stack, AGENT_GONE, "stale").await;

    let mut follow_ups: [Option<String>; REPLICAS] = Default::default();
    for seed in 0..MAX_PROMPTS {
        if follow_ups.iter().all(Option::is_some) {
            break;
        }
        let prefix = text(700 + seed, 150);
        let first = route_decided(&stack, &format!("{prefix} q0")).await;
        let holder = first.replica;
        if follow_ups[holder].is_some() {
            continue;
        }
        // Let the index take in what the first request stored: the healthy replica's blocks,
        // or the wrong block size that flags its replica.
        match holder {
            HEALTHY => {
                poll_until("the index to learn the prefix", settle(), || async {
                    (replica(&admin, &ids[HEALTHY]).await?["blocks"].as_u64()? > 0).then_some(())
                })
                .await;
            }
            WRONG_BLOCK_SIZE => wait_state(&stack, WRONG_BLOCK_SIZE, "flagged").await,
            _ => {}
        }
        let again = route_decided(&stack, &format!("{prefix} q1")).await;
        assert_eq!(
            again.replica,
            holder,
            "the follow-up left the replica holding its prefix ({})\n{}",
            again.decision,
            stack.logs()
        );
        assert!(
            again.cached_tokens > 0,
            "{} found nothing cached ({})",
            ids[holder],
            again.decision
        );
        follow_ups[holder] = Some(again.decision);
    }
    let decisions: Vec<String> = follow_ups
        .iter()
        .enumerate()
        .map(|(i, d)| {
            d.clone()
                .unwrap_or_else(|| panic!("{} never served a prompt first", ids[i]))
        })
        .collect();
    assert_eq!(
        decisions,
        [
            "precise/cache_hit",
            "approximate/cache_hit",
            "approximate/cache_hit",
            "approximate/cache_hit",
            "approximate/cache_hit"
        ],
        "follow-ups of sim-0 (healthy), sim-1 (never connected), sim-2 (cut), sim-3 (block size), \
         sim-4 (agent gone)"
    );

    // The index vouches for none of the four; ext-proc counted each by its state.
    let problem = replica(&admin, &ids[WRONG_BLOCK_SIZE]).await.unwrap();
    assert_eq!(problem["problem"], "block_size_mismatch", "{problem}");
    let metrics = ext_proc_metrics(&stack).await;
    let family = "kvroute_extproc_nonprecise_replicas_total";
    for (i, state) in [
        (NEVER_CONNECTED, "never_connected"),
        (CUT, "disconnected"),
        (WRONG_BLOCK_SIZE, "flagged"),
        (AGENT_GONE, "stale"),
    ] {
        let labels = [
            format!("replica=\"{}\"", ids[i]),
            format!("state=\"{state}\""),
        ];
        let labels: Vec<&str> = labels.iter().map(String::as_str).collect();
        assert!(
            metrics::sum(&metrics, family, &labels) > 0.0,
            "{} not counted as {state}:\n{metrics}",
            ids[i]
        );
    }
    let healthy = format!("replica=\"{}\"", ids[HEALTHY]);
    assert_eq!(
        metrics::sum(&metrics, family, &[&healthy]),
        0.0,
        "{metrics}"
    );
    assert!(
        metrics::sum(
            &metrics,
            "kvroute_extproc_decisions_total",
            &["tier=\"approximate\"", "reason=\"cache_hit\""]
        ) >= 4.0,
        "{metrics}"
    );
    assert_eq!(
        metrics::sum(&metrics, "kvroute_extproc_unknown_replicas_total", &[]),
        0.0
    );
}

/// An endpoint that refuses connections while ext-proc still routes to it (an engine that just
/// died, before the scraper marks it unready): Envoy's shipped retry policy
/// (`connect-failure,refused-stream`) sends the request to the next endpoint of ext-proc's GIE
/// destination list (`chosen,fallback,…`, the same in header and metadata), and the client never
/// sees the failure.
#[tokio::test]
async fn a_request_whose_endpoint_refuses_connections_is_retried_elsewhere() {
    let stack = Stack::start(StackOptions {
        replicas: 2,
        refusing_replicas: 1,
        ..StackOptions::default()
    })
    .await
    .unwrap();
    let retries = "cluster.llm_pool.upstream_rq_retry";
    // Load ties break at random over three candidates: the refusing one is picked within a
    // few prompts (60 all miss it with probability ~3e-11). route_decided asserts each is a 200.
    let mut sent = 0;
    while stack.envoy().stat(retries).await.unwrap().unwrap_or(0) == 0 {
        assert!(
            sent < MAX_PROMPTS,
            "ext-proc never picked the refusing endpoint\n{}",
            stack.logs()
        );
        route_decided(&stack, &format!("{} q", text(900 + sent, 40))).await;
        sent += 1;
    }
    let envoy = stack.envoy();
    assert!(
        envoy
            .stat("cluster.llm_pool.upstream_cx_connect_fail")
            .await
            .unwrap()
            .unwrap_or(0)
            > 0
    );
    // ext-proc chose it (unknown to the index, so not precise), and heard from Envoy that its
    // first fallback served: the retry walked the list, not Envoy's own balancer.
    let metrics = ext_proc_metrics(&stack).await;
    assert!(
        metrics::sum(&metrics, "kvroute_extproc_served_fallback_total", &[]) > 0.0,
        "{metrics}"
    );
    assert_eq!(
        metrics::sum(&metrics, "kvroute_extproc_served_mismatch_total", &[]),
        0.0,
        "a retry left the destination list\n{metrics}"
    );
    assert!(
        metrics::sum(
            &metrics,
            "kvroute_extproc_unknown_replicas_total",
            &["replica=\"refusing-0\""]
        ) > 0.0,
        "{metrics}"
    );
}
