//! Low-priority threads for whole tokenizations no decision waits for.
//!
//! A long prompt decided from its leading tokens, or a conversation-prefix hit routed on its
//! cached prefix, is tokenized whole afterwards so that the conversation's next turn finds it
//! cached. That is milliseconds of CPU per request (a 32k-token Qwen3 chat ≈ 1.6 ms); at the
//! decisions' priority it would compete with them and with the proxy beside it. Two threads
//! share one bounded queue:
//!
//! - the **idle** thread (`SCHED_IDLE`) takes every job: it runs only on CPU time nothing else
//!   wants, and a waking decision preempts it at once. At nice 10 the kernel let a running job
//!   finish its slice first: 32k decisions beside it measured p99 3.5–4.7× the no-op ext_proc's,
//!   idle 1.1–1.8× (BENCHMARKS.md, issue 15).
//! - the **behind** thread (nice [`NICE`]) joins in once [`BEHIND_AT`] jobs wait, and drains the
//!   queue: on a saturated host an idle thread alone would starve, and next turns would find
//!   their previous turn untokenized (measured at nice 19: 91 of 120 next turns, 5.1× the
//!   no-op). Two threads, because an unprivileged thread cannot leave `SCHED_IDLE` again.

use std::collections::VecDeque;
use std::sync::Arc;
use std::thread::JoinHandle;

use parking_lot::{Condvar, Mutex};

/// A unit of background work.
type Job = Box<dyn FnOnce() + Send>;

/// Jobs waiting; beyond them [`BackgroundLane::run`] refuses. Each holds its prompt (at most
/// `limits.tokenize_max_prompt_bytes`); a burst of long first turns (each ≈ 1.6 ms of work at
/// 32k tokens) arriving faster than the lane runs them fits.
const QUEUED_JOBS: usize = 16;
/// Jobs waiting from which the behind thread joins in: only near a full queue, since it takes
/// its share from the decisions beside it (with it joining at 4, 32k decisions measured p99
/// ≤ 10 ms in ext-proc's own timings, without ≤ 2.6 ms).
const BEHIND_AT: usize = QUEUED_JOBS * 3 / 4;
/// The behind thread's nice value: ≈ a tenth of a normal thread's share of a contended core
/// (the kernel's weights fall ≈ 1.25× per step), so decisions come first, yet a saturated host
/// still runs it.
const NICE: i32 = 10;

/// A lane thread's scheduling class.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Class {
    /// `SCHED_IDLE`: only otherwise idle CPU time.
    Idle,
    /// `SCHED_OTHER` at nice [`NICE`].
    Behind,
}

/// The queue both threads take from.
#[derive(Default)]
struct Queue {
    state: Mutex<QueueState>,
    /// Signalled on every job queued (the idle thread) and on closing.
    ready: Condvar,
    /// Signalled when [`BEHIND_AT`] jobs wait (the behind thread) and on closing.
    backlog: Condvar,
}

#[derive(Default)]
struct QueueState {
    jobs: VecDeque<Job>,
    closed: bool,
}

/// The two threads and their bounded queue; dropping it lets the threads finish the queued
/// jobs, then ends (and joins) them.
pub(crate) struct BackgroundLane {
    queue: Arc<Queue>,
    threads: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for BackgroundLane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BackgroundLane")
            .field("waiting", &self.queue.state.lock().jobs.len())
            .finish_non_exhaustive()
    }
}

impl BackgroundLane {
    /// Starts the threads.
    pub(crate) fn start() -> std::io::Result<Self> {
        let queue = Arc::new(Queue::default());
        let mut lane = Self {
            queue: Arc::clone(&queue),
            threads: Vec::with_capacity(2),
        };
        for (class, name) in [
            (Class::Idle, "kvroute-tokenize-later"),
            (Class::Behind, "kvroute-tokenize-behind"),
        ] {
            let queue = Arc::clone(&queue);
            // On an error `lane` drops: it closes the queue and joins the thread started.
            let thread = std::thread::Builder::new()
                .name(name.to_owned())
                .spawn(move || work(&queue, class))?;
            lane.threads.push(thread);
        }
        Ok(lane)
    }

    /// Queues `job`; `false` when the queue is full (background work is skipped, never waited
    /// for).
    pub(crate) fn run(&self, job: impl FnOnce() + Send + 'static) -> bool {
        let mut state = self.queue.state.lock();
        if state.closed || state.jobs.len() >= QUEUED_JOBS {
            return false;
        }
        state.jobs.push_back(Box::new(job));
        let waiting = state.jobs.len();
        drop(state);
        self.queue.ready.notify_one();
        if waiting >= BEHIND_AT {
            self.queue.backlog.notify_one();
        }
        true
    }
}

impl Drop for BackgroundLane {
    fn drop(&mut self) {
        self.queue.state.lock().closed = true;
        self.queue.ready.notify_all();
        self.queue.backlog.notify_all();
        for thread in self.threads.drain(..) {
            if thread.join().is_err() {
                tracing::error!("a background tokenization thread panicked");
            }
        }
    }
}

