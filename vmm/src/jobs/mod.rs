//! What the `tinyvmm` binary runs, each on the job thread of [`crate::lifecycle::run_job`] or,
//! for a VM that runs until it is stopped (`serve`, `restore`, `receive`, `boot`), under the
//! event loop and API socket of [`run_loop`].

pub mod boot;
pub mod check;
pub mod harvest;
pub mod perf;
pub mod receive;
pub mod restore;
pub mod run_loop;
pub mod serve;
pub mod snapshot_bench;
pub mod stress;
