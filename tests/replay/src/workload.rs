//! Synthetic workloads written as Mooncake records (512-token hash-id blocks).
//!
//! - [`Kind::SharedPrefix`]: llm-d's shared-prefix benchmark shape. `groups` long system
//!   prompts; each group has `users` users with a short profile block; each request is one of
//!   them asking a short new question. Poisson arrivals.
//! - [`Kind::MultiTurn`]: chat conversations whose prompt grows every turn by the previous
//!   answer and a new message; the previous prompt's full blocks are the next prompt's prefix.
//!   Conversations start as a Poisson process, turns follow after an exponential think time.
//! - [`Kind::FanOut`]: agents that fan out bursts of siblings sharing a long context (all sent
//!   within a few ms), then merge the results into a longer context for the next round.
//!
//! Every record carries its session id (the user, conversation or agent), so session-sticky
//! routing has the key a real deployment would send.
//!
//! Deterministic given the seed. Fresh hash ids come from one counter, so ids never collide
//! across groups, users, conversations or agents.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::BLOCK_TOKENS;
use crate::trace::{SessionId, TraceRecord};

/// Which workload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// llm-d shared prefix: groups × users, long system prompt, short questions.
    SharedPrefix,
    /// Multi-turn chat with growing history.
    MultiTurn,
    /// Agentic fan-out bursts.
    FanOut,
}

impl Kind {
    /// Every kind.
    pub const ALL: [Kind; 3] = [Kind::SharedPrefix, Kind::MultiTurn, Kind::FanOut];

    /// Name used on the command line and in reports.
    pub fn name(self) -> &'static str {
        match self {
            Kind::SharedPrefix => "shared-prefix",
            Kind::MultiTurn => "multi-turn",
            Kind::FanOut => "fan-out",
        }
    }

    /// Looks a kind up by name.
    pub fn parse(name: &str) -> Option<Kind> {
        Kind::ALL.into_iter().find(|k| k.name() == name)
    }
}

/// Generates a workload.
pub fn generate(kind: Kind, seed: u64) -> Vec<TraceRecord> {
    let mut generator = Generator {
        rng: StdRng::seed_from_u64(seed),
        next_id: 0,
    };
    let mut records = match kind {
        Kind::SharedPrefix => generator.shared_prefix(),
        Kind::MultiTurn => generator.multi_turn(),
        Kind::FanOut => generator.fan_out(),
    };
    records.sort_by_key(|r| r.timestamp);
    records
}

struct Generator {
    rng: StdRng,
    next_id: u64,
}

impl Generator {
    fn fresh(&mut self, n: usize) -> Vec<u64> {
        let ids = (self.next_id..self.next_id + n as u64).collect();
        self.next_id += n as u64;
        ids
    }

    /// Exponential sample with this mean.
    fn exp(&mut self, mean: f64) -> f64 {
        let u: f64 = self.rng.random_range(f64::EPSILON..1.0);
        -mean * u.ln()
    }

    /// A record of `session` whose prompt is `prefix` (full blocks) followed by `extra` new
    /// tokens.
    fn record(
        &mut self,
        session: u64,
        at_ms: f64,
        prefix: &[u64],
        extra: u32,
        output: u32,
    ) -> TraceRecord {
        let input = prefix.len() as u32 * BLOCK_TOKENS + extra;
        let mut hash_ids = prefix.to_vec();
        let tail = input.div_ceil(BLOCK_TOKENS) as usize - prefix.len();
        hash_ids.extend(self.fresh(tail));
        TraceRecord {
            timestamp: at_ms.round() as u64,
            input_length: input,
            output_length: output,
            hash_ids,
            session_id: Some(SessionId::Number(session)),
        }
    }

