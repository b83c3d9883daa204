//! Benchmarks of the slot map against vm-memory (placeholder).
fn main() {}
