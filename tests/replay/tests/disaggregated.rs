//! Disaggregated fleets: a split request's legs as the engines run them, and kvroute's split
//! decisions as ext-proc's picker makes them (one implementation).
#![allow(clippy::unwrap_used, reason = "test helpers panic on broken fixtures")]

use kvroute_ext_proc::config::{Disaggregation, DisaggregationMode, PrefillLegSettings};
use kvroute_ext_proc::picker::SplitVerdict as PickerVerdict;
use kvroute_replay::BLOCK_TOKENS;
use kvroute_replay::engine::EngineConfig;
use kvroute_replay::routers::{Kvroute, RouterSpec};
use kvroute_replay::sim::{self, SimConfig};
use kvroute_replay::timing::{MockerFit, PrefillChunk, TimingModel};
use kvroute_replay::trace::{Request, TraceRecord, prepare};
use rand::SeedableRng;
use rand::rngs::StdRng;

/// One prefill-only and one decode replica, KV events delivered at once.
fn one_by_one() -> SimConfig {
    SimConfig {
        replicas: 2,
        engine: EngineConfig {
            blocks: 256,
            ..EngineConfig::default()
        },
        timing: MockerFit::default(),
        kv_delay_us: 0,
        prefill_replicas: 1,
    }
}

fn request(id: usize, at_us: u64, blocks: u64, first_key: u64, output: u32) -> Request {
    let mut request = prepare(
        id,
        &TraceRecord {
            timestamp: 0,
            input_length: blocks as u32 * BLOCK_TOKENS,
            output_length: output,
            hash_ids: (first_key..first_key + blocks).collect(),
            session_id: None,
        },
    )
    .unwrap();
    request.arrival_us = at_us;
    request
}

#[test]
fn a_split_request_decodes_without_computing_its_prompt_and_waits_for_the_transfer() {
    let config = one_by_one();
    let requests = [request(0, 0, 8, 100, 1)];
    let timing = config.timing;
    let prompt = 8 * BLOCK_TOKENS;
    let prefill_us = timing.step_us(
        &[PrefillChunk {
            tokens: prompt,
            context: 0,
        }],
        0,
    );
    let transfer_us = timing.kv_transfer_duration(8, BLOCK_TOKENS).as_micros() as u64;
    let last_token_us = timing.step_us(
        &[PrefillChunk {
            tokens: 1,
            context: prompt - 1,
        }],
        0,
    );
    assert!(transfer_us > 0);
    for spec in ["pd-kvroute", "pd-llmd", "pd-dynamo"] {
        let spec = RouterSpec::parse(spec).unwrap();
        let mut router = spec.build(config.replicas, config.engine.blocks, 0);
        let result = sim::run(&requests, &config, router.as_mut()).unwrap();
        let outcome = result.outcomes[0];
        assert_eq!((outcome.replica, outcome.prefill), (1, Some(0)), "{spec:?}");
        // TTFT as the client sees it: the prefill leg, the transfer, then the decode leg's one
        // recomputed token.
        assert_eq!(
            outcome.ttft_us,
            prefill_us + transfer_us + last_token_us,
            "{spec:?}"
        );
        // The decode replica computed one token of the prompt, no more.
        assert_eq!(result.busy_us, vec![prefill_us, last_token_us], "{spec:?}");
    }
    // Served whole, the same request costs the prefill on the decode replica and no transfer.
    let mut router = RouterSpec::Kvroute.build(config.replicas, config.engine.blocks, 0);
    let whole = sim::run(&requests, &config, router.as_mut()).unwrap();
    assert_eq!(whole.outcomes[0].prefill, None);
    assert_eq!(whole.outcomes[0].ttft_us, prefill_us);
}