    fn shared_prefix(&mut self) -> Vec<TraceRecord> {
        const GROUPS: usize = 256;
        const USERS: usize = 8;
        const SYSTEM_BLOCKS: usize = 24;
        const REQUESTS: usize = 4000;
        const RATE_PER_S: f64 = 4.0;
        let groups: Vec<Vec<Vec<u64>>> = (0..GROUPS)
            .map(|_| {
                let system = self.fresh(SYSTEM_BLOCKS);
                (0..USERS)
                    .map(|_| {
                        let mut prefix = system.clone();
                        prefix.extend(self.fresh(1));
                        prefix
                    })
                    .collect()
            })
            .collect();
        let mut t = 0.0;
        (0..REQUESTS)
            .map(|_| {
                t += self.exp(1000.0 / RATE_PER_S);
                let g = self.rng.random_range(0..GROUPS);
                let u = self.rng.random_range(0..USERS);
                let question = self.rng.random_range(64..1024);
                let output = self.rng.random_range(64..512);
                let user = (g * USERS + u) as u64;
                self.record(user, t, &groups[g][u].clone(), question, output)
            })
            .collect()
    }

    fn multi_turn(&mut self) -> Vec<TraceRecord> {
        const CONVERSATIONS: usize = 800;
        const START_RATE_PER_S: f64 = 1.0;
        const THINK_MS: f64 = 30_000.0;
        const SYSTEM_BLOCKS: usize = 4;
        let system = self.fresh(SYSTEM_BLOCKS);
        let mut records = Vec::new();
        let mut start = 0.0;
        for conversation in 0..CONVERSATIONS as u64 {
            start += self.exp(1000.0 / START_RATE_PER_S);
            let turns = self.rng.random_range(2..=10);
            let mut t = start;
            // Full blocks of the history so far, and tokens past them.
            let mut history = system.clone();
            let mut loose: u32 = self.rng.random_range(200..2000);
            for _ in 0..turns {
                let output = self.rng.random_range(100..600);
                let record = self.record(conversation, t, &history, loose, output);
                // Next prompt: this prompt's full blocks, then its partial block, the answer
                // and a new message (a partial block's content changes, so it gets a new id).
                let full = (record.input_length / BLOCK_TOKENS) as usize;
                history = record.hash_ids[..full].to_vec();
                loose =
                    record.input_length % BLOCK_TOKENS + output + self.rng.random_range(50..800);
                records.push(record);
                t += self.exp(THINK_MS);
            }
        }
        records
    }

    fn fan_out(&mut self) -> Vec<TraceRecord> {
        const AGENTS: usize = 60;
        const START_RATE_PER_S: f64 = 0.2;
        const TOOL_PROMPT_BLOCKS: usize = 8;
        let tools = self.fresh(TOOL_PROMPT_BLOCKS);
        let mut records = Vec::new();
        let mut start = 0.0;
        for agent in 0..AGENTS as u64 {
            start += self.exp(1000.0 / START_RATE_PER_S);
            let mut context = tools.clone();
            let task = self.rng.random_range(4..16);
            context.extend(self.fresh(task));
            let rounds = self.rng.random_range(3..=6);
            let mut t = start;
            for _ in 0..rounds {
                let siblings = self.rng.random_range(4..=24);
                for _ in 0..siblings {
                    let jitter = self.rng.random_range(0.0..5.0);
                    let instruction = self.rng.random_range(32..480);
                    let output = self.rng.random_range(50..300);
                    records.push(self.record(agent, t + jitter, &context, instruction, output));
                }
                // The merged results extend the context for the next round.
                let merged = self.rng.random_range(2..8);
                context.extend(self.fresh(merged));
                t += self.rng.random_range(2_000.0..10_000.0);
            }
        }
        records
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::prepare_all;

    #[test]
    fn every_kind_is_valid_and_deterministic() {
        for kind in Kind::ALL {
            let records = generate(kind, 7);
            assert!(records.len() > 500, "{kind:?}");
            assert_eq!(records, generate(kind, 7));
            assert_ne!(records, generate(kind, 8));
            let requests = prepare_all(&records).unwrap();
            let shared = requests
                .iter()
                .filter(|r| r.keys().first() == requests[0].keys().first())
                .count();
            assert!(shared > 1, "{kind:?}: prefixes are shared");
        }
    }

    #[test]
    fn multi_turn_prompts_extend_the_previous_turn() {
        let records = generate(Kind::MultiTurn, 1);
        // Some later record starts with all full blocks of an earlier one, beyond the system prompt.
        let first = &records[0];
        let full = (first.input_length / BLOCK_TOKENS) as usize;
        assert!(
            records[1..]
                .iter()
                .any(|r| r.hash_ids.len() > full && r.hash_ids[..full] == first.hash_ids[..full])
        );
    }
}
