//! `tinyvmm boot`: a Linux guest ([`LinuxVm`]) run under the run loop ([`RunLoop`]) with its
//! console and, with `--api-sock`, its API socket, until it resets, a vCPU stops, a client or
//! the caller stops it, a signal comes or the timeout.

use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::run_loop::RunLoop;
use crate::api::server::{ApiSocket, SocketError, DEFAULT_IDLE_TIMEOUT};
use crate::lifecycle::LoopError;
use crate::linux::console::RawTerminal;
use crate::linux::controller::LinuxController;
use crate::linux::{BootConfig, BootEnding, BootError, BootReport, Console, LinuxVm};

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
}

/// Boots `config`'s kernel and runs it until it resets, a vCPU stops, a signal or the timeout.
/// `on_start` sees the report (ending aside) just before the vCPUs start.
pub fn boot(
    config: &BootConfig,
    console: Console,
    on_start: impl FnOnce(&BootReport),
) -> Result<BootReport, BootJobError> {
    let started = Instant::now();
    let Console {
        output,
        stdin,
        stop: stop_request,
    } = console;
    let (linux, mut report) = LinuxVm::new(config, output)?;

    let mut run = RunLoop::new()?;
    let terminal = if stdin {
        RawTerminal::new(std::io::stdin().as_raw_fd())
    } else {
        None
    };
    let reset_seen = Arc::new(AtomicBool::new(false));
    let input = terminal.as_ref().map(|_| std::io::stdin().as_raw_fd());
    run.add(Arc::new(Mutex::new(
        linux.console(Arc::clone(&reset_seen), input)?,
    )));
    let api_stop = Arc::new(AtomicBool::new(false));
    if let Some(path) = &config.api_sock {
        let socket = ApiSocket::bind(path)?;
        let controller = LinuxController::new(
            Arc::clone(linux.memory()),
            linux.hotplug_device(),
            Arc::clone(&api_stop),
        );
        run.serve(socket, controller, DEFAULT_IDLE_TIMEOUT);
    }
    let vcpus = linux.create_vcpus(config)?;
    report.setup_time = started.elapsed();
    on_start(&report);
    let mut running = vcpus.start(&run.context().vcpu_stopped)?;

    let deadline = config
        .timeout_secs
        .map(|t| Instant::now() + Duration::from_secs_f64(t));
    // A caller's or a client's stop request is polled.
    let most = if stop_request.is_some() || config.api_sock.is_some() {
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
    let ending = run.run(wait_ms, |_| {
        if reset_seen.load(Ordering::Acquire) {
            return Some(BootEnding::Reset);
        }
        if api_stop.load(Ordering::Acquire)
            || stop_request
                .as_ref()
                .is_some_and(|s| s.load(Ordering::Acquire))
        {
            return Some(BootEnding::Stopped);
        }
        if let Some(ending) = running.ended() {
            return Some(ending);
        }
        deadline
            .is_some_and(|d| Instant::now() >= d)
            .then_some(BootEnding::Timeout)
    });
    running.stop();
    linux.flush_console();
    drop(terminal);
    report.ending = ending.unwrap_or(BootEnding::Interrupted);
    Ok(report)
}
