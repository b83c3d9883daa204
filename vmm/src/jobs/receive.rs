//! `tinyvmm receive`: the destination of a migration. It listens for one source, builds the
//! VM the source's layout describes (or refuses it, saying why, before any memory moves),
//! applies every round of pages, restores the vCPUs from the state record, lets the guest run
//! on where it was paused, tells the source, and then serves the VM on its API socket (the
//! API socket is bound first, so nothing can fail between the source's hand-over and serving;
//! until the VM runs, it answers for a destination with no VM). The State record says the guest kind: a test guest is
//! served as `serve` serves one, a Linux guest runs as `boot` runs one (the in-kernel irqchip
//! is added once that is known: no vCPU exists before), its console on stdout. Before either,
//! once the last page landed, the memory is checked against the source's digest of what it sent
//! (`StreamReader::verify`, from guest memory): a difference is refused, naming the first region
//! that differs. If anything
//! fails before the guest runs here, nothing runs here: what came is dropped, the source is
//! told why where it still listens, and the process exits with 1.
//!
//! Until the VM runs here the API socket is answered by a thread of its own (`WaitingApi`):
//! `GET /`, `GET /metrics` and `GET /vm` (state `Waiting`, then `Receiving` once a source
//! connected) are answered, anything else is a 409 saying why. It stops when the VM runs here,
//! before the source is told so, and the VM's own server takes the socket over: connections
//! open to the waiting server are closed then (a client connects again), requests waiting in the
//! socket's backlog are served by the VM's.

use std::collections::HashMap;
use std::io::BufReader;
use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use event_manager::{EventManager, EventOps, EventSet, Events, MutEventSubscriber, SubscriberOps};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use kvm_memslots::{KvmVm, MemoryLimits, MemoryManager};
use kvm_memslots_persist::stream::{apply_pages, check_layout, send_answer, Record, StreamReader};
use kvm_memslots_persist::{LayoutBacking, RegionLayout};
use vm_memory::FileOffset;

use super::args::ApiArgs;
use super::boot::{linux_ended, run_linux, BootJobError, LinuxRun};
use super::run_loop::RunLoop;
use super::serve::{in_background, serve_controller, served, ServeError};
use crate::api::server::{ApiServer, ApiSocket, SocketError};
use crate::control::vm::{RunState, VmInfo};
use crate::control::{Apply, ControllerError, Outcome, Reply, Request};
use crate::lifecycle::{log, termination_signal, Ending, LogLevel};
use crate::linux::state::LinuxState;
use crate::linux::{BootEnding, LinuxVcpus, LinuxVm};
use crate::migration::transport::{file_kind, Limits, Watch};
use crate::migration::{Connection, Endpoint};
use crate::snapshot::GuestKind;
use crate::test_guest::controller::Controller;
use crate::test_guest::snapshot::SnapshotState;
use crate::test_guest::vcpus::TestVm;
use crate::vm::{Vm, VmOptions};

/// How long the source may send nothing before the destination gives up.
const STALL: Duration = Duration::from_secs(60);

/// What `tinyvmm receive` starts with.
#[derive(Debug, Clone)]
pub struct ReceiveConfig {
    /// Where to listen for the source.
    pub listen: Endpoint,
    /// Where the API socket goes once the VM runs here.
    pub api_sock: PathBuf,
    /// The API's idle timeout.
    pub idle_timeout: Duration,
    /// What guest memory is admitted against; `None`: this host's defaults
    /// ([`MemoryLimits::for_this_host`]).
    pub limits: Option<MemoryLimits>,
    /// Harvest from dirty rings of this many entries (for a later migration onwards).
    pub dirty_ring: Option<u32>,
    /// For tests: runs on the received memory once the last page landed, before it is
    /// checked against the source's digest (to change or drop a page there). `None` in the
    /// CLI.
    pub after_landing: Option<fn(&MemoryManager<KvmVm>)>,
}

impl ReceiveConfig {
    /// Listens on `listen` and answers on `api_sock` with the defaults of `tinyvmm receive`:
    /// the default idle timeout, this host's limits, dirty bitmaps.
    pub fn new(listen: Endpoint, api_sock: PathBuf) -> Self {
        ReceiveConfig {
            listen,
            api_sock,
            idle_timeout: crate::api::server::DEFAULT_IDLE_TIMEOUT,
            limits: None,
            dirty_ring: None,
            after_landing: None,
        }
    }
}

