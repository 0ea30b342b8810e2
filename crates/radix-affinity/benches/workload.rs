//! Criterion benchmark of the normative workload (filled in with the generator).
fn main() {}
