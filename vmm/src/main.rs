//! tinyvmm's command line.

use std::process::ExitCode;

use clap::{CommandFactory, Parser, Subcommand};
use kvm_memslots::MemoryLimits;
use tinyvmm::jobs::check::{run_check_with_progress, CheckConfig};
use tinyvmm::lifecycle::{log, run_job, Ending, LogLevel};

/// The exit status of a usage error (an unknown option, a value out of its range), distinct
/// from every outcome of a run (sysexits' `EX_USAGE`).
const USAGE_EXIT_STATUS: u8 = 64;

/// Most vCPUs of the test guest.
const TEST_GUEST_VCPUS: usize = tinyvmm::test_guest::layout::MAX_VCPUS;

#[derive(Parser)]
#[command(
    name = "tinyvmm",
    version = concat!(env!("CARGO_PKG_VERSION"), " (commit ", env!("TINYVMM_COMMIT"), ")"),
    about = "A tiny VMM that runs a test guest across tens of thousands of KVM memory slots",
    after_help = "Exit status: 0 done, 1 a failure (named on stderr), 64 a usage error, 130 a \
                  signal; serve, restore and receive also 4 (stopped after the guest failed); \
                  boot also 2 (the guest stopped on an error), 3 (KVM_EXIT_INTERNAL_ERROR) and \
                  124 (--timeout). `--json` prints JSON alone on stdout (durations in ms, \
                  \"passed\": true or false) and the human report on stderr."
)]
struct Cli {
    /// How much the VMM says on stderr, on every subcommand: error (only failures), warn (and
    /// problems it went on from), info (and each state change: serving, waiting, receiving,
    /// migrated, stopped, files written) or debug (and every API request, as --log-requests).
    #[arg(long, global = true, value_enum, default_value_t)]
    log_level: LogLevel,
    #[command(subcommand)]
    command: Option<Commands>,
}

