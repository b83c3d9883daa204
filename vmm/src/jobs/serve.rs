//! `tinyvmm serve`: the test guest with an API socket. The job builds the VM (the system
//! region, the initial memory, the vCPUs) as the other jobs do, or restores one
//! ([`super::restore`]), hands it to the controller, and serves the socket on the run loop
//! (`RunLoop`) until a client stops the VMM, the VM migrates away, or a signal comes.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use super::args::{slot_count, test_guest_vcpus, ApiArgs, UsageError};
use super::boot::linux_ended;
use super::restore::{restore_linux, restored_controller, RestoreArgs, RestoreError, RestoreFrom};
use super::run_loop::RunLoop;
use super::working_set::WorkingSetFiles;
use crate::api::server::{ApiSocket, SocketError, DEFAULT_IDLE_TIMEOUT};
use crate::control::memory::RegionPageSize;
use crate::lifecycle::{log, Ending, LogLevel, LoopError};
use crate::snapshot::StateFile;
use crate::test_guest::area::{AreaError, TestArea, AREA_GPA};
use crate::test_guest::controller::Controller;
use crate::test_guest::vcpus::{GuestError, TestVm};
use crate::vm::VmOptions;
use kvm_memslots::{MemoryLimits, PageSize};
use vmm_sys_util::eventfd::EventFd;

