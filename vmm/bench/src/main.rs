//! `tinyvmm-bench`'s command line: the measurement harnesses, each subcommand's arguments
//! beside its harness in this crate's library.

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use tinyvmm::jobs::args::{start_command_line, LogArgs};
use tinyvmm_bench::{harvest, perf, snapshot, stress};

#[derive(Parser)]
#[command(
    name = "tinyvmm-bench",
    version = tinyvmm::VERSION_AND_COMMIT,
    about = "tinyvmm's measurement harnesses: the memslot perf suite, stress, and the harvest \
             and snapshot benches, on the test guest",
    after_help = "Exit status: 0 done, 1 a failure (named on stderr), 64 a usage error, 130 a \
                  signal. `--json` prints JSON alone on stdout (durations in ms, \"passed\": \
                  true or false) and the human report on stderr."
)]
struct Cli {
    /// `--log-level`.
    #[command(flatten)]
    log: LogArgs,
    #[command(subcommand)]
    command: Commands,
}

#[derive(Subcommand)]
enum Commands {
    /// Run the memslot performance suite (after the kernel's memslot_perf_test): print a table
    /// and write JSON.
    Bench(perf::PerfArgs),
    /// Stress the manager (after the kernel's memslot_modification_stress_test): vCPUs write
    /// continuously while the host adds, removes, moves and re-flags slots next to their memory.
    Stress(stress::StressArgs),
    /// Measure a dirty-page harvest in bitmap and ring mode side by side, with 0 % to 100 % of
    /// the pages dirtied: print a table and write JSON.
    HarvestBench(harvest::HarvestArgs),
    /// Measure Full and Diff snapshots and each restore backend at several slot counts, next to
    /// the file system's bandwidth and a cold start: print a table and write JSON.
    SnapshotBench(snapshot::SnapshotBenchArgs),
}

fn main() -> ExitCode {
    let cli = match start_command_line(|cli: &Cli| &cli.log) {
        Ok(cli) => cli,
        Err(code) => return code,
    };
    match cli.command {
        Commands::Bench(args) => args.run(),
        Commands::Stress(args) => args.run(),
        Commands::HarvestBench(args) => args.run(),
        Commands::SnapshotBench(args) => args.run(),
    }
}