/// Why receiving failed.
#[derive(Debug, thiserror::Error)]
pub enum ReceiveError {
    /// Listening or accepting failed.
    #[error("cannot listen on {endpoint}: {source}")]
    Listen {
        /// Where.
        endpoint: String,
        /// The system's error.
        source: std::io::Error,
    },
    /// The migration failed before the VM ran here; nothing runs.
    #[error("the migration failed: {0}; nothing runs here")]
    Migration(String),
    /// Serving the VM failed.
    #[error(transparent)]
    Serve(#[from] ServeError),
    /// Running the Linux guest failed.
    #[error(transparent)]
    Linux(#[from] BootJobError),
}

/// How a received VM's run ended.
#[derive(Debug)]
pub enum ReceiveEnding {
    /// A test guest served until a client stopped it, it migrated on, or a signal.
    TestGuest(Ending),
    /// A Linux guest's run ended as a boot's does.
    Linux(BootEnding),
}

/// The VM received, ready to run.
enum ReceivedVm {
    /// A test guest, its vCPUs running (or paused as the source had them).
    TestGuest(Box<Controller>),
    /// A Linux guest, its vCPUs made paused; `paused`: a client had paused it on the source.
    Linux {
        linux: LinuxVm,
        vcpus: LinuxVcpus,
        paused: bool,
    },
}

/// What a completed receive did.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Received {
    /// Rounds of pages.
    rounds: u32,
    /// Bytes of pages applied.
    bytes: u64,
    /// How long checking the memory against the source's digest took.
    check: Duration,
    /// From the first byte to the guest running here.
    elapsed: Duration,
}

/// Receives one VM and serves it until a client stops it or a signal comes. `ready` is
/// called once listening; `received` once the VM runs here.
fn receive(
    config: &ReceiveConfig,
    ready: impl FnOnce(),
    received: impl FnOnce(Received),
) -> Result<ReceiveEnding, ReceiveError> {
    // The API socket before the VM: once the source has handed the VM over, nothing may fail
    // before it is served. Until the VM runs here, a thread answers it for the destination.
    // The loop (and with it the signal handler) before the socket: a client that finds the
    // socket may signal the VMM at once.
    let run = RunLoop::new().map_err(ServeError::from)?;
    let api = ApiSocket::bind(&config.api_sock).map_err(ServeError::from)?;
    let listen_failed = |source| ReceiveError::Listen {
        endpoint: config.listen.to_string(),
        source,
    };
    let listener = config.listen.listen().map_err(listen_failed)?;
    let waiting = WaitingApi::start(
        &api.listener,
        Waiting::new(config.listen.to_string()),
        config.idle_timeout,
    )
    .map_err(|source| {
        ServeError::from(SocketError::Socket {
            path: config.api_sock.clone(),
            source,
        })
    })?;
    ready();
    // A source may come whenever it likes; once it is here, every wait on it ends after
    // `STALL` of silence, or on a signal.
    let watch = Watch::new(
        termination_signal(),
        None,
        "the source's next record",
        Limits {
            deadline: None,
            stall: STALL,
        },
    );
    let Some(mut connection) = listener.accept(watch).map_err(listen_failed)? else {
        return Ok(ReceiveEnding::TestGuest(Ending::Interrupted));
    };
    drop(listener);
    waiting.receiving.store(true, Ordering::Release);
    log(
        LogLevel::Info,
        format_args!("a source connected on {}: receiving the VM", config.listen),
    );
    let stopped = &run.context().vcpu_stopped;
    let (vm, stats) = match receive_vm(config, &mut connection, stopped) {
        Ok(vm) => vm,
        Err(reason) => {
            // The source may still listen for why (it gets an error of its own otherwise).
            let _ = send_answer(&mut connection, Err(&reason));
            return Err(ReceiveError::Migration(reason));
        }
    };
    // The VM's own server takes the API socket over from here: a client that learns from the
    // source that the VM moved finds it served (or its request in the backlog until it is).
    drop(waiting);
    // The guest runs here now: the source may stop. If it cannot hear that (it died after
    // sending everything), the VM still runs here, once.
    if let Err(e) = send_answer(&mut connection, Ok(())) {
        log(
            LogLevel::Warn,
            format_args!("the VM runs here, but the source could not be told: {e}"),
        );
    }
    received(stats);
    match vm {
        ReceivedVm::TestGuest(controller) => Ok(ReceiveEnding::TestGuest(serve_controller(
            run,
            api,
            *controller,
            config.idle_timeout,
            || {},
        )?)),
        ReceivedVm::Linux {
            linux,
            vcpus,
            paused,
        } => {
            // The Linux guest runs under a loop of its own.
            drop(run);
            let options = LinuxRun {
                api: Some(api),
                paused,
                ..LinuxRun::default()
            };
            Ok(ReceiveEnding::Linux(run_linux(&linux, vcpus, options)?))
        }
    }
}

/// Runs `receive` on a thread of its own and returns that thread once it listens (its API
/// socket answering), or the error that kept it from listening.
pub fn receive_in_background(
    config: ReceiveConfig,
) -> Result<JoinHandle<Result<ReceiveEnding, ReceiveError>>, ReceiveError> {
    in_background(move |ready| receive(&config, ready, |_| {}))
}

/// Reads the stream into a new VM and starts it; the reason if anything is wrong.
fn receive_vm(
    config: &ReceiveConfig,
    connection: &mut Connection,
    stopped: &Arc<EventFd>,
) -> Result<(ReceivedVm, Received), String> {
    let started = Instant::now();
    let reading = connection.try_clone().map_err(|e| e.to_string())?;
    let mut reader = StreamReader::new(BufReader::with_capacity(1 << 20, reading));
    let (layout, hands_over) = match reader.next_record().map_err(|e| e.to_string())? {
        Some(Record::Hello { layout, hands_over }) => (layout, hands_over),
        _ => return Err("the stream does not start with Hello".into()),
    };
    // Local mode: the source's shared regions come as files beside Handover records, one
    // for each, before anything else.
    let mut handed = HashMap::new();
    if hands_over {
        let shared = layout
            .regions
            .iter()
            .filter(|r| r.backing == LayoutBacking::Shared)
            .count();
        while handed.len() < shared {
            let Some(Record::Handover(regions)) =
                reader.next_record().map_err(|e| e.to_string())?
            else {
                return Err("the Hello announced a handover, but no Handover came".into());
            };
            let fds = connection.take_fds(regions.len()).ok_or_else(|| {
                format!(
                    "a Handover of {} regions came without as many file descriptors (local \
                     mode needs a Unix socket)",
                    regions.len()
                )
            })?;
            for ((index, offset), fd) in regions.into_iter().zip(fds) {
                let file = std::fs::File::from(fd);
                let index = index as usize;
                check_handed(&file, index, &layout.regions[index], offset)?;
                handed.insert(index, FileOffset::new(file, offset));
            }
        }
    }
    no_stray_fds(connection)?;
    let options = VmOptions {
        limits: config.limits,
        dirty_ring: config.dirty_ring,
        ..VmOptions::default()
    };
    let cannot =
        |e: &dyn std::fmt::Display| format!("this VMM cannot lay the VM's memory out: {e}");
    let vm = Vm::new(options).map_err(|e| cannot(&e))?;
    let ids = layout
        .build_handed_over(vm.memory(), &handed)
        .map_err(|e| cannot(&e))?;
    send_answer(connection, Ok(())).map_err(|e| e.to_string())?;
    let mut state = None;
    let (mut rounds, mut bytes) = (0, 0);
    loop {
        match reader.next_record().map_err(|e| e.to_string())? {
            Some(Record::Pages { offset, data }) => {
                apply_pages(vm.memory(), &layout, offset, &data).map_err(|e| e.to_string())?;
                bytes += data.len() as u64;
            }
            Some(Record::RoundEnd { round, .. }) => rounds = round,
            Some(Record::State(bytes)) => state = Some(bytes),
            // Kept by the reader, for its check below.
            Some(Record::Digest(_)) => {}
            Some(Record::Done) | None => break,
            Some(Record::Hello { .. } | Record::Handover(_)) => {
                unreachable!("the reader refuses a second Hello, and a Handover past the first")
            }
        }
    }
    no_stray_fds(connection)?;
    // Every page landed, and no vCPU exists yet: the memory here must be what the source
    // sent, read from guest memory (not from the stream), or nothing runs.
    if let Some(hook) = config.after_landing {
        hook(vm.memory());
    }
    let checking = Instant::now();
    reader.verify(vm.memory()).map_err(|e| e.to_string())?;
    let check = checking.elapsed();
    let state = state.ok_or("the stream ended without the VM's state")?;
    let stats = Received {
        rounds,
        bytes,
        check,
        elapsed: started.elapsed(),
    };
    let bad_state = |e: &dyn std::fmt::Display| format!("the VM's state (its State record): {e}");
    // The record says its guest kind (an older source's, by its magic).
    if GuestKind::of_bytes(&state).map_err(|e| bad_state(&e.0))? == GuestKind::Linux {
        if config.dirty_ring.is_some() && crate::vm::host_emulates_ring0() {
            return Err(crate::linux::ConfigError::RingOnEmulatedHost.to_string());
        }
        let state = LinuxState::from_bytes(&state).map_err(|e| bad_state(&e.0))?;
        check_layout(&state.layout, &layout).map_err(|e| e.to_string())?;
        vm.add_irqchip()
            .map_err(|e| format!("setting the VM up for Linux: {e}"))?;
        let linux = LinuxVm::restore_on(vm, &state, Box::new(std::io::stdout()), None)
            .map_err(|e| e.to_string())?;
        let vcpus = linux.restored_vcpus(&state).map_err(|e| e.to_string())?;
        let paused = state.paused;
        return Ok((
            ReceivedVm::Linux {
                linux,
                vcpus,
                paused,
            },
            stats,
        ));
    }
    let state = SnapshotState::from_bytes(&state).map_err(|e| bad_state(&e.0))?;
    check_layout(&state.layout, &layout).map_err(|e| e.to_string())?;
    let vm = TestVm::from_vm(vm, &layout, &ids)
        .map_err(|e| format!("this VMM cannot lay the VM's memory out: {e}"))?;
    let vcpus = vm
        .start_restored_vcpus(&state.vcpus, stopped)
        .map_err(|e| format!("restoring the vCPUs: {e}"))?;
    let mut controller = Controller::new(vm, vcpus)
        .with_hotplug(state.guest.hotplug.as_ref())
        .map_err(|e| e.to_string())?;
    if state.paused {
        controller = controller.paused();
    }
    controller.resume_unfinished();
    Ok((ReceivedVm::TestGuest(Box::new(controller)), stats))
}

/// Checks the file handed over for region `index` (`region`) at `offset`: a regular file (a
/// memfd is one; a FIFO, a socket or a device is refused before anything maps it) that holds
/// the whole region, so that no guest access can fall past its end (SIGBUS).
fn check_handed(
    file: &std::fs::File,
    index: usize,
    region: &RegionLayout,
    offset: u64,
) -> Result<(), String> {
    let what = format!(
        "the file handed over for region {index} (guest {:#x}, {:#x} bytes)",
        region.gpa, region.size
    );
    let meta = file.metadata().map_err(|e| format!("{what}: {e}"))?;
    if !meta.file_type().is_file() {
        return Err(format!(
            "{what} is {}, not a regular file or memfd",
            file_kind(meta.file_type())
        ));
    }
    // The stream's reader checked that the end does not wrap.
    let end = offset.saturating_add(region.size);
    if meta.len() < end {
        return Err(format!(
            "{what} holds {:#x} bytes: too few for the region at offset {offset:#x}",
            meta.len()
        ));
    }
    Ok(())
}

/// Refuses file descriptors that came beside the stream but that no Handover record names.
fn no_stray_fds(connection: &Connection) -> Result<(), String> {
    match connection.fds_waiting() {
        0 => Ok(()),
        stray => Err(format!(
            "{stray} file descriptors came beside the stream that no Handover record names"
        )),
    }
}

/// The destination's controller while no VM is here: `GET /vm` says `Waiting` or `Receiving`,
/// and every other request is refused (409), saying why.
#[derive(Debug)]
struct Waiting {
    /// Where the destination listens for its source.
    listen: String,
    /// Set once a source connected.
    receiving: Arc<AtomicBool>,
}

impl Waiting {
    fn new(listen: String) -> Self {
        Waiting {
            listen,
            receiving: Arc::default(),
        }
    }

