//! What the host and a vCPU thread share: the kick that brings the thread out of `KVM_RUN`,
//! the request to stop, and the pause that parks the vCPU at a whole instruction and saves its
//! state there.

use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kvm_ioctls::VcpuFd;

use super::counters::ExitCounters;
use crate::host::{self, ThreadId};
use crate::vm::state::{StateError, VcpuState, SAVED_MSRS};

extern "C" fn ignore_signal(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {}

/// The signal that kicks a vCPU thread out of `KVM_RUN` (its run then fails with `EINTR`).
fn kick_signal() -> libc::c_int {
    vmm_sys_util::signal::SIGRTMIN()
}

/// Installs the kick signal's handler (a no-op: the signal only has to interrupt `KVM_RUN`),
/// once per process.
pub(crate) fn install_kick_handler() {
    static HANDLER: std::sync::Once = std::sync::Once::new();
    HANDLER.call_once(|| {
        vmm_sys_util::signal::register_signal_handler(kick_signal(), ignore_signal)
            .expect("SIGRTMIN is a valid signal for a handler");
    });
}

/// Kicks the vCPU thread `thread` out of the guest until it has finished, for at most
/// `timeout` (a kick can land just before the thread enters the guest, so one is not enough).
/// Returns whether the thread finished.
pub(crate) fn kick_until_finished<T>(thread: &JoinHandle<T>, timeout: Duration) -> bool {
    use vmm_sys_util::signal::Killable;
    let deadline = Instant::now() + timeout;
    while !thread.is_finished() && Instant::now() < deadline {
        let _ = thread.kill(kick_signal());
        std::thread::sleep(Duration::from_millis(1));
    }
    thread.is_finished()
}

/// What the host and a vCPU thread share.
#[derive(Debug, Default)]
pub struct VcpuShared {
    /// Exit counts (also in the process's totals once the vCPU's thread started).
    pub counters: Arc<ExitCounters>,
    /// Where MMIO exits are expected (see [`ExitContext::expected_mmio`]).
    ///
    /// [`ExitContext::expected_mmio`]: crate::vm::exit::ExitContext::expected_mmio
    pub expected_mmio: Mutex<Option<Range<u64>>>,
    /// Set to make the vCPU stop at its next exit (kick it to make that exit come soon).
    stop: AtomicBool,
    /// Where the host pauses the vCPU inside a guest's run (see [`VcpuShared::pause`]).
    pause: PauseGate,
    /// The vCPU thread, for kicks from any host thread: set when the thread starts, taken
    /// back by the thread itself before it returns (so before anyone can join it). A kick
    /// signals it while holding the lock, so it never signals a thread that was joined.
    thread: Mutex<Option<ThreadId>>,
    /// Set when the vCPU's loop has ended (its thread may still be finishing).
    finished: AtomicBool,
    /// The guest's instruction pointer when the loop ended on an error.
    failed_rip: OnceLock<u64>,
}

/// Why a vCPU could not be paused or its state saved while paused.
#[derive(Debug, thiserror::Error)]
pub enum PauseError {
    /// The vCPU did not reach a stop within the time allowed.
    #[error("the vCPU did not pause within {0:?}")]
    Timeout(Duration),
    /// The vCPU's loop has ended: there is nothing to pause.
    #[error("the vCPU has stopped")]
    Stopped,
    /// The vCPU is not paused.
    #[error("the vCPU is not paused")]
    NotPaused,
    /// Reading the state failed.
    #[error(transparent)]
    State(#[from] StateError),
}

/// The host's side of pausing a vCPU mid-run: it asks, the vCPU parks at its next exit with
/// every pending I/O completed (so its registers are a consistent point of the guest), saves
/// its state whenever asked, and enters the guest again once the pause is lifted.
#[derive(Debug, Default)]
struct PauseGate {
    state: Mutex<Gate>,
    changed: Condvar,
    /// `Gate::requested`, readable without the lock: the exit loop checks it on every exit.
    wanted: AtomicBool,
}

#[derive(Debug, Default)]
struct Gate {
    requested: bool,
    /// An unconfirmed migration holds the pause: only [`VcpuShared::release`] lifts it.
    held: bool,
    parked: bool,
    /// A save asked for.
    save: Option<SaveRequest>,
}

/// A save a host thread asks of a parked vCPU: where the state goes, and the MSRs to read.
type SaveRequest = (Sender<Result<VcpuState, StateError>>, Arc<[u32]>);

impl PauseGate {
    fn lock(&self) -> MutexGuard<'_, Gate> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl VcpuShared {
    /// Shared state of a vCPU that starts paused: its thread parks before it first enters
    /// the guest (a restored vCPU, until the VM is resumed).
    pub(crate) fn starting_paused() -> Self {
        let shared = VcpuShared::default();
        shared.pause.lock().requested = true;
        shared.pause.wanted.store(true, Ordering::Release);
        shared
    }

    /// Asks the vCPU to stop at its next exit.
    pub(crate) fn request_stop(&self) {
        self.stop.store(true, Ordering::Release);
        // A parked vCPU sees it at once.
        self.pause.changed.notify_all();
    }

    pub(super) fn stop_requested(&self) -> bool {
        self.stop.load(Ordering::Acquire)
    }

    /// Kicks the vCPU's thread out of `KVM_RUN` (no-op before it started or once it ended).
    fn kick(&self) {
        if self.finished.load(Ordering::Acquire) {
            return;
        }
        let thread = self.thread.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(thread) = *thread {
            // SAFETY: `thread` is the vCPU's own thread, put here by the thread itself, which
            // takes it back (under this lock, held until the signal is sent) before it
            // returns: the thread has not returned, so it cannot have been joined, and the id
            // names it. The kick signal's handler is a no-op installed before any vCPU runs.
            let _ = unsafe { host::signal_thread(thread, kick_signal()) };
        }
    }

    /// Pauses the vCPU: asks it to park and kicks it until it has, for at most `timeout`. A
    /// vCPU waiting outside the guest (the test guest between commands) parks only when it
    /// would next enter it, so `pause` times out on it. On a timeout the request stays:
    /// [`resume`](Self::resume) withdraws it.
    pub fn pause(&self, timeout: Duration) -> Result<(), PauseError> {
        let deadline = Instant::now() + timeout;
        let mut gate = self.pause.lock();
        gate.requested = true;
        self.pause.wanted.store(true, Ordering::Release);
        while !gate.parked {
            if self.finished.load(Ordering::Acquire) {
                return Err(PauseError::Stopped);
            }
            if Instant::now() >= deadline {
                return Err(PauseError::Timeout(timeout));
            }
            drop(gate);
            self.kick();
            gate = self.pause.lock();
            gate = self
                .pause
                .changed
                .wait_timeout(gate, Duration::from_millis(1))
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        Ok(())
    }

    /// Whether the vCPU's loop has ended.
    pub(crate) fn has_finished(&self) -> bool {
        self.finished.load(Ordering::Acquire)
    }

    /// The guest's instruction pointer where the vCPU's loop ended on an error, once it has
    /// (`None` while it runs, after a clean stop, or if the registers could not be read).
    pub(crate) fn failed_rip(&self) -> Option<u64> {
        self.failed_rip
            .get()
            .copied()
            .filter(|&rip| rip != u64::MAX)
    }

    /// The state of a paused vCPU, read by its own thread, with the test guest's MSRs.
    pub fn save_paused(&self) -> Result<VcpuState, PauseError> {
        self.save_paused_with(&Arc::from(&SAVED_MSRS[..]))
    }

    /// The state of a paused vCPU, read by its own thread, with the MSRs `msrs`.
    pub(crate) fn save_paused_with(&self, msrs: &Arc<[u32]>) -> Result<VcpuState, PauseError> {
        let (reply, state) = std::sync::mpsc::channel();
        {
            let mut gate = self.pause.lock();
            if !gate.parked {
                return Err(PauseError::NotPaused);
            }
            gate.save = Some((reply, Arc::clone(msrs)));
        }
        self.pause.changed.notify_all();
        match state.recv_timeout(Duration::from_secs(10)) {
            Ok(state) => Ok(state?),
            Err(_) => Err(PauseError::Stopped),
        }
    }

    /// Lifts a pause: the vCPU enters the guest again where it was; unless a migration holds
    /// it (`hold`): then the pause stays until `release`.
    pub fn resume(&self) {
        let mut gate = self.pause.lock();
        if gate.held {
            return;
        }
        gate.requested = false;
        self.pause.wanted.store(false, Ordering::Release);
        drop(gate);
        self.pause.changed.notify_all();
    }

    /// Keeps the vCPU paused (it is, or parks at its next exit) until [`release`]: a
    /// migration that ended unconfirmed may have left the VM running on its destination, and
    /// no other pause's [`resume`](Self::resume) (a live snapshot's, a failed migration's)
    /// may run the guest here too.
    ///
    /// [`release`]: Self::release
    pub(crate) fn hold(&self) {
        let mut gate = self.pause.lock();
        gate.held = true;
        gate.requested = true;
        self.pause.wanted.store(true, Ordering::Release);
    }

    /// Lifts a [`hold`](Self::hold) and the pause with it (a client says the destination
    /// does not run the VM: `PATCH /vm {"state": "Resumed"}`).
    pub(crate) fn release(&self) {
        self.pause.lock().held = false;
        self.resume();
    }

    /// Whether a pause is asked for; no lock, as it is read on every exit.
    pub(super) fn pause_requested(&self) -> bool {
        self.pause.wanted.load(Ordering::Acquire)
    }

    /// Parks the calling vCPU thread while a pause is requested, saving its state when asked;
    /// false if the vCPU was asked to stop meanwhile.
    pub(super) fn park(&self, vcpu: &VcpuFd) -> bool {
        let mut gate = self.pause.lock();
        gate.parked = true;
        self.pause.changed.notify_all();
        let go_on = loop {
            if self.stop_requested() {
                break false;
            }
            if !gate.requested {
                break true;
            }
            if let Some((reply, msrs)) = gate.save.take() {
                let _ = reply.send(VcpuState::save_with(vcpu, &msrs));
                continue;
            }
            gate = self
                .pause
                .changed
                .wait_timeout(gate, Duration::from_millis(20))
                .unwrap_or_else(|p| p.into_inner())
                .0;
        };
        gate.parked = false;
        self.pause.changed.notify_all();
        go_on
    }

    /// Called on the vCPU's own thread as it starts: kicks reach the thread from now on, and
    /// its exits count in the process's totals ([`exit_totals`](super::exit_totals)).
    pub(super) fn thread_started(&self) {
        *self.thread.lock().unwrap_or_else(|p| p.into_inner()) = Some(host::current_thread());
        super::counters::register(Arc::clone(&self.counters));
    }

    /// Called on the vCPU's own thread once its loop ended, before the thread returns: no kick
    /// reaches the thread after this (whoever joins it may do so once it returns), and a host
    /// thread waiting for a pause learns that the vCPU stopped.
    pub(super) fn thread_ending(&self) {
        *self.thread.lock().unwrap_or_else(|p| p.into_inner()) = None;
        self.finished.store(true, Ordering::Release);
        self.pause.changed.notify_all();
    }

    /// Keeps the guest's instruction pointer where the vCPU's loop ended on an error
    /// ([`failed_rip`](Self::failed_rip)).
    pub(super) fn set_failed_rip(&self, rip: u64) {
        let _ = self.failed_rip.set(rip);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_release_lifts_a_hold() {
        let shared = VcpuShared::default();
        shared.hold();
        assert!(
            shared.pause_requested(),
            "a held vCPU parks at its next exit"
        );
        // A live snapshot's or a failed migration's resume leaves it paused.
        shared.resume();
        assert!(shared.pause_requested());
        shared.release();
        assert!(!shared.pause_requested());
        // Without a hold, a resume lifts a pause as before.
        shared.pause.lock().requested = true;
        shared.pause.wanted.store(true, Ordering::Release);
        shared.resume();
        assert!(!shared.pause_requested());
    }
}
