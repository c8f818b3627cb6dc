//! Several ext-proc replicas acting as one: decisions shared through the index's
//! `ShareDecisions` relay (real Envoy balancing ext_proc streams round robin over two real
//! ext-proc processes, a real index, sims).

use std::time::Duration;

use kvroute_index_api::api::kv_index_client::KvIndexClient;
use kvroute_index_api::api::{PickerAnswered, PickerDecided, PickerNews, picker_news::News};
use kvroute_test_support::{deadline, poll_until, try_poll_until};
use kvroute_tests::harness::{http, metrics};
use kvroute_tests::stack::{MODEL, Routing, SimTiming, Stack, StackOptions};
use serde_json::json;

use super::routing::{finished, post_raw, served_since, text};

fn settle() -> Duration {
    Duration::from_secs(20)
}

async fn admin_metrics(admin: &str) -> String {
    http::get(&format!("{admin}/metrics"))
        .await
        .map(|r| r.text())
        .unwrap_or_default()
}

/// Waits until every ext-proc of `stack` says it shares decisions (`peer_sharing 1`).
async fn until_sharing(stack: &Stack, sharing: f64) {
    for admin in stack.ext_proc_admin_urls() {
        poll_until("ext-proc to share decisions", settle(), || async {
            metrics::sum(
                &admin_metrics(&admin).await,
                "kvroute_extproc_peer_sharing",
                &[],
            ) == sharing
        })
        .await;
    }
}

