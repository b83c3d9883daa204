//! `tinyvmm boot`: a Linux guest ([`LinuxVm`]) run under the run loop ([`RunLoop`]) with its
//! console and, with `--api-sock`, its API socket, until it resets, a vCPU stops, a client or
//! the caller stops it, a signal comes or the timeout.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::run_loop::RunLoop;
use crate::api::server::{ApiSocket, SocketError, DEFAULT_IDLE_TIMEOUT};
use crate::host::RawTerminal;
use crate::lifecycle::{log, LogLevel, LoopError};
use crate::linux::controller::LinuxController;
use crate::linux::{BootConfig, BootEnding, BootError, BootReport, Console, LinuxVcpus, LinuxVm};

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
        path: std::path::PathBuf,
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
pub struct LinuxRun {
    /// The API socket to serve, bound.
    pub api: Option<ApiSocket>,
    /// Stop the VM after this many seconds.
    pub timeout_secs: Option<f64>,
    /// Read console input from stdin (a terminal).
    pub stdin: bool,
    /// Set by the caller to stop the VM.
    pub stop: Option<Arc<AtomicBool>>,
    /// The vCPUs start paused: a client resumes them (`PATCH /vm`).
    pub paused: bool,
}

/// Runs `linux` on `vcpus` under the run loop, with its console and API socket, until it
/// resets, a vCPU stops, a client or the caller stops it, it migrates away, a signal comes or
/// the timeout; returns how it ended.
pub fn run_linux(
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
