//! tinyvmm's measurement harnesses, a crate and binary (`tinyvmm-bench`) of their own on the
//! `tinyvmm` library, so that neither the product binary nor its library carries them: the
//! memslot performance suite ([`perf`], `tinyvmm-bench bench`), the stress mode ([`stress`]),
//! the harvest bench ([`harvest`]) and the snapshot bench ([`snapshot`]). Each runs on the job
//! thread of [`tinyvmm::lifecycle::run_job`] on a test-guest VM, checks what it measures (a
//! wrong result is an error, not a figure), and reports a table and JSON. Each one's
//! command-line arguments are beside it (`PerfArgs`, ...); what they share with `tinyvmm`'s
//! subcommands is `tinyvmm::jobs::args` and `tinyvmm::jobs::process`. Nothing here serves an
//! API.

pub mod harvest;
pub mod perf;
pub mod snapshot;
pub mod stress;
