//! kvroute integration tests: one binary (`integration`), one module per topic under `suite/`.

// Helpers outside `#[test]` fns fail the test by panicking, exactly like the tests themselves.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "test code: a panic is a failure"
)]

mod suite;
