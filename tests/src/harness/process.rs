//! [`ChildGuard`]: a child process that is always stopped, with its log shown on test failure.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::HarnessError;

/// Time between SIGTERM and SIGKILL.
fn terminate_grace() -> Duration {
    kvroute_test_support::deadline(Duration::from_secs(5))
}

/// Owns a child process whose stdout and stderr go to a log file.
#[derive(Debug)]
pub struct ChildGuard {
    name: String,
    child: Child,
    log: PathBuf,
}

impl ChildGuard {
    /// Spawns `command` with output to `log` (stdin closed).
    pub fn spawn(name: &str, mut command: Command, log: PathBuf) -> Result<Self, HarnessError> {
        let io_error = |source| HarnessError::Io {
            path: log.clone(),
            source,
        };
        let out = std::fs::File::create(&log).map_err(io_error)?;
        let err = out.try_clone().map_err(io_error)?;
        let child = command
            .stdin(Stdio::null())
            .stdout(Stdio::from(out))
            .stderr(Stdio::from(err))
            .spawn()
            .map_err(|source| HarnessError::Spawn {
                program: name.to_owned(),
                source,
            })?;
        Ok(Self {
            name: name.to_owned(),
            child,
            log,
        })
    }

    /// Process id.
    pub fn id(&self) -> u32 {
        self.child.id()
    }

    /// The log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// `Some(status)` if the process has exited.
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    /// SIGKILL (an abrupt failure: no shutdown code runs), then reaps it, so that its ports are
    /// free for a restart once this returns.
    pub fn kill(&mut self) {
        if self.exited().is_some() {
            return;
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// SIGTERM, then SIGKILL after a grace period; returns whether it exited on SIGTERM.
    pub fn stop(&mut self) -> bool {
        if self.exited().is_some() {
            return true;
        }
        // No libc (unsafe is forbidden): the `kill` utility sends the signal.
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
        let deadline = Instant::now() + terminate_grace();
        while Instant::now() < deadline {
            if self.exited().is_some() {
                return true;
            }
            // Blocking wait in Drop: a short park between polls (std::thread::sleep is banned).
            std::thread::park_timeout(Duration::from_millis(10));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        false
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        self.stop();
        if std::thread::panicking() {
            eprintln!(
                "----- log of {} (pid {}) -----\n{}",
                self.name,
                self.child.id(),
                self.log()
            );
            eprintln!("----- end of {} log -----", self.name);
        }
    }
}
