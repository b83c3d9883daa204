//! The product's subcommands: `check` (on the job thread of [`crate::lifecycle::run_job`]),
//! the VMs that run until they are stopped (`serve`, `restore`, `receive`, `boot`), under the
//! event loop and API socket of `run_loop`, `snapshot-merge` ([`merge`]) and `client`
//! ([`client`], one request to a VMM's API socket). Each job's command-line arguments are
//! beside it (`CheckArgs` in [`check`], ...), with what several share in [`args`]; the
//! process around a job (its open-file limit, what it prints, its exit status) is in
//! [`process`]. The measurement harnesses are a binary of their own, `tinyvmm-bench`
//! (`vmm/bench/`), on this library.

pub mod args;
pub mod boot;
pub mod check;
pub mod client;
pub mod merge;
pub mod process;
pub mod receive;
pub mod restore;
mod run_loop;
pub mod serve;
pub mod working_set;

/// Serializes a duration as milliseconds (a JSON number with fractions), as every report's
/// JSON gives durations: `#[serde(rename = "..._ms", serialize_with = "millis")]`.
pub fn millis<S: serde::Serializer>(
    duration: &std::time::Duration,
    serializer: S,
) -> Result<S::Ok, S::Error> {
    serializer.serialize_f64(duration.as_secs_f64() * 1e3)
}