#[derive(Subcommand)]
enum Commands {
    /// Run the test guest over many slots and check every slot both ways (the default).
    Check(CheckArgs),
    /// Run the memslot performance suite (after the kernel's memslot_perf_test): print a table
    /// and write JSON.
    Bench(BenchArgs),
    /// Stress the manager (after the kernel's memslot_modification_stress_test): vCPUs write
    /// continuously while the host adds, removes, moves and re-flags slots next to their memory.
    Stress(StressArgs),
    /// Measure a dirty-page harvest in bitmap and ring mode side by side, with 0 % to 100 % of
    /// the pages dirtied: print a table and write JSON.
    HarvestBench(HarvestArgs),
    /// Run the test guest with an API socket (HTTP/1.1 + JSON) to add, remove and move memory,
    /// plug the hotplug area and switch dirty logging while it runs; see docs/api.yaml.
    Serve(ServeArgs),
    /// Restore a VM from a snapshot (PUT /snapshot/create) and serve it, paused, on an API
    /// socket: PATCH /vm {"state": "Resumed"} continues it where it was. A test guest is served
    /// as `serve` serves one; a Linux guest runs as `boot` runs one (its console on stdout);
    /// the state file says which.
    Restore(RestoreArgs),
    /// Merge a chain of snapshots (a Full, then its Diffs in order, even across hotplug,
    /// removals and moves) into the memory file of the last one's point, to restore with its
    /// state file; a broken chain (a Diff first, a link repeated, missing or out of order,
    /// another VM's snapshot) is refused naming the file.
    SnapshotMerge(MergeArgs),
    /// Measure Full and Diff snapshots and each restore backend at several slot counts, next to
    /// the file system's bandwidth and a cold start: print a table and write JSON.
    SnapshotBench(SnapshotBenchArgs),
    /// Receive a VM that `PUT /migrate` on another tinyvmm sends, run it, and serve it on an
    /// API socket: a test guest as `serve` does, a Linux guest as `boot` does (its console on
    /// stdout).
    Receive(ReceiveArgs),
    /// Boot a Linux kernel (bzImage or ELF vmlinux) with its RAM split into KVM slots; the
    /// serial console is stdout (and stdin on a terminal). See docs/BOOT.md.
    Boot(BootArgs),
    /// Send one request to a running VMM's API socket (every endpoint of docs/api.yaml): the
    /// answer as a table, or with --json its JSON body alone; a migration and a live snapshot
    /// are followed to their end (--no-wait: not). Exit status 0 for 2xx, 4 for 4xx, 5 for
    /// 5xx, 1 when the socket cannot be reached, a followed run does not complete, or a guest
    /// verify finds a mismatch.
    Client(tinyvmm::jobs::client::ClientArgs),
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

/// The test guest `serve` starts, and its API socket.
#[derive(clap::Args)]
struct ServeArgs {
    /// KVM slots at start: the system region's plus the initial memory's (at least 2 with
    /// initial memory; 1 with --mem-mib 0).
    #[arg(long, default_value_t = 2, value_parser = slot_count(1))]
    slots: usize,
    /// MiB of initial memory at 256 MiB, split over the other slots (0: none).
    #[arg(long, alias = "area-mib", default_value_t = 256)]
    mem_mib: u64,
    /// vCPUs of the test guest (1 to 15).
    #[arg(long, default_value_t = 1, value_parser = test_guest_vcpus)]
    vcpus: usize,
    /// Put the initial memory in a memfd (shared; a local migration hands it over instead of
    /// copying it) rather than in anonymous memory.
    #[arg(long)]
    memfd: bool,
    /// The host pages behind the initial memory: 4k, 2m (hugetlb; with --memfd an
    /// MFD_HUGETLB memfd: --mem-mib and each slot's share of it must be multiples of 2 MiB, and
    /// the pool must hold it) or thp (transparent huge pages). The hotplug area takes its own
    /// (`page_size` of PUT /hotplug/memory).
    #[arg(long, value_enum, default_value = "4k")]
    page_size: tinyvmm::control::memory::RegionPageSize,
    #[command(flatten)]
    api: ApiArgs,
}

/// The options of every subcommand that serves a test guest on an API socket.
#[derive(clap::Args)]
struct ApiArgs {
    /// Path of the API socket (created 0600; a stale socket there is replaced); `receive`
    /// answers it at once (GET /vm: Waiting, then Receiving) and serves the VM there once it
    /// runs.
    #[arg(long, alias = "api-socket")]
    api_sock: std::path::PathBuf,
    /// Seconds a client connection may send nothing before it is answered 408 and closed
    /// (fractions allowed).
    #[arg(long, default_value = "30", value_parser = positive_seconds)]
    idle_timeout: std::time::Duration,
    /// Harvest dirty pages from per-vCPU rings of this many entries (a power of two from 256
    /// to KVM's maximum, 16 bytes each) instead of per-slot bitmaps: a harvest then costs
    /// what was dirtied [default: bitmaps]
    #[arg(long)]
    dirty_ring: Option<u32>,
    /// Log every API request on stderr: method, path, status, time and a refusal's message
    /// (as --log-level debug does).
    #[arg(long)]
    log_requests: bool,
    #[command(flatten)]
    limits: LimitArgs,
}

#[derive(clap::Args)]
struct CheckArgs {
    /// KVM slots in all (2 to KVM's maximum; one holds the guest's code and tables).
    #[arg(long, default_value_t = 4096, value_parser = slot_count(2))]
    slots: usize,
    /// MiB of test memory split over the other slots.
    #[arg(long, alias = "area-mib", default_value_t = 512)]
    mem_mib: u64,
    /// vCPUs sharing the work (1 to 15).
    #[arg(long, default_value_t = 1, value_parser = test_guest_vcpus)]
    vcpus: usize,
    /// Print the report as JSON alone on stdout (the human report goes to stderr).
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    limits: LimitArgs,
}

impl Default for CheckArgs {
    fn default() -> Self {
        CheckArgs {
            slots: 4096,
            mem_mib: 512,
            vcpus: 1,
            json: false,
            limits: LimitArgs::default(),
        }
    }
}

/// `--vcpus` of the test guest: 1 to its maximum.
fn test_guest_vcpus(value: &str) -> Result<usize, String> {
    match value.parse() {
        Ok(n) if (1..=TEST_GUEST_VCPUS).contains(&n) => Ok(n),
        _ => Err(format!(
            "{value} is not a vCPU count of the test guest: 1 to {TEST_GUEST_VCPUS}"
        )),
    }
}

/// `--slots`: a KVM slot count, at least `min` (KVM's maximum is checked when the VM exists).
fn slot_count(min: usize) -> impl Fn(&str) -> Result<usize, String> + Clone {
    move |value| match value.parse() {
        // KVM's maximum where /dev/kvm answers (else the run says it cannot open KVM).
        Ok(n) if n >= min => match tinyvmm::vm::max_slots() {
            Ok(max) if n > max => Err(format!(
                "{value} is more than KVM's {max} slots on this host (2 to {max})"
            )),
            _ => Ok(n),
        },
        _ => Err(format!(
            "{value} is not a KVM slot count: {min} to KVM's maximum"
        )),
    }
}

/// A positive number of seconds, fractions allowed.
fn positive_seconds(value: &str) -> Result<std::time::Duration, String> {
    value
        .parse::<f64>()
        .ok()
        .and_then(|s| std::time::Duration::try_from_secs_f64(s).ok())
        .filter(|d| !d.is_zero())
        .ok_or_else(|| format!("{value} is not a positive number of seconds"))
}

/// The job's report, or the exit status for how it failed, with the failure named on stderr
/// (and with `json`, on stdout as `{"passed": false, "error": ...}`): 130 when a signal
/// interrupted it, 1 otherwise.
fn job_report<R, E: std::fmt::Display>(
    outcome: Result<(Result<R, E>, Ending), tinyvmm::lifecycle::LoopError>,
    failed: &str,
    json: bool,
) -> Result<R, ExitCode> {
    let (message, code) = match outcome {
        Ok((Ok(report), _)) => return Ok(report),
        Ok((Err(e), Ending::Interrupted)) => {
            let e = e.to_string();
            let message = if e.starts_with("interrupted") {
                e
            } else {
                format!("interrupted: {e}")
            };
            (message, 130)
        }
        Ok((Err(e), Ending::Finished | Ending::GuestFailed)) => (format!("{failed}{e}"), 1),
        Err(e) => (e.to_string(), 1),
    };
    eprintln!("tinyvmm: {message}");
    if json {
        print_json(false, serde_json::json!({ "error": message }));
    }
    Err(ExitCode::from(code))
}

/// Prints `fields` (a JSON object) with `"passed"` added, alone on stdout: what `--json`
/// prints on every subcommand.
fn print_json(passed: bool, mut fields: serde_json::Value) {
    if let Some(object) = fields.as_object_mut() {
        object.insert("passed".into(), passed.into());
    }
    println!(
        "{}",
        serde_json::to_string_pretty(&fields).expect("a JSON value prints")
    );
}

/// Prints `report`: the human report on stdout, or with `json` the JSON on stdout and the
/// human report on stderr; then `closing`, the line that says the run passed.
fn print_report<R: std::fmt::Display + serde::Serialize>(
    report: &R,
    json: bool,
    passed: bool,
    closing: &str,
) {
    if json {
        eprintln!("{report}");
        print_json(
            passed,
            serde_json::to_value(report).expect("the report is JSON"),
        );
        if !closing.is_empty() {
            eprintln!("{closing}");
        }
    } else {
        println!("{report}");
        if !closing.is_empty() {
            println!("{closing}");
        }
    }
}

/// The admission limits of guest memory (`kvm_memslots::MemoryLimits`), for every subcommand.
#[derive(clap::Args, Default)]
struct LimitArgs {
    /// Most guest memory in all regions, in MiB [default: 4 × the host's RAM, at least 64 GiB]
    #[arg(long)]
    max_guest_mib: Option<u64>,
    /// Largest single region, in MiB [default: the guest-memory limit]
    #[arg(long)]
    max_region_mib: Option<u64>,
    /// Most host memory KVM and the manager may spend on guest-memory metadata (bitmaps,
    /// KVM's per-page arrays: about 1/490 of the guest memory), in MiB [default: 1/8 of the
    /// host's RAM]
    #[arg(long)]
    max_metadata_mib: Option<u64>,
    /// Most KVM slots guest memory may use, below KVM's number (a budget for vhost-user
    /// backends' memory tables, say): changes past it are refused [default: KVM's number]
    #[arg(long)]
    max_slots: Option<u64>,
}

impl LimitArgs {
    /// The limits of the VMs the subcommand creates: these, else this host's defaults.
    fn resolve(&self) -> MemoryLimits {
        let mib = |v: u64| v.saturating_mul(1 << 20);
        let host = MemoryLimits::for_this_host();
        let max_guest_memory = self.max_guest_mib.map_or(host.max_guest_memory, mib);
        MemoryLimits {
            max_guest_memory,
            max_region_size: self.max_region_mib.map_or(max_guest_memory, mib),
            max_metadata: self.max_metadata_mib.map_or(host.max_metadata, mib),
            max_slots: self.max_slots.unwrap_or(u64::MAX),
        }
    }
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            // --help and --version are answers, on stdout; anything else is a usage error.
            let _ = e.print();
            return if e.use_stderr() {
                ExitCode::from(USAGE_EXIT_STATUS)
            } else {
                ExitCode::SUCCESS
            };
        }
    };
    tinyvmm::lifecycle::set_log_level(cli.log_level);
    raise_open_file_limit();
    match cli.command.unwrap_or(Commands::Check(CheckArgs::default())) {
        Commands::Check(args) => check(args),
        Commands::Bench(args) => bench(args),
        Commands::Stress(args) => stress(args),
        Commands::HarvestBench(args) => harvest_bench(args),
        Commands::SnapshotMerge(args) => snapshot_merge(args),
        Commands::SnapshotBench(args) => snapshot_bench(args),
        Commands::Restore(args) => restore(args),
        Commands::Serve(args) => serve(args),
        Commands::Receive(args) => receive(args),
        Commands::Boot(args) => boot(args),
        Commands::Client(args) => client(args),
        Commands::Completions { shell } => {
            clap_complete::generate(
                shell,
                &mut Cli::command(),
                "tinyvmm",
                &mut std::io::stdout(),
            );
            ExitCode::SUCCESS
        }
        Commands::Man { dir } => man(&dir),
    }
}

