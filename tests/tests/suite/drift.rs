//! Drift detection end to end: real Envoy → kvroute-ext-proc → kvroute-index in front of two
//! engine sims, one of which renders chat with another template than the one kvroute tokenizes
//! with ([`HISTORY_UNSTABLE_TEMPLATE`]). Multi-turn conversations routed by kvroute: it predicts
//! each later turn's cached prefix, the matching sim hits it, the other does not. Everything is
//! read from `/metrics` (ext-proc's drift gauge, warnings, degraded state, fallbacks) and the
//! ext-proc log.
//!
//! Needs the binaries: `cargo build --bins` first (see `routing.rs`).

use std::time::Duration;

use kvroute_test_support::{deadline, try_poll_until};
use kvroute_tests::harness::metrics;
use kvroute_tests::stack::{MODEL, Stack, StackOptions};
use serde_json::{Value, json};

use super::common::HISTORY_UNSTABLE_TEMPLATE;
use super::routing::{ext_proc_metrics, route_response, text};

/// How long the test waits for scrapes to carry a verdict.
fn settle() -> Duration {
    deadline(Duration::from_secs(30))
}
/// Predicted cached tokens a drift window needs for a verdict, in this test.
const MIN_TOKENS: u64 = 256;
/// Turns per conversation.
const TURNS: usize = 3;
/// Most conversations sent while waiting for both sims to be given enough of them.
const MAX_CONVERSATIONS: u64 = 24;

/// Turn `turn` (0-based) of conversation `seed`: every earlier turn with a canned answer, then a
/// new question, so each turn's prompt extends the previous one.
pub(super) fn conversation_turn(seed: u64, turn: usize) -> Value {
    let mut messages = vec![json!({"role": "system", "content": text(seed, 40)})];
    for t in 0..=turn {
        messages.push(json!({"role": "user", "content": text(seed * 100 + t as u64, 25)}));
        if t < turn {
            messages
                .push(json!({"role": "assistant", "content": text(seed * 1000 + t as u64, 15)}));
        }
    }
    json!({"model": MODEL, "messages": messages, "max_tokens": 2})
}

fn replica_label(replica: usize) -> String {
    format!("replica=\"sim-{replica}\"")
}

