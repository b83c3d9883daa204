//! The VMM's event loop (event-manager) for everything that is not a vCPU: the job's end, vCPUs
//! stopping, and SIGINT/SIGTERM, which end the job cleanly; and how much the VMM says on
//! stderr ([`LogLevel`]).

use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use event_manager::{EventManager, EventOps, EventSet, Events, MutEventSubscriber, SubscriberOps};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};
use vmm_sys_util::signal::register_signal_handler;

/// How much the VMM says on stderr (`--log-level`): each level says what the ones before it
/// say, and more.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Default, clap::ValueEnum)]
pub enum LogLevel {
    /// Only why the VMM or its guest failed.
    Error,
    /// And what went wrong without stopping the run (a refusal the VMM could not tell its
    /// peer, connections it cannot close).
    Warn,
    /// And each state change: serving, waiting, receiving, migrated, stopped, files written.
    #[default]
    Info,
    /// And every API request with its status and time (as `--log-requests`).
    Debug,
}

/// The level in force, as its discriminant.
static LOG_LEVEL: AtomicU8 = AtomicU8::new(LogLevel::Info as u8);

/// Says on stderr from now on what `level` says (for the whole process).
pub fn set_log_level(level: LogLevel) {
    LOG_LEVEL.store(level as u8, Ordering::Relaxed);
}

/// Whether the level in force says what `level` says.
pub(crate) fn logs(level: LogLevel) -> bool {
    level as u8 <= LOG_LEVEL.load(Ordering::Relaxed)
}

/// Says `message` on stderr as `tinyvmm: MESSAGE`, if the level in force says `level`.
pub fn log(level: LogLevel, message: impl std::fmt::Display) {
    if logs(level) {
        eprintln!("tinyvmm: {message}");
    }
}

/// What a job gets to see of the loop.
#[derive(Debug, Clone)]
pub struct JobContext {
    /// Set when the job should stop early: a signal came. (A vCPU that stops on an error tells
    /// the job through its own channel, which the job sees at its next wait.)
    pub stop: Arc<AtomicBool>,
    /// For vCPU threads to signal that they stopped.
    pub vcpu_stopped: Arc<EventFd>,
}

/// How the loop ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ending {
    /// The job finished on its own.
    Finished,
    /// SIGINT or SIGTERM asked the VMM to stop.
    Interrupted,
    /// The VMM was stopped (by a client or a signal) after its guest had failed: a vCPU
    /// stopped on an error (`control::vm::FAILED_EXIT_STATUS`).
    GuestFailed,
}

/// The eventfd SIGINT and SIGTERM write to: made once and never closed, so that the handler
/// (which stays installed) can never write into a file descriptor that was reused.
static SIGNAL_EVENT: OnceLock<EventFd> = OnceLock::new();
/// Its number, for the async-signal-safe handler.
static SIGNAL_FD: AtomicI32 = AtomicI32::new(-1);
/// Set by the handler too, for work that runs on the event loop's own thread (an API request)
/// and so cannot hear the eventfd until it returns: it checks this at its safe points.
static SIGNALLED: AtomicBool = AtomicBool::new(false);

/// Set once SIGINT or SIGTERM came (after [`EventLoop::new`] installed the handler); never
/// cleared, since the process is on its way out. Long operations poll it between steps.
pub(crate) fn termination_signal() -> &'static AtomicBool {
    &SIGNALLED
}

/// Routes SIGINT and SIGTERM to the VMM's handler from now on (what [`EventLoop::new`] does
/// too): their default action would end the process without a word or its exit status 130.
/// Jobs call it before anything a client can see exists (an API socket): a client may signal
/// the VMM as soon as it finds it, while it still starts. A signal that comes before the
/// event loop sets [`termination_signal`] and leaves the loop's eventfd readable, so the loop
/// ends on it as soon as it runs.
pub(crate) fn catch_termination_signals() -> Result<(), LoopError> {
    signal_event().map(|_| ())
}

/// The signal eventfd, with the handlers installed on first use.
fn signal_event() -> Result<&'static EventFd, LoopError> {
    if let Some(event) = SIGNAL_EVENT.get() {
        return Ok(event);
    }
    let created = EventFd::new(EFD_NONBLOCK).map_err(LoopError::EventFd)?;
    // Another thread may have won the race: then its eventfd is the one.
    let _ = SIGNAL_EVENT.set(created);
    let event = SIGNAL_EVENT.get().expect("set just above");
    SIGNAL_FD.store(event.as_raw_fd(), Ordering::Release);
    for num in [libc::SIGINT, libc::SIGTERM] {
        register_signal_handler(num, on_termination_signal).map_err(LoopError::Signal)?;
    }
    Ok(event)
}

