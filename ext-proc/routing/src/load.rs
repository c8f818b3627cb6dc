//! Replica load as scoring reads it: the engine's last scraped gauges plus kvroute's own
//! in-flight accounting.
//!
//! Between scrapes, requests kvroute routed count as queued (`routed_since_scrape`), and every
//! routed request holds an [`InflightGuard`] (requests + prompt tokens) until its response
//! headers. Whoever reads the engine's load (ext-proc's scrape loop, a simulator) records it with
//! [`ReplicaLoad::record_scrape`].
//!
//! Each replica also keeps the block keys of its in-flight requests
//! ([`ReplicaLoad::inflight_shared_blocks`]): a sibling sent while its shared prefix is still being
//! prefilled joins that prefill (the engine batches them) instead of queueing behind it, so
//! scoring must not count that work against it.
//!
//! A guard can carry kvroute's [`Prediction`] for its request; released, it adds it to the
//! replica's predicted side ([`ReplicaLoad::predicted`]), which ext-proc's drift detection
//! compares with the engine's own prefix-cache counters.

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use kvroute_block_keys::KeyHasherBuilder;
use parking_lot::{Mutex, RwLock};
use prometheus_client::metrics::gauge::Gauge;

use crate::prefix_memory::MemoryHandle;
use crate::scoring::POOL_LOAD_AVERAGING;

/// Default interval between reads of each replica's load (ext-proc's `scrape.interval`): how
/// stale the scraped part of a [`LoadSnapshot`] gets.
pub const DEFAULT_SCRAPE_INTERVAL: Duration = Duration::from_millis(500);

/// Engine-reported load from the last successful scrape.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Scraped {
    /// Requests waiting in the engine's queue.
    pub waiting: f64,
    /// Requests running in the engine's batch.
    pub running: f64,
    /// KV-cache usage, 0..1.
    pub kv_usage: f64,
}

/// The last scrape, read by every decision without a lock: each gauge on its own. A decision
/// racing a scrape may read one gauge from it and another from the one before, which the
/// estimate cannot tell from a scrape taken a moment earlier.
#[derive(Debug, Default)]
struct ScrapedCell {
    waiting: AtomicU64,
    running: AtomicU64,
    kv_usage: AtomicU64,
}

impl ScrapedCell {
    fn read(&self) -> Scraped {
        let gauge = |cell: &AtomicU64| f64::from_bits(cell.load(Ordering::Relaxed));
        Scraped {
            waiting: gauge(&self.waiting),
            running: gauge(&self.running),
            kv_usage: gauge(&self.kv_usage),
        }
    }

    fn write(&self, scraped: Scraped) {
        let set = |cell: &AtomicU64, value: f64| cell.store(value.to_bits(), Ordering::Relaxed);
        set(&self.waiting, scraped.waiting);
        set(&self.running, scraped.running);
        set(&self.kv_usage, scraped.kv_usage);
    }
}

/// A point-in-time view used for scoring.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct LoadSnapshot {
    /// Last scraped engine load.
    pub scraped: Scraped,
    /// Routed since the last scrape (not yet visible in `scraped`).
    pub routed_since_scrape: f64,
    /// Routed by kvroute and not yet answered.
    pub inflight_requests: f64,
    /// Prompt tokens of those requests.
    pub inflight_prompt_tokens: f64,
}

/// What a replica's in-flight requests share with one prompt ([`ReplicaLoad::inflight_overlap`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct InflightOverlap {
    /// Leading prompt blocks some in-flight request carries (its prefill computes them).
    pub shared_blocks: u32,
    /// In-flight requests that carry as much of the prompt as the replica holds or computes for
    /// it: its siblings, piled where that prefix is (0 when the replica holds more of the prompt
    /// than any request in flight there carries).
    pub siblings: u32,
}

/// What kvroute predicted for one routed request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Prediction {
    /// Prompt tokens predicted to hit the replica's prefix cache ([`engine_hit_tokens`]).
    pub cached_tokens: u64,
    /// Prompt tokens of the request (kvroute's count; estimated at the leading part's bytes per
    /// token when only a long prompt's leading part was tokenized).
    pub prompt_tokens: u64,
}

