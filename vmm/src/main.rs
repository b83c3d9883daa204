//! tinyvmm's command line.

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use tinyvmm::check::{run_check, CheckConfig};
use tinyvmm::lifecycle::{run_job, Ending};

#[derive(Parser)]
#[command(
    name = "tinyvmm",
    version,
    about = "A tiny VMM that runs a test guest across tens of thousands of KVM memory slots"
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Commands>,
}

#[derive(Subcommand)]
enum Commands {
    /// Run the test guest over many slots and check every slot both ways (the default).
    Check(CheckArgs),
}

#[derive(clap::Args)]
struct CheckArgs {
    /// KVM slots in all (one holds the guest's code and tables).
    #[arg(long, default_value_t = 4096)]
    slots: usize,
    /// MiB of test area split over the other slots.
    #[arg(long, default_value_t = 512)]
    area_mib: u64,
    /// vCPUs sharing the work (1 to 15).
    #[arg(long, default_value_t = 1)]
    vcpus: usize,
    /// Also print the report as JSON.
    #[arg(long)]
    json: bool,
}

impl Default for CheckArgs {
    fn default() -> Self {
        CheckArgs {
            slots: 4096,
            area_mib: 512,
            vcpus: 1,
            json: false,
        }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command.unwrap_or(Commands::Check(CheckArgs::default())) {
        Commands::Check(args) => check(args),
    }
}

fn check(args: CheckArgs) -> ExitCode {
    let config = CheckConfig {
        slots: args.slots,
        area_size: args.area_mib << 20,
        vcpus: args.vcpus,
    };
    let outcome = run_job(move |ctx| run_check(config, &ctx.stop, &ctx.vcpu_stopped));
    match outcome {
        Ok((Ok(report), _)) => {
            println!("{report}");
            if args.json {
                println!(
                    "{}",
                    serde_json::to_string_pretty(&report).expect("the report is JSON")
                );
            }
            println!("all checks passed");
            ExitCode::SUCCESS
        }
        Ok((Err(e), Ending::Interrupted)) => {
            eprintln!("tinyvmm: interrupted: {e}");
            ExitCode::from(130)
        }
        Ok((Err(e), Ending::Finished)) => {
            eprintln!("tinyvmm: {e}");
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("tinyvmm: {e}");
            ExitCode::FAILURE
        }
    }
}
