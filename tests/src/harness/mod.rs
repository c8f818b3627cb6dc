//! Process harnesses (in progress).