/// Prompt tokens vLLM reports as prefix-cache hits for a request of `prompt_tokens` tokens whose
/// first `matched_blocks` blocks are cached: whole blocks only, and never the last prompt token.
pub fn engine_hit_tokens(matched_blocks: u32, prompt_tokens: usize, block_size: u32) -> usize {
    let block_size = block_size as usize;
    if block_size == 0 {
        return 0;
    }
    let max_blocks = prompt_tokens.saturating_sub(1) / block_size;
    (matched_blocks as usize).min(max_blocks) * block_size
}

/// A quantity averaged over the last seconds: exponentially decaying, with
/// [`POOL_LOAD_AVERAGING`] as its time constant. Each value folded in stands for the time since
/// the previous one (it is sampled when kvroute decides, which is when the average is read).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct RecentAverage {
    /// When the last value was folded in, and the average then.
    last: Option<(Instant, f64)>,
}

impl RecentAverage {
    /// Folds `value`, observed at `now`, into the average and returns the average. An instant
    /// before the last one (a decision that read the clock before another) counts as the last.
    pub fn fold(&mut self, now: Instant, value: f64) -> f64 {
        let (at, average) = match self.last {
            Some((last, before)) => {
                let elapsed = now.saturating_duration_since(last).as_secs_f64();
                let kept = (-elapsed / POOL_LOAD_AVERAGING.as_secs_f64()).exp();
                (last.max(now), before * kept + value * (1.0 - kept))
            }
            None => (now, value),
        };
        self.last = Some((at, average));
        average
    }
}

/// Live load of one replica.
#[derive(Debug, Default)]
pub struct ReplicaLoad {
    scraped: ScrapedCell,
    consecutive_failures: AtomicU32,
    inflight_requests: AtomicI64,
    inflight_prompt_tokens: AtomicI64,
    routed_since_scrape: AtomicI64,
    /// Block key → in-flight requests carrying it. Bounded by the in-flight requests' prompts.
    /// Block keys are hashes already: a seeded multiply mix, not SipHash (two lookups per key per
    /// request, on the request and the response path).
    inflight_keys: Mutex<HashMap<u64, u32, KeyHasherBuilder>>,
    /// Predicted cached tokens of answered requests (the drift's predicted side).
    predicted_cached_tokens: AtomicU64,
    /// Prompt tokens of those requests.
    predicted_prompt_tokens: AtomicU64,
    /// Mirrors `inflight_requests` (a metric).
    inflight_gauge: Gauge,
}

impl ReplicaLoad {
    /// Current view.
    pub fn snapshot(&self) -> LoadSnapshot {
        let inflight = self.inflight_requests.load(Ordering::Relaxed).max(0);
        LoadSnapshot {
            scraped: self.scraped.read(),
            // A routed request the engine already answered no longer adds load the last scrape
            // missed: only the unanswered ones count.
            routed_since_scrape: self
                .routed_since_scrape
                .load(Ordering::Relaxed)
                .clamp(0, inflight) as f64,
            inflight_requests: inflight as f64,
            inflight_prompt_tokens: self.inflight_prompt_tokens.load(Ordering::Relaxed).max(0)
                as f64,
        }
    }

    /// How many leading `keys` some request in flight on this replica also carries (its prefill
    /// computes them, or did).
    pub fn inflight_shared_blocks(&self, keys: &[u64]) -> u32 {
        let inflight = self.inflight_keys.lock();
        if inflight.is_empty() {
            return 0;
        }
        // Keys are chained, so a request carrying `keys[i]` carries every key before it: the
        // in-flight ones form a leading run and a binary search finds its end.
        let shared = keys.partition_point(|key| inflight.contains_key(key));
        u32::try_from(shared).unwrap_or(u32::MAX)
    }