extern "C" fn on_termination_signal(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {
    // An atomic store is async-signal-safe.
    SIGNALLED.store(true, Ordering::Release);
    let fd = SIGNAL_FD.load(Ordering::Relaxed);
    if fd >= 0 {
        let one = 1u64;
        // SAFETY: write(2) is async-signal-safe; `one` is a valid 8-byte buffer, and `fd` is
        // SIGNAL_EVENT's eventfd, which is never closed once published.
        unsafe { libc::write(fd, (&one as *const u64).cast(), 8) };
    }
}

struct Lifecycle {
    context: JobContext,
    job_done: Arc<EventFd>,
    signal: &'static EventFd,
    /// A signal asked the VMM to stop.
    interrupted: bool,
    /// The job said it is done.
    job_done_seen: bool,
}

impl MutEventSubscriber for Lifecycle {
    fn process(&mut self, events: Events, _ops: &mut EventOps) {
        let fd = events.fd();
        if fd == self.job_done.as_raw_fd() {
            let _ = self.job_done.read();
            self.job_done_seen = true;
        } else if fd == self.signal.as_raw_fd() {
            let _ = self.signal.read();
            log(LogLevel::Info, "stopping on a signal");
            self.context.stop.store(true, Ordering::Release);
            self.interrupted = true;
        } else if fd == self.context.vcpu_stopped.as_raw_fd() {
            // The job hears why from the vCPU itself; the loop only wakes it up.
            let _ = self.context.vcpu_stopped.read();
        }
    }

    fn init(&mut self, ops: &mut EventOps) {
        for fd in [&*self.job_done, self.signal, &*self.context.vcpu_stopped] {
            ops.add(Events::new(fd, EventSet::IN))
                .expect("watching an eventfd");
        }
    }
}

/// Errors of the loop itself.
#[derive(Debug, thiserror::Error)]
pub enum LoopError {
    /// Creating an eventfd failed.
    #[error("creating an eventfd for the event loop failed: {0}")]
    EventFd(std::io::Error),
    /// Creating the epoll instance failed.
    #[error("creating the event loop failed: {0:?}")]
    Epoll(event_manager::Error),
    /// Installing the SIGINT/SIGTERM handler failed.
    #[error("installing the signal handler failed: {0}")]
    Signal(vmm_sys_util::errno::Error),
    /// Starting the job's thread failed.
    #[error("starting the job's thread failed: {0}")]
    Thread(std::io::Error),
}

/// The event loop with the lifecycle subscriber in place; more subscribers can join it.
pub(crate) struct EventLoop {
    manager: EventManager<Arc<Mutex<dyn MutEventSubscriber + Send>>>,
    lifecycle: Arc<Mutex<Lifecycle>>,
    context: JobContext,
    job_done: Arc<EventFd>,
}

impl std::fmt::Debug for EventLoop {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EventLoop")
            .field("context", &self.context)
            .finish_non_exhaustive()
    }
}

impl EventLoop {
    /// Creates the loop and routes SIGINT and SIGTERM to it.
    pub(crate) fn new() -> Result<Self, LoopError> {
        let eventfd = || {
            EventFd::new(EFD_NONBLOCK)
                .map(Arc::new)
                .map_err(LoopError::EventFd)
        };
        let context = JobContext {
            stop: Arc::new(AtomicBool::new(false)),
            vcpu_stopped: eventfd()?,
        };
        let job_done = eventfd()?;
        let signal = signal_event()?;
        let lifecycle = Arc::new(Mutex::new(Lifecycle {
            context: context.clone(),
            job_done: Arc::clone(&job_done),
            signal,
            interrupted: false,
            job_done_seen: false,
        }));
        let mut manager: EventManager<Arc<Mutex<dyn MutEventSubscriber + Send>>> =
            EventManager::new().map_err(LoopError::Epoll)?;
        manager.add_subscriber(lifecycle.clone());
        Ok(EventLoop {
            manager,
            lifecycle,
            context,
            job_done,
        })
    }

    /// What jobs and vCPUs share with the loop.
    pub(crate) fn context(&self) -> &JobContext {
        &self.context
    }

    /// Adds a subscriber (the API server, say).
    pub(crate) fn add(&mut self, subscriber: Arc<Mutex<dyn MutEventSubscriber + Send>>) {
        self.manager.add_subscriber(subscriber);
    }

    /// Waits up to `timeout_ms` for events and dispatches them; returns how the loop should end,
    /// if it should: `Interrupted` once a signal came, `Finished` once the job said it is done.
    pub(crate) fn dispatch(&mut self, timeout_ms: i32) -> Option<Ending> {
        // A signal interrupts epoll_wait; that is not an error.
        let _ = self.manager.run_with_timeout(timeout_ms);
        let state = self.lifecycle.lock().unwrap_or_else(|p| p.into_inner());
        if state.interrupted {
            Some(Ending::Interrupted)
        } else if state.job_done_seen {
            Some(Ending::Finished)
        } else {
            None
        }
    }

    fn job_done_seen(&self) -> bool {
        self.lifecycle
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .job_done_seen
    }
}

/// Runs `job` on its own thread while this thread runs the event loop; returns the job's result
/// and how the loop ended. A signal sets the job's stop flag; the loop waits for the job anyway
/// so that it can shut its vCPUs down cleanly.
pub fn run_job<T: Send + 'static>(
    job: impl FnOnce(JobContext) -> T + Send + 'static,
) -> Result<(T, Ending), LoopError> {
    let mut event_loop = EventLoop::new()?;
    let job_context = event_loop.context().clone();
    let job_done = Arc::clone(&event_loop.job_done);
    let worker = std::thread::Builder::new()
        .name("job".into())
        .spawn(move || {
            let result = job(job_context);
            let _ = job_done.write(1);
            result
        })
        .map_err(LoopError::Thread)?;
    // Keep dispatching (a signal sets the job's stop flag) until the job says it is done; its
    // thread ends right after that.
    let mut ending = Ending::Finished;
    while !event_loop.job_done_seen() {
        if event_loop.dispatch(1000) == Some(Ending::Interrupted) {
            ending = Ending::Interrupted;
        }
    }
    let result = worker
        .join()
        .unwrap_or_else(|panic| std::panic::resume_unwind(panic));
    Ok((result, ending))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_level_says_what_the_ones_before_it_say() {
        set_log_level(LogLevel::Warn);
        assert!(logs(LogLevel::Error) && logs(LogLevel::Warn));
        assert!(!logs(LogLevel::Info) && !logs(LogLevel::Debug));
        set_log_level(LogLevel::Debug);
        assert!(logs(LogLevel::Info) && logs(LogLevel::Debug));
        set_log_level(LogLevel::default());
        assert!(logs(LogLevel::Info) && !logs(LogLevel::Debug));
    }
}
