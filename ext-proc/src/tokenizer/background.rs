//! One idle-priority thread for whole tokenizations no decision waits for.
//!
//! A long prompt decided from its leading tokens, or a conversation-prefix hit routed on its
//! cached prefix, is tokenized whole afterwards so that the conversation's next turn finds it
//! cached. That is milliseconds of CPU per request (a 32k-token Qwen3 chat ≈ 1.6 ms); beside
//! the decisions it would delay them. Here it runs on a thread of its own in the idle scheduling
//! class (`SCHED_IDLE`): it runs only on CPU time nothing else wants, and a waking decision
//! preempts it at once. Any other class lets a running job finish its slice, which the kernel
//! checks at its tick, so long decisions beside a niced lane waited milliseconds at the tail
//! (docs/benchmarks-history-2026-12.md, "Latency through Envoy with real tokenizers").
//!
//! The price: when the decisions (or, outside a pod's own cgroup, other processes) keep every
//! CPU busy, the lane waits, its queue fills and further jobs are refused — counted in
//! `tokenize_background_skipped_total`; those conversations' next turns decide from their
//! leading tokens. A job's code must never hold a lock a decision takes (the thread may be
//! preempted inside it): jobs hand their results to the runtime to be cached.

use std::sync::mpsc;
use std::thread::JoinHandle;

/// A unit of background work.
type Job = Box<dyn FnOnce() + Send>;

/// Jobs waiting behind the one running; beyond them [`BackgroundLane::run`] refuses. Each holds
/// its prompt (at most `limits.tokenize_max_prompt_bytes`); a burst of long first turns (each
/// ≈ 1.6 ms of work at 32k tokens) arriving faster than the lane runs them fits.
const QUEUED_JOBS: usize = 16;

/// The idle-priority thread and its bounded queue (a lock-free channel: a decision queuing a
/// job never waits for the thread); dropping it lets the thread finish the queued jobs, then
/// ends (and joins) it.
#[derive(Debug)]
pub(crate) struct BackgroundLane {
    jobs: Option<mpsc::SyncSender<Job>>,
    thread: Option<JoinHandle<()>>,
}

impl BackgroundLane {
    /// Starts the thread.
    pub(crate) fn start() -> std::io::Result<Self> {
        let (jobs, queue) = mpsc::sync_channel::<Job>(QUEUED_JOBS);
        let thread = std::thread::Builder::new()
            .name("kvroute-tokenize-later".to_owned())
            .spawn(move || {
                enter_idle_class();
                while let Ok(job) = queue.recv() {
                    // A panicking job (a tokenizer bug) must not end the lane for the others.
                    if std::panic::catch_unwind(std::panic::AssertUnwindSafe(job)).is_err() {
                        tracing::error!("a background tokenization panicked");
                    }
                }
            })?;
        Ok(Self {
            jobs: Some(jobs),
            thread: Some(thread),
        })
    }

    /// Queues `job`; `false` when the queue is full (background work is skipped, never waited
    /// for) or the lane has stopped.
    pub(crate) fn run(&self, job: impl FnOnce() + Send + 'static) -> bool {
        self.jobs
            .as_ref()
            .is_some_and(|jobs| jobs.try_send(Box::new(job)).is_ok())
    }
}

impl Drop for BackgroundLane {
    fn drop(&mut self) {
        drop(self.jobs.take());
        if let Some(thread) = self.thread.take()
            && thread.join().is_err()
        {
            tracing::error!("the background tokenization thread panicked");
        }
    }
}

/// Moves the calling thread into the idle scheduling class (Linux; elsewhere, and on a failure,
/// logged, it stays at normal priority).
fn enter_idle_class() {
    #[cfg(target_os = "linux")]
    {
        use thread_priority::{
            NormalThreadSchedulePolicy, ThreadPriority, ThreadSchedulePolicy,
            set_thread_priority_and_policy, thread_native_id,
        };
        if let Err(error) = set_thread_priority_and_policy(
            thread_native_id(),
            ThreadPriority::Min,
            ThreadSchedulePolicy::Normal(NormalThreadSchedulePolicy::Idle),
        ) {
            tracing::warn!(%error, "background tokenizations run at normal priority");
        }
    }
    #[cfg(not(target_os = "linux"))]
    tracing::info!("background tokenizations run at normal priority (no idle class here)");
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc::{Receiver, channel};
    use std::time::Duration;

    use super::*;

    /// The lane's idle-class thread gets almost no CPU while others keep both busy (the
    /// real-vLLM tier's engines did): a long deadline, scaled as every suite's.
    fn within_deadline<T>(results: &Receiver<T>) -> T {
        results
            .recv_timeout(kvroute_test_support::deadline(Duration::from_secs(60)))
            .expect("the lane ran the job")
    }

    #[test]
    fn runs_work_in_the_idle_class_and_refuses_past_its_queue() {
        let lane = BackgroundLane::start().expect("lane");
        #[cfg(target_os = "linux")]
        {
            use thread_priority::{NormalThreadSchedulePolicy, ThreadSchedulePolicy};
            let (done, policy) = channel();
            assert!(lane.run(move || {
                let _ = done.send(thread_priority::thread_schedule_policy().ok());
            }));
            assert_eq!(
                within_deadline(&policy),
                Some(ThreadSchedulePolicy::Normal(
                    NormalThreadSchedulePolicy::Idle
                ))
            );
        }
        // Hold the lane with one job, fill its queue, and the next is refused.
        let (release, blocked) = channel::<()>();
        let (running, started) = channel::<()>();
        assert!(lane.run(move || {
            let _ = running.send(());
            let _ = blocked.recv();
        }));
        within_deadline(&started);
        let (done, results) = channel();
        // A job that reports `i` once it runs.
        let report = |i: usize| {
            let done = done.clone();
            move || {
                let _ = done.send(i);
            }
        };
        for i in 0..QUEUED_JOBS {
            assert!(lane.run(report(i)));
        }
        assert!(!lane.run(|| ()), "a full lane refuses");
        release.send(()).expect("release");
        for i in 0..QUEUED_JOBS {
            assert_eq!(within_deadline(&results), i, "in order");
        }
        // A panicking job does not end the lane.
        assert!(lane.run(|| panic!("a tokenizer bug")));
        assert!(lane.run(report(7)));
        assert_eq!(within_deadline(&results), 7);
        // Dropping the lane runs what is queued, then ends the thread.
        for i in 100..110 {
            assert!(lane.run(report(i)));
        }
        drop(lane);
        assert_eq!(
            results.try_iter().collect::<Vec<_>>(),
            (100..110).collect::<Vec<_>>()
        );
    }
}
