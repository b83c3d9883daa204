//! What the `tinyvmm` binary runs, each on the job thread of [`crate::lifecycle::run_job`] or,
//! for `serve`, on the event loop itself.

pub mod check;
pub mod harvest;
pub mod perf;
pub mod receive;
pub mod serve;
pub mod snapshot_bench;
pub mod stress;