    /// What the requests in flight on this replica share with a prompt of `keys`, of which the
    /// replica is believed to hold `held_blocks` otherwise (index, routed-prefix memory): the
    /// leading blocks some of them carry ([`ReplicaLoad::inflight_shared_blocks`]) and how many
    /// carry all of that prefix when it reaches at least as far as what is held — under one
    /// lock. A request that shares only the start of the prompt (a system prompt, where this one
    /// goes on with a conversation the replica holds) is no sibling of it.
    pub fn inflight_overlap(&self, keys: &[u64], held_blocks: u32) -> InflightOverlap {
        // Most replicas of a large pool have nothing in flight: no lock for them. A request's
        // keys are counted before the request is (`LoadBoard::start_request`) and uncounted
        // after, so a request this skips is one whose keys were not (or no longer) counted.
        if self.inflight_requests.load(Ordering::Acquire) <= 0 {
            return InflightOverlap::default();
        }
        let inflight = self.inflight_keys.lock();
        if keys
            .first()
            .is_none_or(|first| !inflight.contains_key(first))
        {
            return InflightOverlap::default();
        }
        let shared = keys.partition_point(|key| inflight.contains_key(key));
        let siblings = match shared.checked_sub(1) {
            Some(deepest) if held_blocks as usize <= shared => keys
                .get(deepest)
                .and_then(|key| inflight.get(key))
                .copied()
                .unwrap_or(0),
            _ => 0,
        };
        InflightOverlap {
            shared_blocks: u32::try_from(shared).unwrap_or(u32::MAX),
            siblings,
        }
    }

    /// Records a successful read of the engine's load.
    pub fn record_scrape(&self, scraped: Scraped) {
        self.scraped.write(scraped);
        self.routed_since_scrape.store(0, Ordering::Relaxed);
        self.consecutive_failures.store(0, Ordering::Relaxed);
    }

    /// Records a failed read; returns the failures in a row so far.
    pub fn record_scrape_failure(&self) -> u32 {
        self.consecutive_failures.fetch_add(1, Ordering::Relaxed) + 1
    }

    /// kvroute's side of the drift so far: the predictions of the replica's answered requests.
    pub fn predicted(&self) -> Prediction {
        Prediction {
            cached_tokens: self.predicted_cached_tokens.load(Ordering::Relaxed),
            prompt_tokens: self.predicted_prompt_tokens.load(Ordering::Relaxed),
        }
    }

    /// Whether the replica counts as ready (scrapes have not failed too often in a row; 0: always).
    pub fn is_ready(&self, unready_after_failures: u32) -> bool {
        unready_after_failures == 0
            || self.consecutive_failures.load(Ordering::Relaxed) < unready_after_failures
    }
}

/// Counts a routed request on its replica until released or dropped.
#[derive(Debug)]
pub struct InflightGuard {
    load: Arc<ReplicaLoad>,
    prompt_tokens: i64,
    keys: Vec<u64>,
    /// Whether `keys` count in the replica's in-flight prefixes (the prompt is computed there).
    keys_counted: bool,
    /// kvroute's prediction for the request, added to the drift's predicted side on release.
    prediction: Option<Prediction>,
    /// The replica's routed-prefix memory, told on release that the replica computed `keys`.
    computes_into: Option<MemoryHandle>,
    released: bool,
}

impl Drop for InflightGuard {
    fn drop(&mut self) {
        self.release();
    }
}

impl InflightGuard {
    /// The request's prompt block keys (empty when unknown).
    pub fn keys(&self) -> &[u64] {
        &self.keys
    }

    /// Prompt tokens the replica computes for the request (what it does not hold; 0 once
    /// prefilled elsewhere).
    pub fn pending_prompt_tokens(&self) -> usize {
        usize::try_from(self.prompt_tokens).unwrap_or(0)
    }

    /// Whether the request still counts on its replica.
    pub fn is_held(&self) -> bool {
        !self.released
    }

    /// Counts `prediction` on the replica's predicted side once the request is answered
    /// (released): by then the engine has scheduled it and counted its prefix-cache hits.
    pub fn with_prediction(mut self, prediction: Prediction) -> Self {
        self.prediction = Some(prediction);
        self
    }

    /// On release the replica holds the prompt's keys: marks them computed in its routed-prefix
    /// memory ([`MemoryHandle::mark_computed`]). Release is the first token, or the end of
    /// waiting for it (an error, the stream's end, the in-flight age limit); the mark is then a
    /// guess, as the whole memory is (it believes the keys from the moment they are routed).
    pub fn computing_into(mut self, memory: MemoryHandle) -> Self {
        self.computes_into = Some(memory);
        self
    }

    /// The proxy served the request on another replica (a retry walked the fallback list): the
    /// prediction was for this one, which never scheduled it, so it is not counted in its drift.
    /// Returns the prompt's block keys, for the replica that did serve it.
    pub fn served_elsewhere(&mut self) -> Vec<u64> {
        self.prediction = None;
        self.computes_into = None;
        self.keys.clone()
    }