#[test]
fn kvroute_splits_as_the_picker_decides_on_the_same_facts() {
    // ext-proc's pool setting, fed to replay's kvroute as is.
    let disaggregation = Disaggregation {
        mode: DisaggregationMode::Sidecar,
        min_prompt_tokens: 2 * BLOCK_TOKENS as usize,
        min_uncached_tokens: 3 * BLOCK_TOKENS as usize,
        max_prefill_queue: Some(kvroute_routing::split::DEFAULT_MAX_PREFILL_QUEUE),
        prefill: PrefillLegSettings {
            timeout: std::time::Duration::from_secs(1),
            retries: 0,
            max_concurrent: 1,
        },
    };
    let mut config = one_by_one();
    config.replicas = 3;
    // Far apart: each request finds the previous one's blocks indexed.
    let gap = 100_000_000;
    let requests = [
        // Long and new: split.
        request(0, 0, 8, 100, 4),
        // Short: whole.
        request(1, gap, 1, 500, 4),
        // The first prompt again, cached on its decode replica: whole, there.
        request(2, 2 * gap, 8, 100, 4),
        // The first prompt and 4 new blocks: 4 uncached blocks on that replica, over the
        // threshold: split.
        request(3, 3 * gap, 12, 100, 4),
    ];
    let mut router = Kvroute::new(
        config.replicas,
        config.engine.blocks,
        StdRng::seed_from_u64(3),
    )
    .disaggregating(disaggregation.rule());
    let result = sim::run(&requests, &config, &mut router).unwrap();
    let verdicts = router.verdicts().to_vec();
    // The picker's decision on each request's facts: its prompt and the tokens cached on the
    // decode replica chosen (the engine's count: a whole-prompt hit leaves its last block to
    // compute; the index knew them by then).
    let cached = [0, 0, 7 * BLOCK_TOKENS as usize, 8 * BLOCK_TOKENS as usize];
    let expected: Vec<PickerVerdict> = requests
        .iter()
        .zip(cached)
        .map(|(r, cached)| {
            PickerVerdict::of(
                &disaggregation.rule(),
                r.input_tokens as usize,
                cached,
                kvroute_routing::PrefillSide::Available,
            )
        })
        .collect();
    assert_eq!(verdicts, expected);
    assert_eq!(
        expected,
        [
            PickerVerdict::Split,
            PickerVerdict::ShortPrompt,
            PickerVerdict::Cached,
            PickerVerdict::Split,
        ]
    );
    let split: Vec<bool> = result
        .outcomes
        .iter()
        .map(|o| o.prefill.is_some())
        .collect();
    assert_eq!(split, [true, false, false, true]);
    assert_eq!(result.outcomes[3].replica, result.outcomes[0].replica);
    // The cached prompt went back to the decode replica holding it, and decode replicas only.
    assert_eq!(result.outcomes[2].replica, result.outcomes[0].replica);
    assert!(result.outcomes.iter().all(|o| o.replica >= 1));
    assert!(result.outcomes[0].prefill == Some(0));
}

#[test]
fn a_queued_prefill_pool_hands_long_prompts_to_an_idle_decode_replica() {
    use kvroute_replay::routers::DEFAULT_SPLIT_RULE;
    use kvroute_routing::SplitRule;
    // A burst of distinct long prompts at once: the one prefill replica's queue grows by each
    // prompt's prefill (kvroute's in-flight accounting; no scrape has seen them yet).
    let config = one_by_one();
    let blocks = 8192 / u64::from(BLOCK_TOKENS);
    let requests: Vec<Request> = (0..8)
        .map(|i| request(i, 0, blocks, 1_000 * (i as u64 + 1), 1))
        .collect();
    let verdicts_with = |rule: SplitRule| {
        let mut router = Kvroute::new(
            config.replicas,
            config.engine.blocks,
            StdRng::seed_from_u64(5),
        )
        .disaggregating(rule);
        let result = sim::run(&requests, &config, &mut router).unwrap();
        for (verdict, outcome) in router.verdicts().iter().zip(&result.outcomes) {
            assert_eq!(outcome.prefill.is_some(), *verdict == PickerVerdict::Split);
        }
        router.verdicts().to_vec()
    };
    let unbounded = verdicts_with(SplitRule {
        max_prefill_queue: None,
        ..DEFAULT_SPLIT_RULE
    });
    assert!(
        unbounded.iter().all(|v| *v == PickerVerdict::Split),
        "{unbounded:?}"
    );
    let bounded = verdicts_with(DEFAULT_SPLIT_RULE);
    assert_eq!(bounded[0], PickerVerdict::Split, "{bounded:?}");
    let busy = bounded
        .iter()
        .position(|v| *v == PickerVerdict::PrefillBusy)
        .unwrap_or_else(|| panic!("the prefill queue passed 1 s: {bounded:?}"));
    // Once the decode replica's own queue (the prompts it took whole) is longer than the
    // prefill replica's, splitting resumes.
    assert!(
        bounded[busy..].contains(&PickerVerdict::Split),
        "{bounded:?}"
    );
}