/// Raises the soft limit on open files to the hard limit, saying so on stderr: a VM holds a
/// file per shared region (a local migration hands one over per memfd region), and the usual
/// soft limit of 1024 would refuse a VM of more regions than that.
fn raise_open_file_limit() {
    if let Ok(Some((before, after))) = tinyvmm::host::raise_open_file_limit() {
        log(
            LogLevel::Info,
            format_args!(
                "note: open-file limit (RLIMIT_NOFILE) raised from {} to {} (hard limit {})",
                before.soft, after.soft, after.hard
            ),
        );
    }
}

fn check(args: CheckArgs) -> ExitCode {
    let config = CheckConfig {
        slots: args.slots,
        area_size: args.mem_mib.saturating_mul(1 << 20),
        vcpus: args.vcpus,
        limits: Some(args.limits.resolve()),
    };
    // Progress lines on a terminal only: a log or a pipe gets the report alone.
    let terminal = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let outcome = run_job(move |ctx| {
        run_check_with_progress(config, &ctx.stop, &ctx.vcpu_stopped, &mut |step| {
            if terminal {
                log(LogLevel::Info, format_args!("{step}..."));
            }
        })
    });
    match job_report(outcome, "", args.json) {
        Ok(report) => {
            print_report(&report, args.json, true, "all checks passed");
            ExitCode::SUCCESS
        }
        Err(code) => code,
    }
}

#[derive(clap::Args)]
struct BenchArgs {
    /// KVM slot counts, comma-separated (each 2 to KVM's maximum) [default: KVM's maximum]
    #[arg(long, value_delimiter = ',', value_parser = slot_count(2))]
    slots: Vec<usize>,
    /// MiB of test memory for the move and RW tests (map uses 32 MiB, unmap 128 MiB).
    #[arg(long, alias = "area-mib", default_value_t = 512)]
    mem_mib: u64,
    /// Seconds each test repeats its iteration (fractions allowed).
    #[arg(long, default_value = "5", value_parser = positive_seconds)]
    seconds: std::time::Duration,
    /// Runs of each test at each slot count.
    #[arg(long, default_value_t = 1)]
    runs: usize,
    /// Tests, comma-separated: map, unmap, unmap-chunked, move-active, move-inactive, rw
    /// [default: all]
    #[arg(long, value_delimiter = ',')]
    tests: Vec<tinyvmm::bench::perf::Scenario>,
    /// Where to write the results as JSON.
    #[arg(long, default_value = "target/bench/tinyvmm-perf.json")]
    out: std::path::PathBuf,
    /// Print the results as JSON alone on stdout (the table goes to stderr).
    #[arg(long)]
    json: bool,
    /// Keep KVM's KVM_X86_QUIRK_SLOT_ZAP_ALL (every guest mapping dropped when any slot is
    /// deleted or moved) instead of turning it off where KVM allows: to compare the two.
    #[arg(long)]
    keep_slot_zap_all: bool,
    #[command(flatten)]
    limits: LimitArgs,
}