    /// The request's prompt is computed on another replica (a prefill/decode split): it stays
    /// in flight here, but its prefill is no longer work this replica queues, nor a prefix it
    /// computes — a sibling sent here cannot join that prefill, and would find its blocks only
    /// once they are transferred, after the prefill leg.
    pub fn prefilled_elsewhere(&mut self) {
        if !self.released {
            self.load
                .inflight_prompt_tokens
                .fetch_sub(self.prompt_tokens, Ordering::Relaxed);
            self.uncount_keys();
        }
        self.prompt_tokens = 0;
    }

    /// Takes the prompt's keys out of the replica's in-flight prefixes (once).
    fn uncount_keys(&mut self) {
        if !std::mem::replace(&mut self.keys_counted, false) || self.keys.is_empty() {
            return;
        }
        let mut inflight = self.load.inflight_keys.lock();
        for key in &self.keys {
            if let Some(count) = inflight.get_mut(key) {
                *count -= 1;
                if *count == 0 {
                    inflight.remove(key);
                }
            }
        }
    }

    /// Stops counting the request (idempotent; dropping the guard does the same).
    pub fn release(&mut self) {
        if std::mem::replace(&mut self.released, true) {
            return;
        }
        let load = &self.load;
        if let Some(prediction) = self.prediction {
            load.predicted_cached_tokens
                .fetch_add(prediction.cached_tokens, Ordering::Relaxed);
            load.predicted_prompt_tokens
                .fetch_add(prediction.prompt_tokens, Ordering::Relaxed);
        }
        load.inflight_requests.fetch_sub(1, Ordering::Relaxed);
        load.inflight_prompt_tokens
            .fetch_sub(self.prompt_tokens, Ordering::Relaxed);
        load.inflight_gauge.dec();
        self.uncount_keys();
        if let Some(memory) = self.computes_into.take() {
            memory.mark_computed(&self.keys);
        }
    }
}

/// Makes the gauge a replica's in-flight count is mirrored to (a registered metric).
pub type InflightGaugeFor = Box<dyn Fn(&str) -> Gauge + Send + Sync>;

/// Load of every replica, created on first use.
pub struct LoadBoard {
    replicas: RwLock<crate::ByReplica<Arc<ReplicaLoad>>>,
    inflight_gauge_for: Option<InflightGaugeFor>,
    /// Changes whenever records may have been dropped ([`Self::retain`]).
    epoch: AtomicU64,
}

impl Default for LoadBoard {
    fn default() -> Self {
        Self {
            replicas: RwLock::default(),
            inflight_gauge_for: None,
            epoch: AtomicU64::new(crate::next_epoch()),
        }
    }
}

impl fmt::Debug for LoadBoard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LoadBoard")
            .field("replicas", &self.replicas.read().len())
            .finish_non_exhaustive()
    }
}

impl LoadBoard {
    /// A board whose replicas mirror their in-flight count to `gauge_for(replica)`.
    pub fn with_inflight_gauges(gauge_for: InflightGaugeFor) -> Self {
        Self {
            inflight_gauge_for: Some(gauge_for),
            ..Self::default()
        }
    }

