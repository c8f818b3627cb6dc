//! Following a config file: the one watcher ext-proc, the index and the agent reload through.
//!
//! The file's modification time is polled (through symlinks, so a Kubernetes ConfigMap's swap of
//! its data link counts). What a changed file means — parse, validate, apply, or keep the running
//! config, log and count the refusal — is the caller's; this module only says *when* to look again.
//!
//! ```no_run
//! use std::time::Duration;
//!
//! use kvroute_runtime::config_file::ConfigFileWatch;
//!
//! async fn follow(path: std::path::PathBuf) {
//!     let mut watch = ConfigFileWatch::new(path, Duration::from_secs(1));
//!     loop {
//!         watch.changed().await;
//!         match std::fs::read_to_string(watch.path()) {
//!             Ok(_text) => { /* parse, validate, apply — or refuse, keeping the running config */ }
//!             Err(_error) => { /* keep the running config; log and count the refusal */ }
//!         }
//!     }
//! }
//! ```

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use tokio::time::{Instant, Interval, MissedTickBehavior};

/// A config file followed by polling its modification time every `interval`.
///
/// The file as it is when the watch is made is the baseline; a file that disappears, appears
/// or is replaced counts as a change.
#[derive(Debug)]
pub struct ConfigFileWatch {
    path: PathBuf,
    last_seen: Option<SystemTime>,
    interval: Duration,
    /// Made on the first [`ConfigFileWatch::changed`], so a watch can be built outside a runtime.
    ticker: Option<Interval>,
}

impl ConfigFileWatch {
    /// Watches `path`, checking it every `interval` (the first check one interval after the
    /// first [`ConfigFileWatch::changed`] call).
    pub fn new(path: PathBuf, interval: Duration) -> Self {
        let last_seen = modified(&path);
        Self {
            path,
            last_seen,
            interval,
            ticker: None,
        }
    }

    /// The watched file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Polls every `interval` from now on, when it differs from the current period (a reloaded
    /// config may carry a new one); the same period leaves the schedule alone.
    pub fn set_interval(&mut self, interval: Duration) {
        if interval != self.interval {
            self.interval = interval;
            self.ticker = None;
        }
    }

    /// Resolves at the first check that finds the modification time changed since the last
    /// change reported (or since the watch was made).
    ///
    /// Cancel-safe: dropped before it resolves (a `select!` branch that lost), it loses no change;
    /// the schedule is a ticker, so frequent cancellations do not postpone the next check.
    pub async fn changed(&mut self) {
        loop {
            let interval = self.interval;
            self.ticker
                .get_or_insert_with(|| ticker(interval))
                .tick()
                .await;
            let now_seen = modified(&self.path);
            if now_seen != self.last_seen {
                self.last_seen = now_seen;
                return;
            }
        }
    }
}

/// The file's modification time; `None` when it cannot be read (missing, no permission).
fn modified(path: &Path) -> Option<SystemTime> {
    std::fs::metadata(path).and_then(|m| m.modified()).ok()
}

/// Ticks every `period`, the first one period from now; a late tick delays the next rather than
/// bursting to catch up.
fn ticker(period: Duration) -> Interval {
    let mut ticker = tokio::time::interval_at(Instant::now() + period, period);
    ticker.set_missed_tick_behavior(MissedTickBehavior::Delay);
    ticker
}

#[cfg(test)]
mod tests {
    use std::fs::File;

    use super::*;

    const INTERVAL: Duration = Duration::from_millis(100);
    /// Virtual time (`start_paused`): a deadline passes as soon as nothing else can run.
    const DEADLINE: Duration = Duration::from_secs(60);

    fn config_file(dir: &tempfile::TempDir) -> PathBuf {
        let path = dir.path().join("config.yaml");
        std::fs::write(&path, "a: 1\n").unwrap();
        set_modified(&path, SystemTime::UNIX_EPOCH + Duration::from_secs(1_000));
        path
    }

    /// An explicit modification time: two writes within the filesystem's timestamp granularity
    /// would otherwise look like one.
    fn set_modified(path: &Path, at: SystemTime) {
        File::options()
            .write(true)
            .open(path)
            .unwrap()
            .set_modified(at)
            .unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn an_untouched_file_is_never_reported() {
        let dir = tempfile::tempdir().unwrap();
        let mut watch = ConfigFileWatch::new(config_file(&dir), INTERVAL);
        let waited = tokio::time::timeout(100 * INTERVAL, watch.changed()).await;
        assert!(waited.is_err(), "reported a change nobody made");
    }

    #[tokio::test(start_paused = true)]
    async fn a_rewritten_file_is_reported_once_per_change() {
        let dir = tempfile::tempdir().unwrap();
        let path = config_file(&dir);
        let mut watch = ConfigFileWatch::new(path.clone(), INTERVAL);

        std::fs::write(&path, "a: 2\n").unwrap();
        set_modified(&path, SystemTime::UNIX_EPOCH + Duration::from_secs(2_000));
        let started = Instant::now();
        tokio::time::timeout(DEADLINE, watch.changed())
            .await
            .expect("the rewrite was not reported");
        assert_eq!(started.elapsed(), INTERVAL, "seen at the first check");
        assert_eq!(std::fs::read_to_string(watch.path()).unwrap(), "a: 2\n");

        let again = tokio::time::timeout(10 * INTERVAL, watch.changed()).await;
        assert!(again.is_err(), "one change reported twice");

        // Even an older timestamp (a file restored from a backup) is a change.
        set_modified(&path, SystemTime::UNIX_EPOCH + Duration::from_secs(500));
        tokio::time::timeout(DEADLINE, watch.changed())
            .await
            .expect("the restored file was not reported");
    }

    #[tokio::test(start_paused = true)]
    async fn a_removed_file_is_a_change_and_so_is_its_return() {
        let dir = tempfile::tempdir().unwrap();
        let path = config_file(&dir);
        let mut watch = ConfigFileWatch::new(path.clone(), INTERVAL);

        std::fs::remove_file(&path).unwrap();
        tokio::time::timeout(DEADLINE, watch.changed())
            .await
            .expect("the removal was not reported");
        config_file(&dir);
        tokio::time::timeout(DEADLINE, watch.changed())
            .await
            .expect("the file's return was not reported");
    }

    #[tokio::test(start_paused = true)]
    async fn a_new_interval_sets_when_the_next_check_comes() {
        let dir = tempfile::tempdir().unwrap();
        let path = config_file(&dir);
        let mut watch = ConfigFileWatch::new(path.clone(), INTERVAL);
        // Starts the schedule at the old period.
        let _ = tokio::time::timeout(INTERVAL / 2, watch.changed()).await;

        watch.set_interval(10 * INTERVAL);
        set_modified(&path, SystemTime::UNIX_EPOCH + Duration::from_secs(2_000));
        let started = Instant::now();
        tokio::time::timeout(DEADLINE, watch.changed())
            .await
            .expect("the change was not reported");
        assert_eq!(started.elapsed(), 10 * INTERVAL);
    }
}