#[tokio::test]
async fn a_replica_with_another_chat_template_drifts_alone_and_degrades_its_pool() {
    let stack = Stack::start(StackOptions {
        replicas: 2,
        kv_blocks_per_replica: 1024,
        sim_chat_templates: vec![Some(HISTORY_UNSTABLE_TEMPLATE.to_owned()), None],
        ext_proc_extra_config: format!(
            "drift: {{bound: 0.5, clear_below: 0.25, window: 10m, min_tokens: {MIN_TOKENS}, \
             action: approximate}}\n"
        ),
        ..StackOptions::default()
    })
    .await
    .unwrap();

    // Conversations until both sims served enough later turns for a verdict each (a conversation
    // starts on either sim, by load, and its later turns follow its prefix).
    let mut later_turns = [0u64; 2];
    let mut seed = 1;
    while later_turns.iter().any(|&n| n < 4) {
        assert!(
            seed <= MAX_CONVERSATIONS,
            "conversations kept away from a sim: {later_turns:?}\n{}",
            stack.logs()
        );
        for turn in 0..TURNS {
            let (replica, _) = route_response(
                &stack,
                "/v1/chat/completions",
                &conversation_turn(seed, turn),
                &[],
            )
            .await;
            if turn > 0 {
                later_turns[replica] += 1;
            }
        }
        seed += 1;
    }

    // The mismatched sim's verdict: kvroute predicted its history cached, the engine hit none.
    // Scrapes carry the predictions of answered requests to the metrics: wait until the control
    // sim has a verdict of its own too, with the engine's side caught up.
    let drifting = replica_label(0);
    let matching = replica_label(1);
    let settled = try_poll_until(
        "sim-0 to drift and its pool to degrade",
        settle(),
        || async {
            let metrics = ext_proc_metrics(&stack).await;
            let sample = |family: &str, labels: &[&str]| metrics::sum(&metrics, family, labels);
            let drift = sample("kvroute_extproc_drift_ratio", &[&drifting]);
            let degraded = sample("kvroute_extproc_drift_degraded", &["pool=\"tiny\""]);
            let control_predicted = sample(
                "kvroute_extproc_drift_predicted_cached_tokens_total",
                &[&matching],
            );
            let control_settled = metrics
                .contains(&format!("kvroute_extproc_drift_ratio{{{matching}}}"))
                && control_predicted >= MIN_TOKENS as f64
                && sample(
                    "kvroute_extproc_drift_observed_cached_tokens_total",
                    &[&matching],
                ) >= control_predicted;
            (drift > 0.5 && degraded == 1.0 && control_settled).then_some(metrics)
        },
    )
    .await;
    let metrics = match settled {
        Ok(metrics) => metrics,
        Err(error) => panic!(
            "{error}\n{}\n{}",
            ext_proc_metrics(&stack).await,
            stack.logs()
        ),
    };
    let sample = |family: &str, labels: &[&str]| metrics::sum(&metrics, family, labels);
    assert!(
        sample(
            "kvroute_extproc_drift_predicted_cached_tokens_total",
            &[&drifting]
        ) >= MIN_TOKENS as f64
    );
    assert_eq!(
        sample(
            "kvroute_extproc_drift_observed_cached_tokens_total",
            &[&drifting]
        ),
        0.0,
        "every prompt of the other template starts with its conversation's length"
    );
    assert!(sample("kvroute_extproc_drift_warnings_total", &[&drifting]) >= 1.0);
    assert_eq!(
        sample(
            "kvroute_extproc_drift_degradations_total",
            &["pool=\"tiny\""]
        ),
        1.0
    );

    // The control: the sim whose template is kvroute's hits what kvroute predicted.
    let predicted = sample(
        "kvroute_extproc_drift_predicted_cached_tokens_total",
        &[&matching],
    );
    let observed = sample(
        "kvroute_extproc_drift_observed_cached_tokens_total",
        &[&matching],
    );
    assert!(
        predicted >= MIN_TOKENS as f64 && observed >= predicted,
        "{observed} of {predicted}"
    );
    assert_eq!(sample("kvroute_extproc_drift_ratio", &[&matching]), 0.0);
    assert_eq!(
        sample("kvroute_extproc_drift_warnings_total", &[&matching]),
        0.0
    );

    let log = stack.logs();
    assert!(
        log.contains("kvroute's predicted cached tokens drift from what the engine hits"),
        "{log}"
    );
    assert!(log.contains("pool routes on the approximate tier"), "{log}");

    // Degraded: the pool's decisions skip the index and use the approximate tier, counted.
    let fallbacks = |metrics: &str| {
        metrics::sum(
            metrics,
            "kvroute_extproc_fallbacks_total",
            &["stage=\"index\"", "cause=\"drift\""],
        )
    };
    let approximate = |metrics: &str| {
        metrics::sum(
            metrics,
            "kvroute_extproc_decisions_total",
            &["tier=\"approximate\""],
        )
    };
    let before = ext_proc_metrics(&stack).await;
    for turn in 0..TURNS {
        route_response(
            &stack,
            "/v1/chat/completions",
            &conversation_turn(seed, turn),
            &[],
        )
        .await;
    }
    let after = ext_proc_metrics(&stack).await;
    assert_eq!(
        fallbacks(&after) - fallbacks(&before),
        TURNS as f64,
        "{after}"
    );
    assert_eq!(approximate(&after) - approximate(&before), TURNS as f64);
    assert_eq!(
        metrics::sum(
            &after,
            "kvroute_extproc_decisions_total",
            &["tier=\"precise\""]
        ),
        metrics::sum(
            &before,
            "kvroute_extproc_decisions_total",
            &["tier=\"precise\""]
        ),
    );
}