fn bench(args: BenchArgs) -> ExitCode {
    let config = tinyvmm::bench::perf::PerfConfig {
        slots: args.slots,
        area_size: args.mem_mib.saturating_mul(1 << 20),
        seconds: args.seconds.as_secs_f64(),
        runs: args.runs,
        scenarios: args.tests,
        limits: Some(args.limits.resolve()),
        keep_slot_zap_all: args.keep_slot_zap_all,
    };
    let outcome = run_job(move |ctx| {
        tinyvmm::bench::perf::run_perf(&config, &ctx.stop, &ctx.vcpu_stopped, &mut |p| {
            eprintln!("{p}")
        })
    });
    let report = match job_report(outcome, "", args.json) {
        Ok(report) => report,
        Err(code) => return code,
    };
    print_report(&report, args.json, !report.interrupted, "");
    if write_json(&args.out, &report) != ExitCode::SUCCESS {
        return ExitCode::FAILURE;
    }
    if report.interrupted {
        ExitCode::from(130)
    } else {
        ExitCode::SUCCESS
    }
}

#[derive(clap::Args)]
struct HarvestArgs {
    /// KVM slots in all (2 to KVM's maximum) [default: KVM's maximum]
    #[arg(long, value_parser = slot_count(2))]
    slots: Option<usize>,
    /// MiB of logged guest memory split over the slots.
    #[arg(long, alias = "area-mib", default_value_t = 1024)]
    mem_mib: u64,
    /// Entries per vCPU ring in ring mode (a power of two from 256 to KVM's maximum).
    #[arg(long, alias = "ring-entries", default_value_t = 65536)]
    dirty_ring: u32,
    /// Repetitions per share of dirtied pages.
    #[arg(long, default_value_t = 5)]
    runs: usize,
    /// Where to write the results as JSON.
    #[arg(long, default_value = "target/bench/tinyvmm-harvest.json")]
    out: std::path::PathBuf,
    /// Print the results as JSON alone on stdout (the table goes to stderr).
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    limits: LimitArgs,
}

fn harvest_bench(args: HarvestArgs) -> ExitCode {
    use tinyvmm::bench::harvest::{run_harvest_bench, HarvestConfig};
    let slots = match args.slots {
        Some(slots) => slots,
        None => match tinyvmm::vm::max_slots() {
            Ok(max) => max,
            Err(e) => {
                eprintln!("tinyvmm: {e}");
                return ExitCode::FAILURE;
            }
        },
    };
    let config = HarvestConfig {
        slots,
        area_size: args.mem_mib.saturating_mul(1 << 20),
        ring_entries: args.dirty_ring,
        runs: args.runs,
        limits: Some(args.limits.resolve()),
    };
    let outcome = run_job(move |ctx| run_harvest_bench(&config, &ctx.stop, &ctx.vcpu_stopped));
    let report = match job_report(outcome, "", args.json) {
        Ok(report) => report,
        Err(code) => return code,
    };
    print_report(&report, args.json, true, "");
    write_json(&args.out, &report)
}

/// Writes `report` as JSON to `path` (creating its folder).
fn write_json<R: serde::Serialize>(path: &std::path::Path, report: &R) -> ExitCode {
    let json = serde_json::to_string_pretty(report).expect("the report is JSON");
    let written = match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => std::fs::create_dir_all(dir),
        _ => Ok(()),
    }
    .and_then(|()| std::fs::write(path, json + "\n"));
    match written {
        Ok(()) => {
            log(
                LogLevel::Info,
                format_args!("results written to {}", path.display()),
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("tinyvmm: cannot write {}: {e}", path.display());
            ExitCode::FAILURE
        }
    }
}

#[derive(clap::Args)]
struct StressArgs {
    /// Writer vCPUs (1 to 15); with fewer than 15, one more vCPU verifies alongside them.
    #[arg(long, default_value_t = 2, value_parser = test_guest_vcpus)]
    vcpus: usize,
    /// KiB of memory each writer writes.
    #[arg(long, default_value_t = 4096)]
    kib_per_vcpu: u64,
    /// KVM slots per writer in the writers' region.
    #[arg(long, default_value_t = 2)]
    slots_per_vcpu: u64,
    /// Bytes between the addresses the writers write (a multiple of 8; 4096: every page).
    #[arg(long, default_value_t = 4096)]
    stride: u64,
    /// Iterations of changes (each makes every kind of change once).
    #[arg(long, default_value_t = 1000)]
    iterations: u64,
    /// Stop after this many seconds even if iterations are left (fractions allowed).
    #[arg(long, default_value = "10", value_parser = positive_seconds)]
    seconds: std::time::Duration,
    /// Harvest dirty pages from per-vCPU rings of this many entries (a power of two from 256
    /// to KVM's maximum) instead of per-slot bitmaps [default: bitmaps]
    #[arg(long)]
    dirty_ring: Option<u32>,
    /// Print the report as JSON alone on stdout (the human report goes to stderr).
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    limits: LimitArgs,
}

fn stress(args: StressArgs) -> ExitCode {
    use tinyvmm::bench::stress::{run_stress, StressConfig};
    let duration = args.seconds;
    let config = StressConfig {
        vcpus: args.vcpus,
        part_size: args.kib_per_vcpu.saturating_mul(1024),
        slots_per_vcpu: args.slots_per_vcpu,
        stride: args.stride,
        iterations: args.iterations,
        duration,
        corrupt_page: None,
        dirty_ring: args.dirty_ring,
        limits: Some(args.limits.resolve()),
    };
    let outcome = run_job(move |ctx| run_stress(config, &ctx.stop, &ctx.vcpu_stopped));
    match job_report(outcome, "stress failed: ", args.json) {
        Ok(report) => {
            print_report(
                &report,
                args.json,
                true,
                "stress passed: no write lost, no dirty page missed, no wrong data",
            );
            ExitCode::SUCCESS
        }
        Err(code) => code,
    }
}

