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

    /// Queues `work`; its result arrives on the receiver (closed if it panicked). `None` when
    /// the queue is full: background work is skipped, never waited for.
    pub(crate) fn run<T: Send + 'static>(
        &self,
        work: impl FnOnce() -> T + Send + 'static,
    ) -> Option<tokio::sync::oneshot::Receiver<T>> {
        let (done, result) = tokio::sync::oneshot::channel();
        let job: Job = Box::new(move || {
            let _ = done.send(work());
        });
        self.jobs.as_ref()?.try_send(job).ok()?;
        Some(result)
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
    use super::*;

    #[tokio::test]
    async fn runs_work_at_low_priority_and_refuses_past_its_queue() {
        let lane = BackgroundLane::start().expect("lane");
        #[cfg(target_os = "linux")]
        {
            let nice = lane
                .run(|| rustix::process::getpriority_process(None))
                .expect("queued")
                .await
                .expect("ran");
            // `getpriority_process(None)` on the lane thread reads that thread's own nice value.
            assert_eq!(nice.expect("getpriority"), NICE);
        }
        // Hold the lane with one job, fill its queue, and the next is refused.
        let (release, blocked) = std::sync::mpsc::channel::<()>();
        let (running, started) = std::sync::mpsc::channel::<()>();
        let first = lane
            .run(move || {
                let _ = running.send(());
                let _ = blocked.recv();
            })
            .expect("first");
        started
            .recv_timeout(std::time::Duration::from_secs(10))
            .expect("the first job started");
        let queued: Vec<_> = (0..QUEUED_JOBS)
            .map(|i| lane.run(move || i).expect("queued"))
            .collect();
        assert!(lane.run(|| ()).is_none(), "a full lane refuses");
        release.send(()).expect("release");
        first.await.expect("first ran");
        for (i, result) in queued.into_iter().enumerate() {
            assert_eq!(result.await.expect("ran"), i);
        }
        let panicked = lane.run(|| panic!("boom")).expect("queued");
        assert!(panicked.await.is_err(), "a panic closes its result");
        assert_eq!(lane.run(|| 7).expect("queued").await.expect("ran"), 7);
    }
}
