//! The command-line arguments several subcommands share (of `tinyvmm` and of `tinyvmm-bench`):
//! the memory limits ([`LimitArgs`]), the API socket's options (`ApiArgs`), the value
//! parsers that check a number before anything starts, and the usage error a subcommand finds
//! after parsing ([`UsageError`], exit status `USAGE_EXIT_STATUS`). Each subcommand's own
//! arguments are beside its job.

use std::path::PathBuf;
use std::time::Duration;

use kvm_memslots::MemoryLimits;

/// The exit status of a usage error (an unknown option, a value out of its range), distinct
/// from every outcome of a run (sysexits' `EX_USAGE`).
const USAGE_EXIT_STATUS: u8 = 64;

/// Most vCPUs of the test guest.
const TEST_GUEST_VCPUS: usize = crate::test_guest::layout::MAX_VCPUS;

/// The command line `P` parsed, or the exit status the binary ends with at once: 0 after
/// printing `--help` or `--version` (answers, on stdout), `USAGE_EXIT_STATUS` after naming
/// a usage error on stderr.
pub fn parse_command_line<P: clap::Parser>() -> Result<P, std::process::ExitCode> {
    P::try_parse().map_err(|e| {
        let _ = e.print();
        if e.use_stderr() {
            std::process::ExitCode::from(USAGE_EXIT_STATUS)
        } else {
            std::process::ExitCode::SUCCESS
        }
    })
}

/// What both binaries do first: parse their command line `P` ([`parse_command_line`]), apply
/// its `--log-level` (`log` finds it) and raise the open-file limit for many regions
/// ([`raise_open_file_limit`](super::process::raise_open_file_limit)). The command line, or
/// the exit status the binary ends with at once.
pub fn start_command_line<P: clap::Parser>(
    log: impl FnOnce(&P) -> &LogArgs,
) -> Result<P, std::process::ExitCode> {
    let cli = parse_command_line::<P>()?;
    crate::lifecycle::set_log_level(log(&cli).log_level);
    super::process::raise_open_file_limit();
    Ok(cli)
}

/// A usage error a subcommand finds in its arguments after they parsed (options that do not
/// fit together): the binary says it as clap says one, with the subcommand's usage, and exits
/// with `USAGE_EXIT_STATUS`.
#[derive(Debug)]
pub struct UsageError {
    /// The subcommand whose usage it shows (`serve`), or `None` for the binary's own.
    pub(crate) subcommand: Option<&'static str>,
    /// What kind of usage error clap calls it.
    pub(crate) kind: clap::error::ErrorKind,
    /// What is wrong.
    pub(crate) message: String,
}

impl UsageError {
    /// Says this error as clap says a usage error of `command` (the binary's command line) and
    /// gives the usage error's exit status.
    pub fn report(&self, mut command: clap::Command) -> std::process::ExitCode {
        command.build();
        let mut command = self
            .subcommand
            .and_then(|name| command.find_subcommand(name).cloned())
            .unwrap_or(command);
        let _ = command.error(self.kind, &self.message).print();
        std::process::ExitCode::from(USAGE_EXIT_STATUS)
    }
}

/// `--log-level`, an option of every subcommand (of both binaries).
#[derive(Debug, clap::Args)]
pub struct LogArgs {
    /// How much the VMM says on stderr, on every subcommand: error (only failures), warn (and
    /// problems it went on from), info (and each state change: serving, waiting, receiving,
    /// migrated, stopped, files written) or debug (and every API request, as --log-requests).
    #[arg(long, global = true, value_enum, default_value_t)]
    pub log_level: crate::lifecycle::LogLevel,
}

/// The options of every subcommand that serves a test guest on an API socket.
#[derive(Debug, clap::Args)]
pub(crate) struct ApiArgs {
    /// Path of the API socket (created 0600; a stale socket there is replaced); `receive`
    /// answers it at once (GET /vm: Waiting, then Receiving) and serves the VM there once it
    /// runs.
    #[arg(long, alias = "api-socket")]
    pub(crate) api_sock: PathBuf,
    /// Seconds a client connection may send nothing before it is answered 408 and closed
    /// (fractions allowed).
    #[arg(long, default_value = "30", value_parser = positive_seconds)]
    pub(crate) idle_timeout: Duration,
    /// Harvest dirty pages from per-vCPU rings of this many entries (a power of two from 256
    /// to KVM's maximum, 16 bytes each) instead of per-slot bitmaps: a harvest then costs
    /// what was dirtied [default: bitmaps]
    #[arg(long)]
    pub(crate) dirty_ring: Option<u32>,
    /// Log every API request on stderr: method, path, status, time and a refusal's message
    /// (as --log-level debug does).
    #[arg(long)]
    pub(crate) log_requests: bool,
    /// The memory limits of the VM it serves.
    #[command(flatten)]
    pub(crate) limits: LimitArgs,
}

/// The admission limits of guest memory (`kvm_memslots::MemoryLimits`), for every subcommand.
#[derive(Debug, clap::Args, Default)]
pub struct LimitArgs {
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
    pub fn resolve(&self) -> MemoryLimits {
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

/// `--vcpus` of the test guest: 1 to its maximum.
pub fn test_guest_vcpus(value: &str) -> Result<usize, String> {
    match value.parse() {
        Ok(n) if (1..=TEST_GUEST_VCPUS).contains(&n) => Ok(n),
        _ => Err(format!(
            "{value} is not a vCPU count of the test guest: 1 to {TEST_GUEST_VCPUS}"
        )),
    }
}

/// `--slots`: a KVM slot count, at least `min` (KVM's maximum is checked when the VM exists).
pub fn slot_count(min: usize) -> impl Fn(&str) -> Result<usize, String> + Clone {
    move |value| match value.parse() {
        // KVM's maximum where /dev/kvm answers (else the run says it cannot open KVM).
        Ok(n) if n >= min => match crate::vm::max_slots() {
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
pub fn positive_seconds(value: &str) -> Result<Duration, String> {
    value
        .parse::<f64>()
        .ok()
        .and_then(|s| Duration::try_from_secs_f64(s).ok())
        .filter(|d| !d.is_zero())
        .ok_or_else(|| format!("{value} is not a positive number of seconds"))
}

/// A number of seconds, above 0 and finite (a usage error otherwise), naming why a value is
/// refused.
pub(super) fn seconds(value: &str) -> Result<Duration, String> {
    let secs: f64 = value
        .parse()
        .map_err(|e| format!("{value:?} is not a number of seconds: {e}"))?;
    if secs.is_nan() || secs <= 0.0 {
        return Err(format!("{value} is not above 0 seconds"));
    }
    Duration::try_from_secs_f64(secs).map_err(|e| format!("{value}: {e}"))
}

/// A path for a file to write: not a directory that exists (a usage error otherwise, before
/// anything starts, not a recording lost when the VMM stops).
pub(super) fn file_to_write(value: &str) -> Result<PathBuf, String> {
    let path = PathBuf::from(value);
    if path.is_dir() {
        return Err(format!(
            "{value} is a directory: give the path of a file to write"
        ));
    }
    Ok(path)
}
