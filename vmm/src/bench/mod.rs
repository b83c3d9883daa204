//! The measurement harnesses: the memslot performance suite ([`perf`], `tinyvmm bench`), the
//! stress mode ([`stress`]), the harvest bench ([`harvest`]) and the snapshot bench
//! ([`snapshot`]). Each runs on the job thread of [`crate::lifecycle::run_job`] on a test-guest
//! VM, checks what it measures (a wrong result is an error, not a figure), and reports a table
//! and JSON. The product's subcommands are in `jobs`; nothing here serves an API.

pub mod harvest;
pub mod perf;
pub mod snapshot;
pub mod stress;
