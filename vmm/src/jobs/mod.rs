//! The product's subcommands: `check` (on the job thread of [`crate::lifecycle::run_job`]),
//! the VMs that run until they are stopped (`serve`, `restore`, `receive`, `boot`), under the
//! event loop and API socket of [`run_loop`], `snapshot-merge` ([`merge`]) and `client`
//! ([`client`], one request to a VMM's API socket). The
//! measurement harnesses are in `bench`.

pub mod boot;
pub mod check;
pub mod client;
pub mod merge;
pub mod receive;
pub mod restore;
pub mod run_loop;
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