#[derive(clap::Args)]
struct RestoreArgs {
    /// The state file a snapshot wrote (`snapshot_path` of PUT /snapshot/create).
    #[arg(long)]
    snapshot: std::path::PathBuf,
    /// The memory file: a Full's own (`mem_file_path`), or for a Diff its chain merged with
    /// `tinyvmm snapshot-merge` (a Diff's own memory file is refused).
    #[arg(long)]
    mem_file: std::path::PathBuf,
    /// copy: read the memory in before the guest runs; file: map the file privately, pages
    /// load when first touched; uffd: a userfaultfd handler fills each page on first touch.
    #[arg(long, value_enum, default_value_t)]
    mem_backend: tinyvmm::vm::restore::MemBackend,
    /// Record the pages the VM touches first, in that order, into this file when the
    /// recording ends (after --record-secs, on PUT /working-set/stop, or when the VMM stops).
    /// Needs --mem-backend uffd [default: no recording]
    #[arg(long, value_name = "PATH", conflicts_with = "prefetch", value_parser = file_to_write)]
    record_working_set: Option<std::path::PathBuf>,
    /// End the recording this many seconds after the restore [default: when the VMM stops]
    #[arg(long, value_name = "N", requires = "record_working_set", value_parser = seconds)]
    record_secs: Option<std::time::Duration>,
    /// Fetch the pages of this list (recorded on a restore of the same snapshot) ahead of the
    /// guest while the rest still loads on fault. Needs --mem-backend uffd [default: none]
    #[arg(long, value_name = "PATH")]
    prefetch: Option<std::path::PathBuf>,
    /// Every region in pages of this size rather than the ones the snapshot was taken with
    /// (2m: each region's guest address, size and slots on the 2 MiB grid, and the hugetlb pool
    /// must hold them; a working set recorded with one page size serves restores with that
    /// size) [default: the snapshot's]
    #[arg(long, value_enum)]
    page_size: Option<tinyvmm::control::memory::RegionPageSize>,
    /// The API socket and the VM's limits (its memory and vCPUs are the snapshot's).
    #[command(flatten)]
    api: ApiArgs,
}

#[derive(clap::Args)]
struct SnapshotBenchArgs {
    /// KVM slot counts, comma-separated (each 2 to KVM's maximum) [default: 2, 4096 and
    /// KVM's maximum]
    #[arg(long, value_delimiter = ',', value_parser = slot_count(2))]
    slots: Vec<usize>,
    /// MiB of test memory.
    #[arg(long, alias = "area-mib", default_value_t = 512)]
    mem_mib: u64,
    /// The folder for the snapshot files (on the file system to measure).
    #[arg(long, default_value = "target/bench/snapshots")]
    dir: std::path::PathBuf,
    /// Where to write the results as JSON.
    #[arg(long, default_value = "target/bench/tinyvmm-snapshot.json")]
    out: std::path::PathBuf,
    /// Print the results as JSON alone on stdout (the table goes to stderr).
    #[arg(long)]
    json: bool,
    /// Page sizes of the test memory, comma-separated: a row each per slot count.
    #[arg(long, value_delimiter = ',', value_enum, default_value = "4k")]
    page_sizes: Vec<tinyvmm::control::memory::RegionPageSize>,
    /// Which pages the guest writes (and verifies after each restore): every other one, or
    /// all.
    #[arg(long, value_enum, default_value_t = Touch::Half)]
    touch: Touch,
    #[command(flatten)]
    limits: LimitArgs,
}

/// Which pages `snapshot-bench`'s guest writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Touch {
    /// Every other page.
    Half,
    /// Every page.
    All,
}

fn snapshot_bench(args: SnapshotBenchArgs) -> ExitCode {
    use tinyvmm::bench::snapshot::{run_snapshot_bench, SnapshotBenchConfig};
    let slots = if args.slots.is_empty() {
        match tinyvmm::vm::max_slots() {
            Ok(max) => vec![2, 4096, max],
            Err(e) => {
                eprintln!("tinyvmm: {e}");
                return ExitCode::FAILURE;
            }
        }
    } else {
        args.slots
    };
    let config = SnapshotBenchConfig {
        slots,
        area_size: args.mem_mib.saturating_mul(1 << 20),
        dir: args.dir,
        limits: Some(args.limits.resolve()),
        page_sizes: args.page_sizes.into_iter().map(Into::into).collect(),
        touch_all: args.touch == Touch::All,
    };
    let outcome = run_job(move |ctx| run_snapshot_bench(&config, &ctx.stop, &ctx.vcpu_stopped));
    let report = match job_report(outcome, "", args.json) {
        Ok(report) => report,
        Err(code) => return code,
    };
    print_report(&report, args.json, true, "");
    write_json(&args.out, &report)
}

#[derive(clap::Args)]
struct MergeArgs {
    /// Where the merged memory file goes (it must not exist); restore it with the last state
    /// file.
    #[arg(long)]
    out: std::path::PathBuf,
    /// The chain, oldest first: the Full snapshot's state and memory files, then each Diff's,
    /// as pairs: STATE MEM STATE MEM ...
    #[arg(required = true, num_args = 2..)]
    files: Vec<std::path::PathBuf>,
}

