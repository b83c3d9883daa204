//! `tinyvmm boot`: a Linux guest (`LinuxVm`) run under the run loop (`RunLoop`) with its
//! console and, with `--api-sock`, its API socket, until it resets, a vCPU stops, a client or
//! the caller stops it, a signal comes or the timeout.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::args::LimitArgs;
use super::process::print_json;
use super::run_loop::RunLoop;
use crate::api::server::{ApiSocket, SocketError, DEFAULT_IDLE_TIMEOUT};
use crate::control::memory::RegionPageSize;
use crate::host::RawTerminal;
use crate::lifecycle::{log, LogLevel, LoopError};
use crate::linux::controller::LinuxController;
use crate::linux::{
    describe, BootConfig, BootEnding, BootError, BootProtocol, BootReport, ConfigError, Console,
    KernelFormat, LinuxVcpus, LinuxVm,
};

/// Why a boot could not start (or the VMM failed while it ran).
#[derive(Debug, thiserror::Error)]
pub enum BootJobError {
    /// Setting the guest up failed.
    #[error(transparent)]
    Boot(#[from] BootError),
    /// The event loop could not be set up.
    #[error(transparent)]
    Loop(#[from] LoopError),
    /// The API socket could not be created.
    #[error(transparent)]
    Api(#[from] SocketError),
    /// A snapshot's or a migration's state file, or its memory file, was refused.
    #[error("cannot restore from {}: {reason}", path.display())]
    Restore {
        /// The file.
        path: PathBuf,
        /// Why.
        reason: String,
    },
}

/// Boots `config`'s kernel and runs it until it resets, a vCPU stops, a signal or the timeout.
/// `on_start` sees the report (ending aside) just before the vCPUs start.
pub fn boot(
    config: &BootConfig,
    console: Console,
    on_start: impl FnOnce(&BootReport),
) -> Result<BootReport, BootJobError> {
    let started = Instant::now();
    let (mut linux, mut report) = LinuxVm::new(config, console.output)?;
    let vcpus = linux.create_vcpus(config)?;
    report.setup_time = started.elapsed();
    on_start(&report);
    // A client that finds the socket may signal the VMM before its run loop exists.
    crate::lifecycle::catch_termination_signals()?;
    let api = config
        .api_sock
        .as_deref()
        .map(ApiSocket::bind)
        .transpose()?;
    let run = LinuxRun {
        api,
        timeout_secs: config.timeout_secs,
        stdin: console.stdin,
        stop: console.stop,
        paused: false,
    };
    report.ending = run_linux(&linux, vcpus, run)?;
    Ok(report)
}

/// How a Linux guest runs: its API socket, its timeout, its console input, a caller's stop
/// flag, and whether it starts paused (a restored or received guest).
#[derive(Debug, Default)]
pub(super) struct LinuxRun {
    /// The API socket to serve, bound.
    pub(crate) api: Option<ApiSocket>,
    /// Stop the VM after this many seconds.
    pub(crate) timeout_secs: Option<f64>,
    /// Read console input from stdin (a terminal).
    pub(crate) stdin: bool,
    /// Set by the caller to stop the VM.
    pub(crate) stop: Option<Arc<AtomicBool>>,
    /// The vCPUs start paused: a client resumes them (`PATCH /vm`).
    pub(crate) paused: bool,
}

/// Runs `linux` on `vcpus` under the run loop, with its console and API socket, until it
/// resets, a vCPU stops, a client or the caller stops it, it migrates away, a signal comes or
/// the timeout; returns how it ended.
pub(super) fn run_linux(
    linux: &LinuxVm,
    vcpus: LinuxVcpus,
    options: LinuxRun,
) -> Result<BootEnding, BootJobError> {
    let mut run = RunLoop::new()?;
    let terminal = if options.stdin {
        RawTerminal::on_stdin()
    } else {
        None
    };
    let reset_seen = Arc::new(AtomicBool::new(false));
    run.add(Arc::new(Mutex::new(
        linux.console(Arc::clone(&reset_seen), terminal.is_some())?,
    )));
    let mut running = vcpus.start(&run.context().vcpu_stopped)?;
    if !options.paused {
        // Restored vCPUs start parked; a fresh boot's run at once.
        for vcpu in running.handles() {
            vcpu.shared.resume();
        }
    }
    let api_stop = Arc::new(AtomicBool::new(false));
    let serving = options.api.is_some();
    if let Some(socket) = options.api {
        let controller = LinuxController::new(
            Arc::clone(linux.memory()),
            Arc::clone(linux.machine()),
            running.handles(),
            options.paused,
            Arc::clone(&api_stop),
        )
        .with_loader(linux.loader().cloned());
        run.serve(socket, controller, DEFAULT_IDLE_TIMEOUT);
    }

    let deadline = options
        .timeout_secs
        .map(|t| Instant::now() + Duration::from_secs_f64(t));
    // A caller's or a client's stop request is polled.
    let most = if options.stop.is_some() || serving {
        20
    } else {
        1000
    };
    let wait_ms = || {
        let wait = match deadline {
            Some(d) => d.saturating_duration_since(Instant::now()),
            None => Duration::from_secs(1),
        };
        wait.as_millis().clamp(1, most) as i32
    };
    let ending = run.run(wait_ms, |controller| {
        if reset_seen.load(Ordering::Acquire) {
            return Some(BootEnding::Reset);
        }
        if api_stop.load(Ordering::Acquire)
            || options
                .stop
                .as_ref()
                .is_some_and(|s| s.load(Ordering::Acquire))
        {
            return Some(BootEnding::Stopped);
        }
        if controller.is_some_and(|c| c.migrated()) {
            return Some(BootEnding::Migrated);
        }
        if let Some(ending) = running.ended() {
            return Some(ending);
        }
        deadline
            .is_some_and(|d| Instant::now() >= d)
            .then_some(BootEnding::Timeout)
    });
    run.with_controller(|controller| {
        if let Some(info) = controller
            .migration_info()
            .filter(|_| controller.migrated())
        {
            log(LogLevel::Info, info.completed_line());
        }
        controller.shut_down();
    });
    running.stop();
    linux.flush_console();
    drop(terminal);
    Ok(ending.unwrap_or(BootEnding::Interrupted))
}

/// `tinyvmm boot`'s arguments: a JSON boot configuration and options over it.
#[derive(Debug, clap::Args)]
pub struct BootArgs {
    /// A JSON boot configuration (fields as the options below, `_` for `-`, except
    /// `mem_slots` for --slots, `timeout_secs` for --timeout and `acpi: false` for --no-acpi;
    /// unknown fields are refused). Options given with it override the file's fields.
    #[arg(long)]
    config: Option<PathBuf>,
    /// The kernel: a bzImage, or an ELF vmlinux (PVH entry when it has the note).
    #[arg(long, required_unless_present = "config")]
    kernel: Option<PathBuf>,
    /// An initramfs.
    #[arg(long)]
    initramfs: Option<PathBuf>,
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
    protocol: Option<BootProtocol>,
    /// Do not print the e820 map and the command line the VMM built (on stderr).
    #[arg(long)]
    quiet: bool,
    /// MiB of hotpluggable memory behind a virtio-mem device above RAM, a multiple of the block
    /// size up to 1 TiB (none plugged at boot; `PATCH /hotplug/memory` on --api-sock asks the
    /// guest to plug) [default: 0, no device]
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
    api_sock: Option<PathBuf>,
    /// Put RAM in memfds (shared memory): a local migration hands it over instead of copying.
    #[arg(long)]
    memfd: bool,
    /// The host pages behind RAM: 4k, 2m (hugetlb; with --memfd an MFD_HUGETLB memfd: RAM and
    /// each slot a multiple of 2 MiB, the pool holding all of RAM) or thp [default: 4k]
    #[arg(long, value_enum)]
    page_size: Option<RegionPageSize>,
    /// The host pages behind the virtio-mem device's plugged blocks: 4k, 2m (the pool must
    /// hold a piece when the guest plugs into it) or thp [default: 4k]
    #[arg(long, value_enum)]
    hotplug_page_size: Option<RegionPageSize>,
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
    /// The memory limits of the VM.
    #[command(flatten)]
    limits: LimitArgs,
}

impl BootArgs {
    /// The boot configuration: the file's (or the defaults), with the options given over it.
    fn config(self) -> Result<BootConfig, ConfigError> {
        let mut config = match &self.config {
            Some(path) => BootConfig::from_file(path)?,
            None => BootConfig::default(),
        };
        if let Some(kernel) = self.kernel {
            config.kernel = kernel;
        }
        config.initramfs = self.initramfs.or(config.initramfs);
        if let Some(cmdline) = self.cmdline {
            config.cmdline = cmdline;
        }
        config.vcpus = self.vcpus.unwrap_or(config.vcpus);
        config.mem_mib = self.mem_mib.unwrap_or(config.mem_mib);
        config.mem_slots = self.mem_slots.unwrap_or(config.mem_slots);
        config.mem_holes |= self.mem_holes;
        config.timeout_secs = self.timeout.or(config.timeout_secs);
        config.protocol = self.protocol.unwrap_or(config.protocol);
        config.hotplug_mib = self.hotplug_mib.unwrap_or(config.hotplug_mib);
        config.hotplug_block_mib = self.hotplug_block_mib.unwrap_or(config.hotplug_block_mib);
        config.hotplug_max_slot_mib = self
            .hotplug_max_slot_mib
            .unwrap_or(config.hotplug_max_slot_mib);
        config.api_sock = self.api_sock.or(config.api_sock);
        config.acpi &= !self.no_acpi;
        config.memfd |= self.memfd;
        config.page_size = self.page_size.unwrap_or(config.page_size);
        config.hotplug_page_size = self.hotplug_page_size.unwrap_or(config.hotplug_page_size);
        config.dirty_ring = self.dirty_ring.or(config.dirty_ring);
        config.limits = Some(self.limits.resolve());
        Ok(config)
    }

    /// Runs `tinyvmm boot`: the console on stdout (with `--json`, on stderr, and how the run
    /// ended as JSON on stdout); gives the exit status of how the guest's run ended.
    pub fn run(self) -> ExitCode {
        let (json, quiet) = (self.json, self.quiet);
        crate::api::server::log_requests(self.log_requests);
        let config = match self.config() {
            Ok(config) => config,
            Err(e) => {
                eprintln!("tinyvmm: {e}");
                return ExitCode::FAILURE;
            }
        };
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
        let started = Instant::now();
        match boot(&config, console, |report| {
            if !quiet && crate::lifecycle::logs(LogLevel::Info) {
                eprint!("{}", describe(report));
            }
        }) {
            Ok(report) => {
                let code = linux_ended(&report.ending);
                if json {
                    let ms = |d: Duration| d.as_secs_f64() * 1e3;
                    print_json(
                        report.ending.exit_code() == 0,
                        serde_json::json!({
                            "ending": report.ending.to_string(),
                            "exit_status": report.ending.exit_code(),
                            "kernel_format": match report.format {
                                KernelFormat::BzImage => "bzimage",
                                KernelFormat::Elf => "elf",
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
}

/// Says how a Linux guest's run ended (a failure at every log level, a clean end at info)
/// and gives its exit status.
pub(super) fn linux_ended(ending: &BootEnding) -> ExitCode {
    let code = ending.exit_code();
    let level = if code == 0 {
        LogLevel::Info
    } else {
        LogLevel::Error
    };
    log(level, ending);
    ExitCode::from(code)
}