#[tokio::test]
async fn siblings_decided_by_the_other_picker_join_the_prefix_in_flight() {
    // Slow prefills (about 2.6 s for the prompt): the sibling is decided while the first request
    // is still computing the prefix, before any KV event tells the index about it. Only what the
    // deciding picker knows of requests in flight can send it there (on these weights joining
    // and computing elsewhere estimate the same time to first token, and a tie goes to the
    // replica known to hold the prefix); without sharing the other picker knows nothing and
    // picks any of the four idle replicas.
    let stack = Stack::start(StackOptions {
        ext_proc_instances: 2,
        timing: SimTiming {
            prefill_us_per_token: 2000.0,
            time_scale: 1.0,
            ..SimTiming::default()
        },
        ..StackOptions::default()
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    until_sharing(&stack, 1.0).await;
    let prefix = text(2, 300);
    let url = format!("{}/v1/completions", stack.url(Routing::Kvroute).unwrap());
    let sibling = |i: usize| {
        let body =
            json!({"model": MODEL, "prompt": format!("{prefix} sibling {i}"), "max_tokens": 2})
                .to_string()
                .into_bytes();
        let url = url.clone();
        async move { post_raw(&url, body, &[]).await }
    };
    let before = finished(&stack).await;
    let admins = stack.ext_proc_admin_urls();
    let then_the_sibling = async {
        // The other picker has counted the first decision as its own.
        poll_until(
            "the other picker to apply the first decision",
            settle(),
            || async {
                let mut applied = 0.0;
                for admin in &admins {
                    applied += metrics::sum(
                        &admin_metrics(admin).await,
                        "kvroute_extproc_peer_news_total",
                        &["outcome=\"applied\""],
                    );
                }
                applied >= 1.0
            },
        )
        .await;
        // Envoy's round robin (one worker) hands the next request to the other picker.
        sibling(1).await
    };
    let (first, second) = futures::join!(sibling(0), then_the_sibling);
    for response in [first, second] {
        assert_eq!(response.status, 200, "{}", response.text());
    }
    let served = served_since(&stack, &before, 2).await;
    let mut decided = Vec::new();
    for admin in &admins {
        decided.push(metrics::sum(
            &admin_metrics(admin).await,
            "kvroute_extproc_decisions_total",
            &[],
        ));
    }
    assert_eq!(decided, [1.0, 1.0], "each picker decided one");
    assert_eq!(
        served.iter().filter(|&&n| n > 0).count(),
        1,
        "the sibling joins the replica computing the prefix, though the other picker decided \
         it: {served:?}\n{}",
        stack.logs()
    );
}

#[tokio::test]
async fn a_picker_that_loses_the_index_routes_on_its_own_and_shares_again_once_it_is_back() {
    let mut stack = Stack::start(StackOptions {
        ext_proc_instances: 2,
        ..StackOptions::default()
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    until_sharing(&stack, 1.0).await;
    stack.kill_index().unwrap();
    until_sharing(&stack, 0.0).await;
    // Every request is still answered (the load and approximate tiers route it).
    let url = format!("{}/v1/completions", stack.url(Routing::Kvroute).unwrap());
    for i in 0..6 {
        let body = json!({"model": MODEL, "prompt": text(40 + i, 40), "max_tokens": 2});
        let response = post_raw(&url, body.to_string().into_bytes(), &[]).await;
        assert_eq!(response.status, 200, "{}", response.text());
    }
    let log = stack.ext_proc_log().unwrap();
    assert!(
        log.contains("routing on this picker's own state"),
        "the loss is logged:\n{log}"
    );
    stack.restart_index().await.unwrap();
    until_sharing(&stack, 1.0).await;
}

#[tokio::test]
async fn the_index_relays_a_pickers_news_to_the_others_only() {
    let stack = Stack::start(StackOptions {
        ext_proc_instances: 1,
        ..StackOptions::default()
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    let index = stack.index_grpc_url().unwrap();
    let open = |picker: &'static str| {
        let index = index.clone();
        async move {
            let (tx, rx) = tokio::sync::mpsc::channel::<PickerNews>(16);
            let mut client = KvIndexClient::connect(index).await.unwrap();
            let incoming = client
                .share_decisions(tokio_stream::wrappers::ReceiverStream::new(rx))
                .await
                .unwrap()
                .into_inner();
            (picker, tx, incoming)
        }
    };
    let (a, a_tx, mut a_in) = open("picker-a").await;
    let (_, b_tx, mut b_in) = open("picker-b").await;
    let decided = |picker: &str, decision: u64| PickerNews {
        picker: picker.to_owned(),
        sent_at_unix_us: 1,
        news: Some(News::Decided(PickerDecided {
            decision,
            model: MODEL.to_owned(),
            replica_id: "sim-0".to_owned(),
            keys: vec![1, 2, 3],
            pending_prompt_tokens: 48,
            prompt_tokens: 50,
        })),
    };
    // A malformed message (no picker) is refused; the stream goes on.
    let mut nameless = decided("", 0);
    nameless.picker.clear();
    a_tx.send(nameless).await.unwrap();
    a_tx.send(decided(a, 7)).await.unwrap();
    a_tx.send(PickerNews {
        picker: a.to_owned(),
        sent_at_unix_us: 2,
        news: Some(News::Answered(PickerAnswered { decision: 7 })),
    })
    .await
    .unwrap();
    let first = tokio::time::timeout(settle(), b_in.message())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(first, decided(a, 7), "relayed unchanged");
    let second = tokio::time::timeout(settle(), b_in.message())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert!(matches!(
        second.news,
        Some(News::Answered(PickerAnswered { decision: 7 }))
    ));
    // B's own news go to A, never back to B.
    b_tx.send(decided("picker-b", 1)).await.unwrap();
    let to_a = tokio::time::timeout(settle(), a_in.message())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(to_a.picker, "picker-b");
    // A's next news reach B next: B's own, relayed in between, were not sent back to it.
    a_tx.send(decided(a, 8)).await.unwrap();
    let third = tokio::time::timeout(settle(), b_in.message())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(third, decided(a, 8), "a picker never receives its own news");
    let admin = stack.index_admin_url().unwrap();
    try_poll_until(
        "the index to count the news",
        deadline(settle()),
        || async {
            let text = admin_metrics(&admin).await;
            let count = |outcome: &str| {
                metrics::sum(
                    &text,
                    "kvroute_index_peer_news_total",
                    &[&format!("outcome=\"{outcome}\"")],
                )
            };
            (count("refused") == 1.0 && count("relayed") >= 4.0).then_some(())
        },
    )
    .await
    .unwrap();
}