    /// This board's state: another board, or this one after records were dropped, has another
    /// number. Records read while it stays the same are the board's own (a caller may keep them,
    /// a pool of a thousand then not looked up by name per decision); once it changes, a kept
    /// record may be one the board no longer updates.
    pub fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::Acquire)
    }

    /// The load records of `replicas`, in order (created on first use), under one read of the
    /// table when they all exist.
    pub fn replicas(&self, replicas: &[&str]) -> Vec<Arc<ReplicaLoad>> {
        {
            let table = self.replicas.read();
            let found: Option<Vec<Arc<ReplicaLoad>>> = replicas
                .iter()
                .map(|replica| table.get(*replica).map(Arc::clone))
                .collect();
            if let Some(found) = found {
                return found;
            }
        }
        replicas
            .iter()
            .map(|replica| self.replica(replica))
            .collect()
    }

    /// The load record of `replica` (created on first use).
    pub fn replica(&self, replica: &str) -> Arc<ReplicaLoad> {
        if let Some(load) = self.replicas.read().get(replica) {
            return Arc::clone(load);
        }
        let mut replicas = self.replicas.write();
        Arc::clone(replicas.entry(replica.to_owned()).or_insert_with(|| {
            Arc::new(ReplicaLoad {
                inflight_gauge: self
                    .inflight_gauge_for
                    .as_ref()
                    .map_or_else(Gauge::default, |gauge_for| gauge_for(replica)),
                ..ReplicaLoad::default()
            })
        }))
    }

    /// Starts counting a request routed to `replica`: `prompt_tokens` of prefill work it adds,
    /// `keys` the block keys of its prompt (empty when unknown).
    pub fn start_request(
        &self,
        replica: &str,
        prompt_tokens: usize,
        keys: Vec<u64>,
    ) -> InflightGuard {
        let load = self.replica(replica);
        let prompt_tokens = i64::try_from(prompt_tokens).unwrap_or(i64::MAX);
        if !keys.is_empty() {
            let mut inflight = load.inflight_keys.lock();
            for key in &keys {
                *inflight.entry(*key).or_insert(0) += 1;
            }
        }
        load.inflight_requests.fetch_add(1, Ordering::Relaxed);
        load.inflight_prompt_tokens
            .fetch_add(prompt_tokens, Ordering::Relaxed);
        load.routed_since_scrape.fetch_add(1, Ordering::Relaxed);
        load.inflight_gauge.inc();
        InflightGuard {
            load,
            prompt_tokens,
            keys_counted: true,
            keys,
            prediction: None,
            computes_into: None,
            released: false,
        }
    }

    /// A guard for a request kvroute decided but does not place (shadow mode): it counts nothing
    /// on `replica` and only carries the prompt's `keys` for the replica that will serve it.
    pub fn untracked(&self, replica: &str, keys: Vec<u64>) -> InflightGuard {
        InflightGuard {
            load: self.replica(replica),
            prompt_tokens: 0,
            keys,
            keys_counted: false,
            prediction: None,
            computes_into: None,
            released: true,
        }
    }

    /// Forgets replicas `keep` says no.
    pub fn retain(&self, keep: impl Fn(&str) -> bool) {
        let mut replicas = self.replicas.write();
        replicas.retain(|id, _| keep(id));
        self.epoch.store(crate::next_epoch(), Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_board_state_has_a_number_of_its_own() {
        let board = LoadBoard::default();
        let before = board.epoch();
        drop(board.replica("r0"));
        assert_eq!(board.epoch(), before, "a record added drops none");
        board.retain(|id| id != "r0");
        assert_ne!(board.epoch(), before, "a record may have been dropped");
        assert_ne!(LoadBoard::default().epoch(), board.epoch(), "another board");
    }

    #[test]
    fn inflight_keys_live_as_long_as_their_requests() {
        let board = LoadBoard::default();
        let first = board.start_request("r0", 48, vec![1, 2, 3]);
        let sibling = board.start_request("r0", 16, vec![1, 2, 4]);
        let load = board.replica("r0");
        assert_eq!(load.inflight_shared_blocks(&[1, 2, 3, 9]), 3);
        assert_eq!(board.replica("r1").inflight_shared_blocks(&[1]), 0);
        drop(first);
        assert_eq!(load.inflight_shared_blocks(&[1, 2, 3]), 2);
        let mut sibling = sibling;
        sibling.release();
        assert!(!sibling.is_held());
        assert_eq!(load.inflight_shared_blocks(&[1, 2, 3]), 0);
        assert_eq!(load.snapshot().inflight_requests, 0.0);
        drop(sibling);
        assert_eq!(load.snapshot().inflight_requests, 0.0, "released once");
        assert!(load.inflight_keys.lock().is_empty());
    }

    #[test]
    fn a_prompt_prefilled_elsewhere_leaves_the_request_but_not_its_work() {
        let board = LoadBoard::default();
        let mut split = board.start_request("r0", 3000, vec![1, 2]);
        let _whole = board.start_request("r0", 500, Vec::new());
        let _sibling = board.start_request("r0", 16, vec![1, 3]);
        split.prefilled_elsewhere();
        split.prefilled_elsewhere();
        let load = board.replica("r0");
        assert_eq!(load.snapshot().inflight_prompt_tokens, 516.0);
        assert_eq!(load.snapshot().inflight_requests, 3.0);
        // Its prefix is computed elsewhere: only the sibling's first block is in flight here.
        assert_eq!(load.inflight_shared_blocks(&[1, 2]), 1);
        assert_eq!(
            split.keys(),
            [1, 2],
            "still known, for the replica that serves it"
        );
        drop(split);
        assert_eq!(
            load.inflight_shared_blocks(&[1, 3]),
            2,
            "the sibling's keys stay"
        );
        assert_eq!(
            load.snapshot().inflight_prompt_tokens,
            516.0,
            "subtracted once"
        );
        assert_eq!(load.snapshot().inflight_requests, 2.0);
    }

    #[test]
    fn a_released_prediction_counts_once_on_the_predicted_side() {
        let board = LoadBoard::default();
        let guard = board
            .start_request("r0", 10, Vec::new())
            .with_prediction(Prediction {
                cached_tokens: 32,
                prompt_tokens: 64,
            });
        assert_eq!(board.replica("r0").predicted(), Prediction::default());
        drop(guard);
        assert_eq!(
            board.replica("r0").predicted(),
            Prediction {
                cached_tokens: 32,
                prompt_tokens: 64
            }
        );
    }

    #[test]
    fn hit_tokens_follow_vllms_rule() {
        // Whole blocks, and a full hit still recomputes the last prompt token.
        assert_eq!(engine_hit_tokens(4, 64, 16), 48);
        assert_eq!(engine_hit_tokens(4, 65, 16), 64);
        assert_eq!(engine_hit_tokens(2, 65, 16), 32);
        assert_eq!(engine_hit_tokens(9, 0, 16), 0);
        assert_eq!(engine_hit_tokens(9, 1, 16), 0);
        assert_eq!(engine_hit_tokens(1, 17, 16), 16);
        assert_eq!(engine_hit_tokens(1, 16, 16), 0);
        assert_eq!(engine_hit_tokens(3, 100, 0), 0);
    }

    #[test]
    fn a_recent_average_follows_the_load_over_seconds() {
        let mut load = RecentAverage::default();
        let start = Instant::now();
        let at = |ms: u64| start + Duration::from_millis(ms);
        assert_eq!(load.fold(at(0), 0.0), 0.0);
        // A burst's moment of load barely moves it...
        let burst = load.fold(at(10), 400.0);
        assert!(burst > 0.0 && burst < 5.0, "{burst}");
        // ...a load held for seconds does (one time constant: about 63 % of the way).
        let mut average = burst;
        for ms in (100..=2010).step_by(100) {
            average = load.fold(at(ms), 400.0);
        }
        assert!(
            (average - 400.0 * (1.0 - (-1.0f64).exp())).abs() < 20.0,
            "{average}"
        );
        // An earlier instant (a decision that read the clock before the last) moves nothing back.
        let again = load.fold(at(1000), 400.0);
        assert!((again - average).abs() < 1e-9, "{again} vs {average}");
        // Idle again for long: back near zero.
        let later = load.fold(at(20_000), 0.0);
        assert!(later < 1.0, "{later}");
    }

    #[test]
    fn siblings_carry_as_much_of_the_prompt_as_the_replica_holds() {
        let board = LoadBoard::default();
        let system: Vec<u64> = vec![1, 2];
        let with = |tail: &[u64]| [system.as_slice(), tail].concat();
        // Two conversations in flight on r0, sharing only the system prompt with a third one
        // whose history (blocks 30, 31) r0 holds.
        let _a = board.start_request("r0", 100, with(&[10, 11]));
        let _b = board.start_request("r0", 100, with(&[20, 21]));
        let load = board.replica("r0");
        let third = with(&[30, 31, 32]);
        let overlap = load.inflight_overlap(&third, 4);
        assert_eq!((overlap.shared_blocks, overlap.siblings), (2, 0));
        // A new conversation r0 holds nothing of beyond the system prompt: the two are siblings.
        let new = with(&[40]);
        assert_eq!(load.inflight_overlap(&new, 2).siblings, 2);
        assert_eq!(load.inflight_overlap(&new, 0).siblings, 2);
        // A burst on one new context: every request in flight carries all of it.
        let _c = board.start_request("r0", 100, with(&[50, 51, 52]));
        let _d = board.start_request("r0", 10, with(&[50, 51, 53]));
        let sibling = with(&[50, 51, 54]);
        let overlap = load.inflight_overlap(&sibling, 2);
        assert_eq!((overlap.shared_blocks, overlap.siblings), (4, 2));
        // Nothing in flight shares the first block: nothing at all.
        assert_eq!(
            load.inflight_overlap(&[99, 100], 0),
            InflightOverlap::default()
        );
    }
}