fn snapshot_merge(args: MergeArgs) -> ExitCode {
    match tinyvmm::jobs::merge::merge_chain(&args.files, &args.out) {
        Ok(report) => {
            log(
                LogLevel::Info,
                format_args!(
                    "{} snapshot(s), {} bytes, merged into {}",
                    report.snapshots,
                    report.bytes,
                    args.out.display()
                ),
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("tinyvmm: {e}");
            ExitCode::FAILURE
        }
    }
}

/// A number of seconds, above 0 and finite (a usage error otherwise).
fn seconds(value: &str) -> Result<std::time::Duration, String> {
    let secs: f64 = value
        .parse()
        .map_err(|e| format!("{value:?} is not a number of seconds: {e}"))?;
    if secs.is_nan() || secs <= 0.0 {
        return Err(format!("{value} is not above 0 seconds"));
    }
    std::time::Duration::try_from_secs_f64(secs).map_err(|e| format!("{value}: {e}"))
}

/// A path for a file to write: not a directory that exists (a usage error otherwise, before
/// anything starts, not a recording lost when the VMM stops).
fn file_to_write(value: &str) -> Result<std::path::PathBuf, String> {
    let path = std::path::PathBuf::from(value);
    if path.is_dir() {
        return Err(format!(
            "{value} is a directory: give the path of a file to write"
        ));
    }
    Ok(path)
}

fn restore(args: RestoreArgs) -> ExitCode {
    use tinyvmm::snapshot::GuestKind;
    let from = tinyvmm::jobs::restore::RestoreFrom {
        snapshot: args.snapshot,
        mem_file: args.mem_file,
        backend: args.mem_backend,
        working_set: tinyvmm::jobs::working_set::WorkingSetFiles {
            prefetch: args.prefetch,
            record: args.record_working_set,
            record_for: args.record_secs,
        },
        page_size: args.page_size.map(Into::into),
    };
    // A file that is neither kind's is refused by the test guest's reader, which says why.
    if !matches!(GuestKind::of_file(&from.snapshot), Ok(GuestKind::Linux)) {
        // The restored VM's memory and vCPUs are the snapshot's: serve's own shape is unused.
        let serve = ServeArgs {
            api: args.api,
            slots: 2,
            mem_mib: 0,
            vcpus: 1,
            memfd: false,
            page_size: Default::default(),
        };
        return serve_config(serve, Some(from));
    }
    let limits = Some(args.api.limits.resolve());
    match tinyvmm::jobs::restore::restore_linux(
        &from,
        args.api.api_sock,
        Box::new(std::io::stdout()),
        limits,
    ) {
        Ok(ending) => linux_ended(&ending),
        Err(e) => {
            eprintln!("tinyvmm: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Says how a Linux guest's run ended (a failure at every log level, a clean end at info)
/// and gives its exit status.
fn linux_ended(ending: &tinyvmm::linux::BootEnding) -> ExitCode {
    let code = ending.exit_code();
    let level = if code == 0 {
        LogLevel::Info
    } else {
        LogLevel::Error
    };
    log(level, ending);
    ExitCode::from(code)
}

#[derive(clap::Args)]
struct ReceiveArgs {
    /// Where to wait for the source: unix:PATH or tcp:HOST:PORT.
    #[arg(long)]
    listen: tinyvmm::migration::Endpoint,
    /// The API socket, and the VM's limits and dirty-log mode (for migrating onwards).
    #[command(flatten)]
    api: ApiArgs,
}

fn receive(args: ReceiveArgs) -> ExitCode {
    tinyvmm::api::server::log_requests(args.api.log_requests);
    let config = tinyvmm::jobs::receive::ReceiveConfig {
        listen: args.listen,
        api_sock: args.api.api_sock,
        idle_timeout: args.api.idle_timeout,
        limits: Some(args.api.limits.resolve()),
        dirty_ring: args.api.dirty_ring,
        after_landing: None,
    };
    let listen = config.listen.to_string();
    let api = config.api_sock.display().to_string();
    let outcome = tinyvmm::jobs::receive::receive(
        &config,
        || {
            log(
                LogLevel::Info,
                format_args!("waiting for a migration on {listen}; the API answers on {api}"),
            )
        },
        |r| {
            log(
                LogLevel::Info,
                format_args!(
                    "the VM runs here after {} rounds, {} MiB, {:.0} ms (its memory checked \
                     against the source's digest in {:.0} ms); serving the API on {api}",
                    r.rounds,
                    r.bytes >> 20,
                    r.elapsed.as_secs_f64() * 1e3,
                    r.check.as_secs_f64() * 1e3
                ),
            )
        },
    );
    match outcome {
        Ok(tinyvmm::jobs::receive::ReceiveEnding::Linux(ending)) => linux_ended(&ending),
        Ok(tinyvmm::jobs::receive::ReceiveEnding::TestGuest(ending)) => {
            served(Ok::<_, String>(ending))
        }
        Err(e) => served(Err::<Ending, _>(e)),
    }
}

/// The exit status of a VMM that served a VM: 0 when a client stopped it (or it migrated
/// away), 130 on a signal, 4 when stopped either way after its guest failed, 1 on a failure
/// (named on stderr).
fn served(outcome: Result<Ending, impl std::fmt::Display>) -> ExitCode {
    use tinyvmm::control::vm::FAILED_EXIT_STATUS;
    match outcome {
        Ok(Ending::GuestFailed) => {
            eprintln!("tinyvmm: stopped, with a failed guest (exit status {FAILED_EXIT_STATUS})");
            ExitCode::from(FAILED_EXIT_STATUS)
        }
        Ok(Ending::Finished) => {
            log(LogLevel::Info, "stopped");
            ExitCode::SUCCESS
        }
        Ok(Ending::Interrupted) => {
            log(LogLevel::Info, "stopped by a signal");
            ExitCode::from(130)
        }
        Err(e) => {
            eprintln!("tinyvmm: {e}");
            // A signal that cut a step short (a migration being received, say) is still the
            // signal's ending.
            if tinyvmm::lifecycle::termination_signal().load(std::sync::atomic::Ordering::Acquire) {
                ExitCode::from(130)
            } else {
                ExitCode::FAILURE
            }
        }
    }
}

fn serve(args: ServeArgs) -> ExitCode {
    if args.slots < 2 && args.mem_mib > 0 {
        return usage_error(
            "serve",
            &format!(
                "--slots {} leaves no slot for --mem-mib {}: give 2 slots or more, or --mem-mib 0",
                args.slots, args.mem_mib
            ),
        );
    }
    if args.mem_mib > 0 {
        use tinyvmm::test_guest::area::TestArea;
        let size = args.mem_mib.saturating_mul(1 << 20);
        let page_size = kvm_memslots::PageSize::from(args.page_size);
        if let Err(e) = TestArea::check_layout(size, args.slots as u64 - 1, page_size) {
            return usage_error(
                "serve",
                &format!(
                    "--page-size {} with --mem-mib {} over {} slots: {e}",
                    page_size.name(),
                    args.mem_mib,
                    args.slots - 1
                ),
            );
        }
    }
    serve_config(args, None)
}

/// Says `message` as clap says a usage error of `subcommand`, and gives the usage error's exit
/// status.
fn usage_error(subcommand: &str, message: &str) -> ExitCode {
    let mut cli = Cli::command();
    cli.build();
    let mut command = cli.find_subcommand(subcommand).cloned().unwrap_or(cli);
    let _ = command
        .error(clap::error::ErrorKind::ValueValidation, message)
        .print();
    ExitCode::from(USAGE_EXIT_STATUS)
}

fn serve_config(args: ServeArgs, restore: Option<tinyvmm::jobs::restore::RestoreFrom>) -> ExitCode {
    tinyvmm::api::server::log_requests(args.api.log_requests);
    let config = tinyvmm::jobs::serve::ServeConfig {
        api_sock: args.api.api_sock,
        slots: args.slots,
        area_size: args.mem_mib.saturating_mul(1 << 20),
        vcpus: args.vcpus,
        idle_timeout: args.api.idle_timeout,
        limits: Some(args.api.limits.resolve()),
        dirty_ring: args.api.dirty_ring,
        memfd: args.memfd,
        page_size: args.page_size.into(),
        restore,
    };
    let path = config.api_sock.display().to_string();
    served(tinyvmm::jobs::serve::serve(&config, || {
        log(LogLevel::Info, format_args!("serving the API on {path}"))
    }))
}

#[derive(clap::Args)]
struct BootArgs {
    /// A JSON boot configuration (fields as the options below, `_` for `-`, except
    /// `mem_slots` for --slots, `timeout_secs` for --timeout and `acpi: false` for --no-acpi;
    /// unknown fields are refused). Options given with it override the file's fields.
    #[arg(long)]
    config: Option<std::path::PathBuf>,
    /// The kernel: a bzImage, or an ELF vmlinux (PVH entry when it has the note).
    #[arg(long, required_unless_present = "config")]
    kernel: Option<std::path::PathBuf>,
    /// An initramfs.
    #[arg(long)]
    initramfs: Option<std::path::PathBuf>,
    /// The kernel command line [default: "console=ttyS0 reboot=k panic=-1"]
    #[arg(long)]
    cmdline: Option<String>,
    /// vCPUs (1 to 32) [default: 1]
    #[arg(long, value_parser = clap::value_parser!(u8).range(1..=32))]
    vcpus: Option<u8>,
    /// MiB of RAM [default: 512]
    #[arg(long)]
    mem_mib: Option<u64>,
    /// KVM slots the RAM is split into (equal sizes, whole pages) [default: 1]
    #[arg(long = "slots", alias = "mem-slots", value_name = "SLOTS", value_parser = clap::value_parser!(u64).range(1..))]
    mem_slots: Option<u64>,
    /// Leave a hole after every slot above the first 128 MiB (one e820 RAM range per slot).
    #[arg(long)]
    mem_holes: bool,
    /// Stop the VM after this many seconds (fractions allowed; exit status 124) [default:
    /// none]
    #[arg(long)]
    timeout: Option<f64>,
    /// How to enter the kernel: auto (PVH when the kernel and map allow), linux or pvh
    /// [default: auto]
    #[arg(long, value_enum)]
    protocol: Option<tinyvmm::linux::BootProtocol>,
    /// Do not print the e820 map and the command line the VMM built (on stderr).
    #[arg(long)]
    quiet: bool,
    /// MiB of hotpluggable memory behind a virtio-mem device above RAM (none plugged at boot;
    /// `PATCH /hotplug/memory` on --api-sock asks the guest to plug) [default: 0, no device]
    #[arg(long)]
    hotplug_mib: Option<u64>,
    /// The virtio-mem block size in MiB (a power of two, at least 2) [default: 2]
    #[arg(long)]
    hotplug_block_mib: Option<u64>,
    /// The largest KVM slot neighbouring plugged blocks share, in MiB (a multiple of the block
    /// size; 0: a slot per block) [default: 128]
    #[arg(long)]
    hotplug_max_slot_mib: Option<u64>,
    /// An API socket while the guest runs: /vm (pause, resume), /snapshot/create, /migrate,
    /// /dirty-log, /memory, /hotplug/memory, /actions [default: none]
    #[arg(long, alias = "api-socket")]
    api_sock: Option<std::path::PathBuf>,
    /// Put RAM in memfds (shared memory): a local migration hands it over instead of copying.
    #[arg(long)]
    memfd: bool,
    /// The host pages behind RAM: 4k, 2m (hugetlb; with --memfd an MFD_HUGETLB memfd: RAM and
    /// each slot a multiple of 2 MiB, the pool holding all of RAM) or thp [default: 4k]
    #[arg(long, value_enum)]
    page_size: Option<tinyvmm::control::memory::RegionPageSize>,
    /// The host pages behind the virtio-mem device's plugged blocks: 4k, 2m (the pool must
    /// hold a piece when the guest plugs into it) or thp [default: 4k]
    #[arg(long, value_enum)]
    hotplug_page_size: Option<tinyvmm::control::memory::RegionPageSize>,
    /// Harvest dirty pages from per-vCPU rings of this many entries (a power of two from 256
    /// to KVM's maximum) instead of per-slot bitmaps; refused where KVM emulates the guest
    /// kernel (kvm_pvm) [default: bitmaps]
    #[arg(long)]
    dirty_ring: Option<u32>,
    /// Log every API request on stderr: method, path, status, time and a refusal's message
    /// (as --log-level debug does).
    #[arg(long)]
    log_requests: bool,
    /// Print how the run ended as JSON alone on stdout (durations in ms, "passed": true for
    /// exit status 0); the guest's console then goes to stderr.
    #[arg(long)]
    json: bool,
    /// No ACPI tables: the guest gets the MP table alone and finds the virtio-mem device on its
    /// command line (`virtio_mmio.device=`, for kernels with CONFIG_VIRTIO_MMIO_CMDLINE_DEVICES).
    #[arg(long)]
    no_acpi: bool,
    #[command(flatten)]
    limits: LimitArgs,
}

fn boot(args: BootArgs) -> ExitCode {
    use tinyvmm::jobs::boot::boot;
    use tinyvmm::linux::{describe, BootConfig, Console};
    let mut config = match &args.config {
        Some(path) => match BootConfig::from_file(path) {
            Ok(config) => config,
            Err(e) => {
                eprintln!("tinyvmm: {e}");
                return ExitCode::FAILURE;
            }
        },
        None => BootConfig::default(),
    };
    if let Some(kernel) = args.kernel {
        config.kernel = kernel;
    }
    config.initramfs = args.initramfs.or(config.initramfs);
    if let Some(cmdline) = args.cmdline {
        config.cmdline = cmdline;
    }
    config.vcpus = args.vcpus.unwrap_or(config.vcpus);
    config.mem_mib = args.mem_mib.unwrap_or(config.mem_mib);
    config.mem_slots = args.mem_slots.unwrap_or(config.mem_slots);
    config.mem_holes |= args.mem_holes;
    config.timeout_secs = args.timeout.or(config.timeout_secs);
    config.protocol = args.protocol.unwrap_or(config.protocol);
    config.hotplug_mib = args.hotplug_mib.unwrap_or(config.hotplug_mib);
    config.hotplug_block_mib = args.hotplug_block_mib.unwrap_or(config.hotplug_block_mib);
    config.hotplug_max_slot_mib = args
        .hotplug_max_slot_mib
        .unwrap_or(config.hotplug_max_slot_mib);
    config.api_sock = args.api_sock.or(config.api_sock);
    config.acpi &= !args.no_acpi;
    config.memfd |= args.memfd;
    config.page_size = args.page_size.unwrap_or(config.page_size);
    config.hotplug_page_size = args.hotplug_page_size.unwrap_or(config.hotplug_page_size);
    config.dirty_ring = args.dirty_ring.or(config.dirty_ring);
    config.limits = Some(args.limits.resolve());
    tinyvmm::api::server::log_requests(args.log_requests);
    let json = args.json;
    let console = Console {
        // With --json, stdout holds the JSON alone.
        output: if json {
            Box::new(std::io::stderr())
        } else {
            Box::new(std::io::stdout())
        },
        stdin: true,
        stop: None,
    };
    let quiet = args.quiet;
    let started = std::time::Instant::now();
    match boot(&config, console, |report| {
        if !quiet && tinyvmm::lifecycle::logs(LogLevel::Info) {
            eprint!("{}", describe(report));
        }
    }) {
        Ok(report) => {
            let code = linux_ended(&report.ending);
            if json {
                let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
                print_json(
                    report.ending.exit_code() == 0,
                    serde_json::json!({
                        "ending": report.ending.to_string(),
                        "exit_status": report.ending.exit_code(),
                        "kernel_format": match report.format {
                            tinyvmm::linux::KernelFormat::BzImage => "bzimage",
                            tinyvmm::linux::KernelFormat::Elf => "elf",
                        },
                        "regions": report.regions,
                        "slots": report.slots,
                        "cmdline": report.cmdline,
                        "setup_ms": ms(report.setup_time),
                        "run_ms": ms(started.elapsed().saturating_sub(report.setup_time)),
                    }),
                );
            }
            code
        }
        Err(e) => {
            eprintln!("tinyvmm: {e}");
            if json {
                print_json(false, serde_json::json!({ "error": e.to_string() }));
            }
            ExitCode::FAILURE
        }
    }
}

fn client(args: tinyvmm::jobs::client::ClientArgs) -> ExitCode {
    use tinyvmm::jobs::client::{run, API_SOCK_ENV};
    if let Some(level) = args.log_level {
        tinyvmm::lifecycle::set_log_level(level);
    }
    let Some(socket) = args.api_sock.clone() else {
        let _ = Cli::command()
            .error(
                clap::error::ErrorKind::MissingRequiredArgument,
                format!(
                    "tinyvmm client needs the VMM's API socket: --api-sock PATH, or {API_SOCK_ENV}"
                ),
            )
            .print();
        return ExitCode::from(USAGE_EXIT_STATUS);
    };
    ExitCode::from(run(&args, &socket))
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
