//! kvroute-ext-proc with the index inside it ([`IndexPlacement::Embedded`]): no kvroute-index
//! process, `Match` answered in memory. Through Envoy and the sims, as [`super::routing`] does:
//! siblings of a cached prefix go to its replica on the precise tier, the embedded index's view
//! equals every sim's own block list, and after an ext-proc restart the catch-up replay at socket
//! open refills the index without new engine traffic.
//!
//! Which replica served is read from the sims (`vllm:request_success_total` moves on exactly one
//! sim per sequential request); the tier from the `x-kvroute-decision` response header.
//!
//! Needs the binaries: `cargo build --bins` before
//! `cargo nextest run -p kvroute-tests embedded`.

use std::time::Duration;

use kvroute_test_support::{deadline, try_poll_until};
use kvroute_tests::harness::http;
use kvroute_tests::stack::{DebugHeaders, IndexPlacement, Stack, StackOptions};

use super::common::{index_blocks, sim_blocks};
use super::routing::{Routed, route_decided as route, text};

/// How long a test waits for the sims' counters or the index's view to settle.
fn settle() -> Duration {
    deadline(Duration::from_secs(20))
}
/// Siblings of the warmed prefix sent in the first test.
const SIBLINGS: usize = 6;

async fn start_embedded() -> Stack {
    Stack::start(StackOptions {
        index_placement: IndexPlacement::Embedded,
        // The tier is read from `x-kvroute-decision` on responses.
        debug_headers: DebugHeaders::Always,
        ..StackOptions::default()
    })
    .await
    .unwrap()
}

/// Waits until the embedded index's view of each of `replicas` equals that sim's own block list
/// and holds at least `min_blocks`; on timeout, fails with the difference.
async fn wait_converged(stack: &Stack, replicas: &[usize], min_blocks: usize, phase: &str) {
    let admin = stack.index_admin_url().unwrap();
    let ids = stack.replica_ids();
    let sims = stack.sim_urls();
    for &replica in replicas {
        let (id, sim) = (&ids[replica], &sims[replica]);
        let converged = try_poll_until(&format!("{phase}: {id} converged"), settle(), || async {
            let truth = sim_blocks(sim).await?;
            let view = index_blocks(&admin, id).await?;
            (truth == view && view.len() >= min_blocks).then_some(())
        })
        .await;
        if let Err(error) = converged {
            let truth = sim_blocks(sim).await.unwrap_or_default();
            let view = index_blocks(&admin, id).await.unwrap_or_default();
            let replicas = http::get(&format!("{admin}/v1/replicas"))
                .await
                .map(|r| r.text())
                .unwrap_or_else(|e| e.to_string());
            panic!(
                "{error}: {} blocks in the sim, {} in the index; only in the sim: {:?}; only in \
                 the index: {:?}\nreplicas: {replicas}\n{}",
                truth.len(),
                view.len(),
                truth.difference(&view).collect::<Vec<_>>(),
                view.difference(&truth).collect::<Vec<_>>(),
                stack.logs()
            );
        }
    }
}

fn assert_precise_on(routed: &Routed, holder: usize, what: &str, stack: &Stack) {
    assert_eq!(
        routed.replica,
        holder,
        "{what} left the replica holding its prefix ({})\n{}",
        routed.decision,
        stack.logs()
    );
    assert!(
        routed.decision.starts_with("precise/"),
        "{what} was decided `{}`, not by the embedded index",
        routed.decision
    );
    assert!(routed.cached_tokens > 0, "{what} found nothing cached");
}

#[tokio::test]
async fn embedded_index_sends_siblings_to_their_prefix_and_mirrors_every_sim() {
    let stack = start_embedded().await;
    let prefix = text(41, 150);
    let first = route(&stack, &format!("{prefix} q0")).await;
    assert_eq!(first.cached_tokens, 0);
    // ~1k tokens of prefix are 30+ blocks; the embedded index must hold them before siblings.
    wait_converged(&stack, &[first.replica], 8, "warm-up").await;

    for i in 1..=SIBLINGS {
        let sibling = route(&stack, &format!("{prefix} q{i}")).await;
        assert_precise_on(&sibling, first.replica, &format!("sibling {i}"), &stack);
    }

    // Unrelated prompts populate other replicas; then every replica's view matches its sim.
    for seed in 0..3 {
        route(&stack, &text(4100 + seed, 120)).await;
    }
    let all: Vec<usize> = (0..stack.replica_ids().len()).collect();
    wait_converged(&stack, &all, 0, "after traffic").await;
}

#[tokio::test]
async fn embedded_index_refills_from_the_engines_replay_after_an_ext_proc_restart() {
    let mut stack = start_embedded().await;
    let prefix = text(42, 150);
    let first = route(&stack, &format!("{prefix} q0")).await;
    let holder = first.replica;
    wait_converged(&stack, &[holder], 8, "warm-up").await;
    let warm = route(&stack, &format!("{prefix} q1")).await;
    assert_precise_on(&warm, holder, "the sibling before the restart", &stack);
    let index_admin = stack.index_admin_url().unwrap();

    // The restart empties the index (and ext-proc's routing memory); no engine traffic follows,
    // so only the catch-up replay at socket open can bring the prefix back.
    stack.restart_ext_proc().await.unwrap();
    assert_eq!(
        stack.index_admin_url().unwrap(),
        index_admin,
        "the embedded index came back on other ports"
    );
    wait_converged(&stack, &[holder], 8, "after the restart").await;

    let after = route(&stack, &format!("{prefix} after restart")).await;
    assert_precise_on(&after, holder, "the sibling after the restart", &stack);
}
