//! One low-priority thread for whole tokenizations no decision waits for.
//!
//! A long prompt decided from its leading tokens, or a conversation-prefix hit routed on its
//! cached prefix, is tokenized whole afterwards so that the conversation's next turn finds it
//! cached. That is milliseconds of CPU per request (a 32k-token Qwen3 chat ≈ 3.5 ms); on the
//! blocking pool at normal priority it competes with the decisions and the proxy running beside
//! it. Here it runs on a thread of its own at a low priority (nice [`NICE`]): the kernel gives
//! it mostly the CPU nothing else wants, yet (unlike `SCHED_IDLE`) a share on a saturated host,
//! so queued work still ends.

use std::sync::mpsc;
use std::thread::JoinHandle;

/// A unit of background work.
type Job = Box<dyn FnOnce() + Send>;

/// Jobs waiting behind the one running; beyond them [`BackgroundLane::run`] refuses. Each holds
/// its prompt (at most `limits.tokenize_max_prompt_bytes`); a burst of long first turns (each
/// ≈ 3.5 ms of work at 32k tokens) arriving faster than the lane runs them fits.
const QUEUED_JOBS: usize = 16;
/// The lane thread's nice value: ≈ a tenth of a normal thread's share of a contended core
/// (the kernel's weights fall ≈ 1.25× per step), so decisions come first, yet a saturated host
/// still runs it (at 19, beside four busy threads on two cores, turns found their previous turn
/// untokenized).
const NICE: i32 = 10;

/// The low-priority thread and its bounded queue; dropping it ends the thread after its current
/// job (and joins it).
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
                lower_priority();
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

/// Lowers the calling thread to [`NICE`] (Linux: `setpriority` on a thread id is per thread).
/// A failure leaves it at normal priority, logged.
fn lower_priority() {
    #[cfg(target_os = "linux")]
    {
        let thread = rustix::thread::gettid();
        if let Err(error) = rustix::process::setpriority_process(Some(thread), NICE) {
            tracing::warn!(%error, "background tokenizations run at normal priority");
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc::{Receiver, channel};
    use std::time::Duration;

    use super::*;

    fn within_deadline<T>(results: &Receiver<T>) -> T {
        results
            .recv_timeout(Duration::from_secs(10))
            .expect("the lane ran the job")
    }

    #[test]
    fn runs_work_at_low_priority_and_refuses_past_its_queue() {
        let lane = BackgroundLane::start().expect("lane");
        #[cfg(target_os = "linux")]
        {
            let (done, nice) = channel();
            // On the lane thread `getpriority_process(None)` reads that thread's own nice value.
            assert!(lane.run(move || {
                let _ = done.send(rustix::process::getpriority_process(None));
            }));
            assert_eq!(within_deadline(&nice).expect("getpriority"), NICE);
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
        for i in 0..QUEUED_JOBS {
            let done = done.clone();
            assert!(lane.run(move || {
                let _ = done.send(i);
            }));
        }
        assert!(!lane.run(|| ()), "a full lane refuses");
        release.send(()).expect("release");
        for i in 0..QUEUED_JOBS {
            assert_eq!(within_deadline(&results), i, "in order");
        }
        // A panicking job does not end the lane.
        assert!(lane.run(|| panic!("a tokenizer bug")));
        let done_after = done.clone();
        assert!(lane.run(move || {
            let _ = done_after.send(7);
        }));
        assert_eq!(within_deadline(&results), 7);
    }
}