/// Why serving could not start or ended badly.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// The API socket could not be created.
    #[error(transparent)]
    Socket(#[from] SocketError),
    /// The VM failed.
    #[error(transparent)]
    Vm(#[from] GuestError),
    /// The initial memory could not be added.
    #[error(transparent)]
    Area(#[from] AreaError),
    /// The event loop failed.
    #[error(transparent)]
    Loop(#[from] LoopError),
    /// The VM to serve could not be restored from its snapshot.
    #[error(transparent)]
    Restore(#[from] RestoreError),
}

/// What `tinyvmm serve` starts with.
#[derive(Debug, Clone)]
pub struct ServeConfig {
    /// Where the API socket goes.
    pub api_sock: PathBuf,
    /// KVM slots at start (the system region's and the initial memory's).
    pub slots: usize,
    /// Bytes of initial memory at 256 MiB, split over `slots - 1` slots (0: none).
    pub area_size: u64,
    /// vCPUs of the test guest.
    pub vcpus: usize,
    /// How long a client connection may send nothing before it is answered 408 and closed.
    pub idle_timeout: Duration,
    /// What guest memory is admitted against; `None`: this host's defaults
    /// ([`MemoryLimits::for_this_host`]).
    pub limits: Option<MemoryLimits>,
    /// Harvest from per-vCPU dirty rings of this many entries instead of per-slot bitmaps.
    pub dirty_ring: Option<u32>,
    /// The initial memory in a memfd (shared, so a local migration can hand it over) rather
    /// than anonymous memory.
    pub memfd: bool,
    /// The host pages behind the initial memory: with 2 MiB pages its size and slot size must
    /// be multiples of 2 MiB and the hugetlb pool must hold it (a memfd is then
    /// `MFD_HUGETLB`).
    pub page_size: PageSize,
    /// Serve a VM restored from this snapshot (paused) instead of a new one.
    pub restore: Option<RestoreFrom>,
}

impl ServeConfig {
    /// Serves on `api_sock` with the defaults of `tinyvmm serve`: 2 slots, 256 MiB of initial
    /// memory, 1 vCPU, the default idle timeout.
    pub fn new(api_sock: PathBuf) -> Self {
        ServeConfig {
            api_sock,
            slots: 2,
            area_size: 256 << 20,
            vcpus: 1,
            idle_timeout: DEFAULT_IDLE_TIMEOUT,
            limits: None,
            dirty_ring: None,
            memfd: false,
            page_size: PageSize::Base,
            restore: None,
        }
    }
}

/// Runs a test-guest VM with an API socket until a client stops it ([`Ending::Finished`]) or
/// SIGINT/SIGTERM comes ([`Ending::Interrupted`]), either after the guest failed
/// ([`Ending::GuestFailed`]); removes the socket at the end.
pub fn serve(config: &ServeConfig, ready: impl FnOnce()) -> Result<Ending, ServeError> {
    serve_read(config, None, ready)
}

/// [`serve`], the state file of `config.restore` given as `read` where it was read already
/// (`tinyvmm restore` reads it to tell the guest kind): the file is read once.
fn serve_read(
    config: &ServeConfig,
    read: Option<&StateFile>,
    ready: impl FnOnce(),
) -> Result<Ending, ServeError> {
    // The loop (and with it the signal handler) before the socket: a client that finds the
    // socket may signal the VMM at once, while it still starts.
    let run = RunLoop::new()?;
    let socket = ApiSocket::bind(&config.api_sock)?;
    let options = VmOptions {
        limits: config.limits,
        dirty_ring: config.dirty_ring,
        ..VmOptions::default()
    };
    let stopped = &run.context().vcpu_stopped;
    let controller = match start_controller(config, read, options, stopped) {
        Ok(controller) => controller,
        // A signal during start-up (the wait for the vCPUs' first report gives up on it) ends
        // the VMM as a signal does once it serves.
        Err(ServeError::Vm(GuestError::Interrupted)) => return Ok(Ending::Interrupted),
        Err(e) => return Err(e),
    };
    serve_controller(run, socket, controller, config.idle_timeout, ready)
}

/// The test guest `config` asks for, its vCPUs started (or restored, from the state file
/// `read` if read already): what [`serve`] serves.
fn start_controller(
    config: &ServeConfig,
    read: Option<&StateFile>,
    options: VmOptions,
    stopped: &Arc<EventFd>,
) -> Result<Controller, ServeError> {
    Ok(match &config.restore {
        None => {
            let vm = TestVm::with_options(options)?;
            if config.area_size > 0 && config.slots > 1 {
                let backing = if config.memfd {
                    kvm_memslots::Backing::Memfd
                } else {
                    kvm_memslots::Backing::Anonymous
                };
                // The layout asked for, exactly with 2 MiB pages (not trimmed to fit).
                TestArea::check_layout(
                    config.area_size,
                    config.slots as u64 - 1,
                    config.page_size,
                )?;
                TestArea::add_paged(
                    vm.memory(),
                    AREA_GPA,
                    config.area_size,
                    config.slots as u64 - 1,
                    backing,
                    config.page_size,
                )?;
            }
            let vcpus = vm.start_vcpus(config.vcpus, stopped)?;
            Controller::new(vm, vcpus)
        }
        Some(from) => restored_controller(from, read, options, stopped)?,
    })
}

/// Runs [`serve`] on a thread of its own and returns that thread once the socket is ready, or
/// the error that kept the VMM from starting.
pub fn serve_in_background(
    config: ServeConfig,
) -> Result<std::thread::JoinHandle<Result<Ending, ServeError>>, ServeError> {
    in_background(move |ready| serve(&config, ready))
}

/// Runs `job` on a thread of its own and returns that thread once the job calls the `ready` it
/// is given, or the error it ended with before (a job that says it is ready before it can
/// end cleanly: `serve`, `receive`).
pub(crate) fn in_background<T: Send + 'static, E: Send + 'static>(
    job: impl FnOnce(Box<dyn FnOnce() + Send>) -> Result<T, E> + Send + 'static,
) -> Result<std::thread::JoinHandle<Result<T, E>>, E> {
    let (ready, is_ready) = std::sync::mpsc::channel();
    let thread = std::thread::spawn(move || {
        job(Box::new(move || {
            // The caller may have stopped waiting; the job goes on regardless.
            let _ = ready.send(());
        }))
    });
    if is_ready.recv().is_ok() {
        return Ok(thread);
    }
    // The job ended before it was ready: it failed (it ends cleanly only later, on a client's
    // request), or panicked.
    match thread.join() {
        Ok(Err(e)) => Err(e),
        Ok(Ok(_)) => unreachable!("the job says it is ready before it can end cleanly"),
        Err(panic) => std::panic::resume_unwind(panic),
    }
}

/// How long the end of a run waits for the guest's commands under way to report where they
/// were cut short (the guest looks for a cancel every 64 addresses: it takes milliseconds).
const CUT_SHORT_WAIT: Duration = Duration::from_secs(2);

/// Serves `controller` on `socket` from `run` until a client stops the VMM, the VM migrates
/// away, or a signal comes; then answers the requests waiting for the guest (their commands
/// cut short) and stops the vCPUs.
pub(crate) fn serve_controller(
    mut run: RunLoop<Controller>,
    socket: ApiSocket,
    controller: Controller,
    idle_timeout: Duration,
    ready: impl FnOnce(),
) -> Result<Ending, ServeError> {
    run.serve(socket, controller, idle_timeout);
    ready();
    // A short wait: a migration that completes ends the VMM without any event here.
    let ending = run
        .run(
            || 50,
            |controller| {
                controller
                    .is_some_and(|c| c.stop_requested())
                    .then_some(Ending::Finished)
            },
        )
        .unwrap_or(Ending::Interrupted);
    run.finish_deferred(CUT_SHORT_WAIT);
    let failed = run
        .with_controller(|controller| controller.failure().is_some())
        .unwrap_or(false);
    let shut_down = run.with_controller(|controller| {
        if let Some(info) = controller
            .migration_info()
            .filter(|_| controller.migrated())
        {
            log(LogLevel::Info, info.completed_line());
        }
        controller.shut_down()
    });
    if failed {
        // Said on stderr when it happened; the vCPUs' error at shutdown is the same failure.
        return Ok(Ending::GuestFailed);
    }
    shut_down.unwrap_or(Ok(()))?;
    Ok(ending)
}

/// `tinyvmm serve`'s arguments: the test guest it starts, and its API socket.
#[derive(Debug, clap::Args)]
pub struct ServeArgs {
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
    page_size: RegionPageSize,
    /// The API socket and the VM's limits and dirty-log mode.
    #[command(flatten)]
    api: ApiArgs,
}

impl ServeArgs {
    /// Runs `tinyvmm serve`: refuses a shape of initial memory that cannot be laid out (a
    /// usage error, before anything starts), else serves until the VMM is stopped.
    pub fn run(self) -> Result<ExitCode, UsageError> {
        let usage = |message: String| UsageError {
            subcommand: Some("serve"),
            kind: clap::error::ErrorKind::ValueValidation,
            message,
        };
        if self.slots < 2 && self.mem_mib > 0 {
            return Err(usage(format!(
                "--slots {} leaves no slot for --mem-mib {}: give 2 slots or more, or --mem-mib 0",
                self.slots, self.mem_mib
            )));
        }
        if self.mem_mib > 0 {
            let size = self.mem_mib.saturating_mul(1 << 20);
            let page_size = PageSize::from(self.page_size);
            if let Err(e) = TestArea::check_layout(size, self.slots as u64 - 1, page_size) {
                return Err(usage(format!(
                    "--page-size {} with --mem-mib {} over {} slots: {e}",
                    page_size.name(),
                    self.mem_mib,
                    self.slots - 1
                )));
            }
        }
        Ok(self.serve(None, None))
    }

    /// Serves this test guest, or the one restored from `restore` (its state file `read`
    /// already, if given), until the VMM is stopped; gives the exit status ([`served`]).
    pub(super) fn serve(self, restore: Option<RestoreFrom>, read: Option<&StateFile>) -> ExitCode {
        crate::api::server::log_requests(self.api.log_requests);
        let config = ServeConfig {
            api_sock: self.api.api_sock,
            slots: self.slots,
            area_size: self.mem_mib.saturating_mul(1 << 20),
            vcpus: self.vcpus,
            idle_timeout: self.api.idle_timeout,
            limits: Some(self.api.limits.resolve()),
            dirty_ring: self.api.dirty_ring,
            memfd: self.memfd,
            page_size: self.page_size.into(),
            restore,
        };
        let path = config.api_sock.display().to_string();
        served(serve_read(&config, read, || {
            log(LogLevel::Info, format_args!("serving the API on {path}"))
        }))
    }
}

/// The exit status of a VMM that served a VM: 0 when a client stopped it (or it migrated
/// away), 130 on a signal, 4 when stopped either way after its guest failed, 1 on a failure
/// (named on stderr).
pub(super) fn served(outcome: Result<Ending, impl std::fmt::Display>) -> ExitCode {
    use crate::control::vm::FAILED_EXIT_STATUS;
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
            if crate::lifecycle::termination_signal().load(std::sync::atomic::Ordering::Acquire) {
                ExitCode::from(130)
            } else {
                ExitCode::FAILURE
            }
        }
    }
}

/// Runs `tinyvmm restore`: a test guest served as `serve` serves one, a Linux guest run as
/// `boot` runs one; gives the exit status.
pub fn restore(args: RestoreArgs) -> ExitCode {
    use crate::snapshot::GuestKind;
    let from = RestoreFrom {
        snapshot: args.snapshot,
        mem_file: args.mem_file,
        backend: args.mem_backend,
        working_set: WorkingSetFiles {
            prefetch: args.prefetch,
            record: args.record_working_set,
            record_for: args.record_secs,
        },
        page_size: args.page_size.map(Into::into),
    };
    // Read once: the guest kind told from the bytes, then the kind's state read from them.
    let read = match StateFile::read(&from.snapshot) {
        Ok(read) => read,
        Err(e) => {
            return served(Err::<Ending, _>(RestoreError::File {
                path: from.snapshot,
                reason: e.to_string(),
            }))
        }
    };
    // A file that is neither kind's is refused by the test guest's reader, which says why.
    if !matches!(read.kind(), Ok(GuestKind::Linux)) {
        // The restored VM's memory and vCPUs are the snapshot's: serve's own shape is unused.
        let serve = ServeArgs {
            api: args.api,
            slots: 2,
            mem_mib: 0,
            vcpus: 1,
            memfd: false,
            page_size: Default::default(),
        };
        return serve.serve(Some(from), Some(&read));
    }
    let limits = Some(args.api.limits.resolve());
    match restore_linux(
        &from,
        &read,
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
