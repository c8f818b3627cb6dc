//! `kvroute-index`: serves the block index (skeleton).

fn main() {}