    fn state(&self) -> RunState {
        if self.receiving.load(Ordering::Acquire) {
            RunState::Receiving
        } else {
            RunState::Waiting
        }
    }
}

impl Apply for Waiting {
    fn apply(&mut self, request: Request) -> Outcome {
        let state = self.state();
        if request == Request::GetVm {
            return Ok(Reply::Vm(VmInfo {
                state,
                vcpus: 0,
                failure: None,
                lazy_restore: None,
            }));
        }
        let why = match state {
            RunState::Receiving => {
                format!("a migration is arriving from its source on {}", self.listen)
            }
            _ => format!(
                "this VMM waits for a migration on {} (PUT /migrate on the source, with that \
                 destination)",
                self.listen
            ),
        };
        Err(ControllerError::conflict(format!(
            "no VM here yet: {why}; this socket serves the VM once it runs here (GET /vm says \
             when: its state leaves {state:?})"
        )))
    }
}

/// Wakes the waiting API's loop so that it sees it should stop.
struct Wake(Arc<EventFd>);

impl MutEventSubscriber for Wake {
    fn process(&mut self, _: Events, _: &mut EventOps) {
        let _ = self.0.read();
    }

    fn init(&mut self, ops: &mut EventOps) {
        ops.add(Events::new(&*self.0, EventSet::IN))
            .expect("watching the waiting API's wake-up");
    }
}

/// The destination's API socket while no VM is here: a thread serves [`Waiting`] on a second
/// descriptor of the socket's listener, until this is dropped (which stops and joins it, and
/// closes its connections).
struct WaitingApi {
    /// The state `GET /vm` reports: set once a source connected.
    receiving: Arc<AtomicBool>,
    stop: Arc<AtomicBool>,
    wake: Arc<EventFd>,
    thread: Option<JoinHandle<()>>,
}

impl WaitingApi {
    /// Serves `waiting` on `listener` (a copy of it) from a thread of its own.
    fn start(
        listener: &UnixListener,
        waiting: Waiting,
        idle_timeout: Duration,
    ) -> std::io::Result<Self> {
        let receiving = Arc::clone(&waiting.receiving);
        let server = ApiServer::new(listener.try_clone()?, waiting).with_idle_timeout(idle_timeout);
        let wake = Arc::new(EventFd::new(EFD_NONBLOCK)?);
        let mut manager: EventManager<Arc<Mutex<dyn MutEventSubscriber + Send>>> =
            EventManager::new()
                .map_err(|e| std::io::Error::other(format!("creating an event loop: {e:?}")))?;
        manager.add_subscriber(Arc::new(Mutex::new(server)));
        manager.add_subscriber(Arc::new(Mutex::new(Wake(Arc::clone(&wake)))));
        let stop = Arc::new(AtomicBool::new(false));
        let stopping = Arc::clone(&stop);
        let thread = std::thread::Builder::new()
            .name("waiting-api".into())
            .spawn(move || {
                while !stopping.load(Ordering::Acquire) {
                    // A signal interrupts the wait; that is not an error.
                    let _ = manager.run();
                }
            })?;
        Ok(WaitingApi {
            receiving,
            stop,
            wake,
            thread: Some(thread),
        })
    }
}

impl Drop for WaitingApi {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        let _ = self.wake.write(1);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// `tinyvmm receive`'s arguments: where to wait for the source, and the API socket.
#[derive(Debug, clap::Args)]
pub struct ReceiveArgs {
    /// Where to wait for the source: unix:PATH or tcp:HOST:PORT.
    #[arg(long)]
    listen: Endpoint,
    /// The API socket, and the VM's limits and dirty-log mode (for migrating onwards).
    #[command(flatten)]
    api: ApiArgs,
}

impl ReceiveArgs {
    /// Runs `tinyvmm receive`: waits for the source, then runs the VM received and serves it
    /// until it ends; gives the exit status.
    pub fn run(self) -> ExitCode {
        crate::api::server::log_requests(self.api.log_requests);
        let config = ReceiveConfig {
            listen: self.listen,
            api_sock: self.api.api_sock,
            idle_timeout: self.api.idle_timeout,
            limits: Some(self.api.limits.resolve()),
            dirty_ring: self.api.dirty_ring,
            after_landing: None,
        };
        let listen = config.listen.to_string();
        let api = config.api_sock.display().to_string();
        let outcome = receive(
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
            Ok(ReceiveEnding::Linux(ending)) => linux_ended(&ending),
            Ok(ReceiveEnding::TestGuest(ending)) => served(Ok::<_, String>(ending)),
            Err(e) => served(Err::<Ending, _>(e)),
        }
    }
}
