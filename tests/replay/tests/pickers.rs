//! Several pickers on one fleet (`kvroute-x<N>`): alone, the glue decides as one kvroute.
#![allow(clippy::unwrap_used, reason = "test helpers panic on broken fixtures")]

use kvroute_replay::engine::EngineConfig;
use kvroute_replay::routers::RouterSpec;
use kvroute_replay::sim::{self, SimConfig};
use kvroute_replay::timing::MockerFit;
use kvroute_replay::trace;
use kvroute_replay::workload::{self, Kind};

fn fleet(replicas: usize) -> SimConfig {
    SimConfig {
        replicas,
        engine: EngineConfig {
            blocks: 1024,
            ..EngineConfig::default()
        },
        timing: MockerFit::default(),
        kv_delay_us: 50_000,
        prefill_replicas: 0,
    }
}

#[test]
fn one_picker_decides_exactly_as_kvroute() {
    let requests =
        trace::prepare_all(&workload::generate(Kind::parse("multi-turn").unwrap(), 1)).unwrap();
    let config = fleet(4);
    let run = |spec: RouterSpec| {
        let mut router = spec.build(config.replicas, config.engine.blocks, 7);
        sim::run(&requests, &config, router.as_mut()).unwrap()
    };
    assert_eq!(
        run(RouterSpec::parse("kvroute-x1").unwrap()),
        run(RouterSpec::Kvroute)
    );
}

#[test]
fn a_sharing_delay_is_named_in_milliseconds_fractions_included() {
    for name in [
        "kvroute-x4",
        "kvroute-x4-s1",
        "kvroute-x4-s0.1",
        "kvroute-x2-s0",
        "kvroute-x8-s100",
    ] {
        assert_eq!(RouterSpec::parse(name).unwrap().name(), name);
    }
    assert_eq!(
        RouterSpec::parse("kvroute-x4-s0.25"),
        Some(RouterSpec::Pickers {
            count: 4,
            share_us: Some(250)
        })
    );
    for refused in [
        "kvroute-x4-s-1",
        "kvroute-x4-sinf",
        "kvroute-x4-sNaN",
        "kvroute-x0-s1",
        "kvroute-x4-s",
    ] {
        assert_eq!(RouterSpec::parse(refused), None, "{refused}");
    }
}
