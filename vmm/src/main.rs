//! tinyvmm's command line: the subcommands and what runs each, a job's arguments being beside
//! its job (`tinyvmm::jobs`). The measurement harnesses are `tinyvmm-bench` (`vmm/bench/`).

use std::process::ExitCode;

use clap::{CommandFactory, Parser, Subcommand};
use tinyvmm::jobs::args::{start_command_line, LogArgs, UsageError};
use tinyvmm::jobs::{boot, check, client, merge, receive, restore, serve};
use tinyvmm::lifecycle::{log, LogLevel};

#[derive(Parser)]
#[command(
    name = "tinyvmm",
    version = tinyvmm::VERSION_AND_COMMIT,
    about = "A tiny VMM that runs a test guest across tens of thousands of KVM memory slots",
    after_help = "Exit status: 0 done, 1 a failure (named on stderr), 64 a usage error, 130 a \
                  signal; serve, restore and receive also 4 (stopped after the guest failed); \
                  boot also 2 (the guest stopped on an error), 3 (KVM_EXIT_INTERNAL_ERROR) and \
                  124 (--timeout). `--json` prints JSON alone on stdout (durations in ms, \
                  \"passed\": true or false) and the human report on stderr."
)]
struct Cli {
    /// `--log-level`.
    #[command(flatten)]
    log: LogArgs,
    #[command(subcommand)]
    command: Option<Commands>,
}

#[derive(Subcommand)]
enum Commands {
    /// Run the test guest over many slots and check every slot both ways (the default).
    Check(check::CheckArgs),
    /// Run the test guest with an API socket (HTTP/1.1 + JSON) to add, remove and move memory,
    /// plug the hotplug area and switch dirty logging while it runs; see docs/api.yaml.
    Serve(serve::ServeArgs),
    /// Restore a VM from a snapshot (PUT /snapshot/create) and serve it, paused, on an API
    /// socket: PATCH /vm {"state": "Resumed"} continues it where it was. A test guest is served
    /// as `serve` serves one; a Linux guest runs as `boot` runs one (its console on stdout);
    /// the state file says which.
    Restore(restore::RestoreArgs),
    /// Merge a chain of snapshots (a Full, then its Diffs in order, even across hotplug,
    /// removals and moves) into the memory file of the last one's point, to restore with its
    /// state file; a broken chain (a Diff first, a link repeated, missing or out of order,
    /// another VM's snapshot) is refused naming the file.
    SnapshotMerge(merge::MergeArgs),
    /// Receive a VM that `PUT /migrate` on another tinyvmm sends, run it, and serve it on an
    /// API socket: a test guest as `serve` does, a Linux guest as `boot` does (its console on
    /// stdout).
    Receive(receive::ReceiveArgs),
    /// Boot a Linux kernel (bzImage or ELF vmlinux) with its RAM split into KVM slots; the
    /// serial console is stdout (and stdin on a terminal). See docs/BOOT.md.
    Boot(boot::BootArgs),
    /// Send one request to a running VMM's API socket (every endpoint of docs/api.yaml): the
    /// answer as a table, or with --json its JSON body alone; a migration and a live snapshot
    /// are followed to their end (--no-wait: not). Exit status 0 for 2xx, 4 for 4xx, 5 for
    /// 5xx, 1 when the socket cannot be reached, a followed run does not complete, or a guest
    /// verify finds a mismatch.
    Client(client::ClientArgs),
    /// Print a completion script for a shell, e.g. `tinyvmm completions bash >
    /// /etc/bash_completion.d/tinyvmm`.
    Completions {
        /// The shell.
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
    /// Write man pages generated from this command line: tinyvmm.1 and one per subcommand
    /// (tinyvmm-serve.1, ...); `man -l DIR/tinyvmm.1` reads one.
    Man {
        /// The folder to write them into (created if missing); no default, so that they never
        /// land in whatever folder the command runs from.
        #[arg(long)]
        dir: std::path::PathBuf,
    },
}

fn main() -> ExitCode {
    let cli = match start_command_line(|cli: &Cli| &cli.log) {
        Ok(cli) => cli,
        Err(code) => return code,
    };
    let command = cli
        .command
        .unwrap_or_else(|| Commands::Check(Default::default()));
    let outcome = match command {
        Commands::Check(args) => Ok(args.run()),
        Commands::Serve(args) => args.run(),
        Commands::Restore(args) => Ok(serve::restore(args)),
        Commands::SnapshotMerge(args) => Ok(args.run()),
        Commands::Receive(args) => Ok(args.run()),
        Commands::Boot(args) => Ok(args.run()),
        Commands::Client(args) => args.run(),
        Commands::Completions { shell } => {
            clap_complete::generate(
                shell,
                &mut Cli::command(),
                "tinyvmm",
                &mut std::io::stdout(),
            );
            Ok(ExitCode::SUCCESS)
        }
        Commands::Man { dir } => Ok(man(&dir)),
    };
    outcome.unwrap_or_else(|e: UsageError| e.report(Cli::command()))
}

/// Writes the man pages into `dir`.
fn man(dir: &std::path::Path) -> ExitCode {
    let written =
        std::fs::create_dir_all(dir).and_then(|()| clap_mangen::generate_to(Cli::command(), dir));
    match written {
        Ok(()) => {
            log(
                LogLevel::Info,
                format_args!("man pages written to {}", dir.display()),
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("tinyvmm: cannot write man pages to {}: {e}", dir.display());
            ExitCode::FAILURE
        }
    }
}
