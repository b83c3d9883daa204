//! `tinyvmm serve`: the test guest with an API socket. The job builds the VM (the system
//! region, the initial memory, the vCPUs) as the other jobs do, hands it to the controller, and
//! serves the socket on the event loop until a client stops the VMM or a signal comes.

use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::api::server::{bind_api_socket, ApiServer, SocketError, DEFAULT_IDLE_TIMEOUT};
use crate::lifecycle::{Ending, EventLoop, LoopError};
use crate::test_guest::area::{AreaError, TestArea, AREA_GPA};
use crate::test_guest::controller::Controller;
use crate::test_guest::snapshot::SnapshotState;
use crate::test_guest::vcpus::{GuestError, MemBackend, TestVm};
use crate::vm::VmOptions;
use kvm_memslots::MemoryLimits;

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
    /// A snapshot file could not be read or is not valid.
    #[error("cannot restore from {path}: {reason}")]
    Restore {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
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
    /// What guest memory is admitted against; `None`: the process's ([`crate::vm::memory_limits`]).
    pub limits: Option<MemoryLimits>,
    /// Harvest from per-vCPU dirty rings of this many entries instead of per-slot bitmaps.
    pub dirty_ring: Option<u32>,
    /// The initial memory in a memfd (shared, so a local migration can hand it over) rather
    /// than anonymous memory.
    pub memfd: bool,
    /// Serve a VM restored from this snapshot (paused) instead of a new one.
    pub restore: Option<RestoreFrom>,
}

/// The files of a snapshot to restore from.
#[derive(Debug, Clone)]
pub struct RestoreFrom {
    /// The state file (`snapshot_path` of `PUT /snapshot/create`).
    pub snapshot: PathBuf,
    /// The memory file (`mem_file_path`; with Diff snapshots, merged onto the Full first).
    pub mem_file: PathBuf,
    /// How memory comes from the memory file.
    pub backend: MemBackend,
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
            restore: None,
        }
    }
}

/// Runs a test-guest VM with an API socket until a client stops it ([`Ending::Finished`]) or
/// SIGINT/SIGTERM comes ([`Ending::Interrupted`]); removes the socket at the end.
pub fn serve(config: &ServeConfig, ready: impl FnOnce()) -> Result<Ending, ServeError> {
    let listener = bind_api_socket(&config.api_sock)?;
    let result = serve_on(listener, config, ready);
    let _ = std::fs::remove_file(&config.api_sock);
    result
}

/// Runs [`serve`] on a thread of its own and returns that thread once the socket is ready, or
/// the error that kept the VMM from starting.
pub fn serve_in_background(
    config: ServeConfig,
) -> Result<std::thread::JoinHandle<Result<Ending, ServeError>>, ServeError> {
    let (ready, is_ready) = std::sync::mpsc::channel();
    let thread = std::thread::spawn(move || {
        serve(&config, move || {
            // The caller may have stopped waiting; serving goes on regardless.
            let _ = ready.send(());
        })
    });
    if is_ready.recv().is_ok() {
        return Ok(thread);
    }
    // `serve` ended before the socket was ready: it failed (it ends cleanly only on a Stop,
    // which needs a client), or panicked.
    match thread.join() {
        Ok(Err(e)) => Err(e),
        Ok(Ok(_)) => unreachable!("serve says it is ready before it can stop cleanly"),
        Err(panic) => std::panic::resume_unwind(panic),
    }
}

fn serve_on(
    listener: UnixListener,
    config: &ServeConfig,
    ready: impl FnOnce(),
) -> Result<Ending, ServeError> {
    let event_loop = EventLoop::new()?;
    let options = VmOptions {
        limits: config.limits,
        dirty_ring: config.dirty_ring,
        ..VmOptions::default()
    };
    let stopped = &event_loop.context().vcpu_stopped;
    let controller = match &config.restore {
        None => {
            let vm = TestVm::with_options(options)?;
            if config.area_size > 0 && config.slots > 1 {
                let backing = if config.memfd {
                    kvm_memslots::Backing::Memfd
                } else {
                    kvm_memslots::Backing::Anonymous
                };
                TestArea::add_backed(
                    vm.memory(),
                    AREA_GPA,
                    config.area_size,
                    config.slots as u64 - 1,
                    backing,
                )?;
            }
            let vcpus = vm.start_vcpus(config.vcpus, stopped)?;
            Controller::new(vm, vcpus)
        }
        Some(from) => {
            // Nothing runs until every byte is loaded and every vCPU has its state.
            let read = |path: &PathBuf| {
                std::fs::read(path).map_err(|source| ServeError::Restore {
                    path: path.clone(),
                    reason: source.to_string(),
                })
            };
            let state = SnapshotState::from_bytes(&read(&from.snapshot)?).map_err(|e| {
                ServeError::Restore {
                    path: from.snapshot.clone(),
                    reason: e.to_string(),
                }
            })?;
            let mem_file =
                std::fs::File::open(&from.mem_file).map_err(|source| ServeError::Restore {
                    path: from.mem_file.clone(),
                    reason: source.to_string(),
                })?;
            let vm = TestVm::restore(&state.layout, &mem_file, from.backend, options)?;
            let vcpus = vm.start_restored_vcpus(&state.vcpus, stopped)?;
            Controller::new(vm, vcpus)
                .paused()
                .with_hotplug(state.hotplug.as_ref())
                .map_err(|e| ServeError::Restore {
                    path: from.snapshot.clone(),
                    reason: e.to_string(),
                })?
        }
    };
    serve_controller(event_loop, listener, controller, config.idle_timeout, ready)
}

/// Serves `controller` on `listener` from `event_loop` until a client stops the VMM, the VM
/// migrates away, or a signal comes; then stops the vCPUs.
pub(crate) fn serve_controller(
    mut event_loop: EventLoop,
    listener: UnixListener,
    controller: Controller,
    idle_timeout: Duration,
    ready: impl FnOnce(),
) -> Result<Ending, ServeError> {
    let server = Arc::new(Mutex::new(
        ApiServer::new(listener, controller).with_idle_timeout(idle_timeout),
    ));
    event_loop.add(server.clone());
    let stop = Arc::clone(&event_loop.context().stop);
    ready();
    let ending = loop {
        // A short wait: a migration that completes ends the VMM without any event here.
        if event_loop.dispatch(50) == Some(Ending::Interrupted) || stop.load(Ordering::Acquire) {
            break Ending::Interrupted;
        }
        let asked = server
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .controller_mut()
            .stop_requested();
        if asked {
            break Ending::Finished;
        }
    };
    let mut server = server.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(info) = server
        .controller_mut()
        .migration_info()
        .filter(|_| server.controller_mut().migrated())
    {
        eprintln!(
            "tinyvmm: the VM runs on the migration's destination now: {} rounds, {} bytes sent in \
             {:.0} ms, paused {:.1} ms",
            info.round,
            info.bytes_sent,
            info.elapsed_ms,
            info.downtime_ms.unwrap_or(f64::NAN)
        );
    }
    server.controller_mut().shut_down()?;
    Ok(ending)
}