/// A lane thread: enters `class`, then runs jobs until the queue is closed and empty. The idle
/// thread takes any job; the behind thread waits for a backlog, then drains the queue.
fn work(queue: &Queue, class: Class) {
    enter(class);
    let mut draining = false;
    loop {
        let job = {
            let mut state = queue.state.lock();
            loop {
                let waiting = state.jobs.len();
                let take = match class {
                    Class::Idle => waiting > 0,
                    Class::Behind => waiting >= BEHIND_AT || (draining && waiting > 0),
                };
                if take {
                    break state.jobs.pop_front();
                }
                if state.closed {
                    return;
                }
                draining = false;
                match class {
                    Class::Idle => queue.ready.wait(&mut state),
                    Class::Behind => queue.backlog.wait(&mut state),
                }
            }
        };
        draining = true;
        if let Some(job) = job {
            // A panicking job (a tokenizer bug) must not end the lane for the others.
            if std::panic::catch_unwind(std::panic::AssertUnwindSafe(job)).is_err() {
                tracing::error!("a background tokenization panicked");
            }
        }
    }
}

/// Moves the calling thread into `class`. A failure leaves it where it was (normal priority),
/// logged.
fn enter(class: Class) {
    #[cfg(target_os = "linux")]
    {
        use thread_priority::{
            NormalThreadSchedulePolicy, ThreadPriority, ThreadSchedulePolicy,
            set_thread_priority_and_policy, thread_native_id,
        };
        let moved = match class {
            Class::Idle => set_thread_priority_and_policy(
                thread_native_id(),
                ThreadPriority::Min,
                ThreadSchedulePolicy::Normal(NormalThreadSchedulePolicy::Idle),
            )
            .map_err(|error| error.to_string()),
            // `setpriority` on a thread id is per thread on Linux.
            Class::Behind => {
                rustix::process::setpriority_process(Some(rustix::thread::gettid()), NICE)
                    .map_err(|error| error.to_string())
            }
        };
        if let Err(error) = moved {
            tracing::warn!(%error, ?class, "a background tokenization thread runs at normal priority");
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = class;
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

    /// The running thread's scheduling class, as the kernel reports it.
    #[cfg(target_os = "linux")]
    fn own_class() -> Option<Class> {
        use thread_priority::{NormalThreadSchedulePolicy, ThreadSchedulePolicy};
        match thread_priority::thread_schedule_policy().ok()? {
            ThreadSchedulePolicy::Normal(NormalThreadSchedulePolicy::Idle) => Some(Class::Idle),
            ThreadSchedulePolicy::Normal(NormalThreadSchedulePolicy::Other)
                if rustix::process::getpriority_process(None).ok()? == NICE =>
            {
                Some(Class::Behind)
            }
            _ => None,
        }
    }

    /// A job that says it started, then waits to be released.
    fn holding() -> (
        impl FnOnce() + Send + 'static,
        Receiver<()>,
        std::sync::mpsc::Sender<()>,
    ) {
        let (release, blocked) = channel::<()>();
        let (running, started) = channel::<()>();
        let job = move || {
            let _ = running.send(());
            let _ = blocked.recv();
        };
        (job, started, release)
    }

    #[test]
    fn runs_work_when_idle_joins_in_when_behind_and_refuses_past_its_queue() {
        let lane = BackgroundLane::start().expect("lane");
        let (done, results) = channel();
        let report = |i: usize| {
            let done = done.clone();
            move || {
                #[cfg(target_os = "linux")]
                let class = own_class();
                #[cfg(not(target_os = "linux"))]
                let class = None;
                let _ = done.send((i, class));
            }
        };
        // A job alone goes to the idle thread.
        assert!(lane.run(report(0)));
        #[cfg(target_os = "linux")]
        assert_eq!(within_deadline(&results), (0, Some(Class::Idle)));
        #[cfg(not(target_os = "linux"))]
        within_deadline(&results);
        // With the idle thread held, a backlog goes to the behind thread, in order.
        let (hold_idle, idle_started, release_idle) = holding();
        assert!(lane.run(hold_idle));
        within_deadline(&idle_started);
        for i in 1..=BEHIND_AT {
            assert!(lane.run(report(i)));
        }
        for i in 1..=BEHIND_AT {
            let (ran, class) = within_deadline(&results);
            assert_eq!(ran, i);
            #[cfg(target_os = "linux")]
            assert_eq!(class, Some(Class::Behind));
            let _ = class;
        }
        // With both held, the queue takes QUEUED_JOBS jobs and refuses the next.
        let (hold_behind, behind_started, release_behind) = holding();
        assert!(lane.run(hold_behind));
        for _ in 1..BEHIND_AT {
            assert!(lane.run(|| ()));
        }
        within_deadline(&behind_started);
        let mut accepted = BEHIND_AT - 1;
        while accepted < QUEUED_JOBS {
            assert!(lane.run(|| ()), "room for {QUEUED_JOBS} waiting jobs");
            accepted += 1;
        }
        assert!(!lane.run(|| ()), "a full lane refuses");
        release_idle.send(()).expect("release");
        release_behind.send(()).expect("release");
        // A panicking job does not end the lane; the jobs after it run.
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while !lane.run(|| panic!("a tokenizer bug")) {
            assert!(
                std::time::Instant::now() < deadline,
                "the queue never drained"
            );
            std::thread::yield_now();
        }
        assert!(lane.run(report(99)));
        assert_eq!(within_deadline(&results).0, 99);
        // Dropping the lane runs what is queued, then ends both threads.
        for i in 100..110 {
            assert!(lane.run(report(i)));
        }
        drop(lane);
        let ran: Vec<usize> = results.try_iter().map(|(i, _)| i).collect();
        assert_eq!(
            ran.len(),
            10,
            "queued jobs ran before the threads ended: {ran:?}"
        );
    }
}
