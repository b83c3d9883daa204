//! The vCPU thread: the one exit loop every guest kind runs. It enters the guest, turns the exit
//! into an [`ExitAction`] with the pure handler, carries out what concerns memory (finishing an
//! access that hit a slot while it was away, counting expected exits) and hands port accesses
//! to the guest kind's [`VcpuPorts`], which is all a guest kind supplies: its port bus and what
//! its devices do.

use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kvm_ioctls::VcpuFd;
use kvm_memslots::{GuestMemorySlots, KvmMemory, KvmVm, MemoryManager, RegionInfo};
use vm_memory::Bytes;
use vmm_sys_util::eventfd::EventFd;

use super::exit::{handle_exit, Exit, ExitAction, ExitContext, ExitError, EXIT_KINDS};
use super::mmio::MmioBus;
use super::ports::PortBus;
use super::state::{StateError, VcpuState};

extern "C" fn ignore_signal(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {}

/// The signal that kicks a vCPU thread out of `KVM_RUN` (its run then fails with `EINTR`).
pub fn kick_signal() -> libc::c_int {
    vmm_sys_util::signal::SIGRTMIN()
}

/// Installs the kick signal's handler (a no-op: the signal only has to interrupt `KVM_RUN`),
/// once per process.
pub fn install_kick_handler() {
    static HANDLER: std::sync::Once = std::sync::Once::new();
    HANDLER.call_once(|| {
        vmm_sys_util::signal::register_signal_handler(kick_signal(), ignore_signal)
            .expect("SIGRTMIN is a valid signal for a handler");
    });
}

/// Kicks the vCPU thread `thread` out of the guest until it has finished, for at most
/// `timeout` (a kick can land just before the thread enters the guest, so one is not enough).
/// Returns whether the thread finished.
pub fn kick_until_finished<T>(thread: &JoinHandle<T>, timeout: Duration) -> bool {
    use vmm_sys_util::signal::Killable;
    let deadline = Instant::now() + timeout;
    while !thread.is_finished() && Instant::now() < deadline {
        let _ = thread.kill(kick_signal());
        std::thread::sleep(Duration::from_millis(1));
    }
    thread.is_finished()
}

/// Counts of the exits a vCPU handled, readable while it runs.
#[derive(Debug, Default)]
pub struct ExitCounters {
    /// Accesses to memory that was away during a slot change, finished against the map.
    pub completed_after_change: AtomicU64,
    /// Exits inside the expected window.
    pub expected: AtomicU64,
    /// Writes to read-only slots, dropped.
    pub read_only_writes: AtomicU64,
    /// Accesses to memory that is absent on purpose (unplugged virtio-mem blocks).
    pub absent_memory: AtomicU64,
    /// Instructions KVM could not emulate (VEX accesses, instruction fetches) that met a slot
    /// away during a change, run again once it was done.
    pub retried_after_change: AtomicU64,
    /// Accesses that faulted inside KVM on unreachable memory under a slot (an unplugged
    /// virtio-mem block in a plugged piece), after which its slot was taken away and the
    /// access run again (it then exits as absent memory).
    pub unreachable_isolated: AtomicU64,
    /// Every exit by its kind ([`Exit::kind`], named by [`EXIT_KINDS`]).
    pub by_kind: [AtomicU64; EXIT_KINDS.len()],
}

impl ExitCounters {
    /// Every exit: the kinds' counts added up.
    pub fn exits(&self) -> u64 {
        self.by_kind.iter().map(|c| c.load(Ordering::Relaxed)).sum()
    }

    /// Exits on a full dirty ring.
    pub fn dirty_ring_full(&self) -> u64 {
        self.by_kind[Exit::DirtyRingFull.kind()].load(Ordering::Relaxed)
    }
}

/// Every vCPU this process started, for [`exit_totals`]: kept for the process's life (a few
/// hundred bytes each), so that totals never go down when a VM's vCPUs end.
static STARTED: Mutex<Vec<Arc<VcpuShared>>> = Mutex::new(Vec::new());

/// The exits of every vCPU this process started ([`exit_totals`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExitTotals {
    /// Every exit, by its kind ([`EXIT_KINDS`]): they add up to all exits.
    pub by_kind: Vec<(&'static str, u64)>,
    /// Exits the loop handled its own way (some of the MMIO ones): writes to read-only
    /// memory dropped (`read_only_write`), accesses to absent memory (`absent_memory`),
    /// accesses completed against the map after a slot change (`completed_after_change`), and
    /// instructions KVM could not emulate, run again after a slot change
    /// (`retried_after_change`), and faults on unreachable memory under a slot after which the
    /// slot went and the access ran again (`unreachable_isolated`).
    pub handled: Vec<(&'static str, u64)>,
}

/// The exits of every vCPU this process started, for `GET /metrics`. Read from each vCPU's
/// own counters, so counting costs the exit loop no cache line shared with another vCPU.
pub fn exit_totals() -> ExitTotals {
    let started = STARTED.lock().unwrap_or_else(|p| p.into_inner());
    let sum = |count: &dyn Fn(&ExitCounters) -> &AtomicU64| -> u64 {
        started
            .iter()
            .map(|v| count(&v.counters).load(Ordering::Relaxed))
            .sum()
    };
    ExitTotals {
        by_kind: EXIT_KINDS
            .iter()
            .enumerate()
            .map(|(i, &name)| (name, sum(&|c| &c.by_kind[i])))
            .collect(),
        handled: vec![
            ("read_only_write", sum(&|c| &c.read_only_writes)),
            ("absent_memory", sum(&|c| &c.absent_memory)),
            (
                "completed_after_change",
                sum(&|c| &c.completed_after_change),
            ),
            ("retried_after_change", sum(&|c| &c.retried_after_change)),
            ("unreachable_isolated", sum(&|c| &c.unreachable_isolated)),
        ],
    }
}

/// What the host and a vCPU thread share.
#[derive(Debug, Default)]
pub struct VcpuShared {
    /// Exit counts.
    pub counters: ExitCounters,
    /// Where MMIO exits are expected (see [`ExitContext::expected_mmio`]).
    pub expected_mmio: Mutex<Option<Range<u64>>>,
    /// Set to make the vCPU stop at its next exit (kick it to make that exit come soon).
    pub stop: AtomicBool,
    /// Where the host pauses the vCPU inside a guest's run (see [`VcpuShared::pause`]).
    pause: PauseGate,
    /// The vCPU thread, for kicks from any host thread: set when the thread starts, taken
    /// back by the thread itself before it returns (so before anyone can join it). A kick
    /// signals it while holding the lock, so it never signals a thread that was joined.
    thread: Mutex<Option<libc::pthread_t>>,
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
    pub fn starting_paused() -> Self {
        let shared = VcpuShared::default();
        shared.pause.lock().requested = true;
        shared.pause.wanted.store(true, Ordering::Release);
        shared
    }

    /// Asks the vCPU to stop at its next exit.
    pub fn request_stop(&self) {
        self.stop.store(true, Ordering::Release);
        // A parked vCPU sees it at once.
        self.pause.changed.notify_all();
    }

    fn stop_requested(&self) -> bool {
        self.stop.load(Ordering::Acquire)
    }

    /// Kicks the vCPU's thread out of `KVM_RUN` (no-op before it started or once it ended).
    pub fn kick(&self) {
        if self.finished.load(Ordering::Acquire) {
            return;
        }
        let thread = self.thread.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(thread) = *thread {
            // SAFETY: `thread` is the vCPU's own pthread id, put here by the thread itself,
            // which takes it back (under this lock, held until the signal is sent) before it
            // returns: the thread has not returned, so it cannot have been joined, and the id
            // names it. The kick signal's handler is a no-op installed before any vCPU runs.
            unsafe { libc::pthread_kill(thread, kick_signal()) };
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
    pub fn has_finished(&self) -> bool {
        self.finished.load(Ordering::Acquire)
    }

    /// The guest's instruction pointer where the vCPU's loop ended on an error, once it has
    /// (`None` while it runs, after a clean stop, or if the registers could not be read).
    pub fn failed_rip(&self) -> Option<u64> {
        self.failed_rip
            .get()
            .copied()
            .filter(|&rip| rip != u64::MAX)
    }

    /// The state of a paused vCPU, read by its own thread, with the test guest's MSRs.
    pub fn save_paused(&self) -> Result<VcpuState, PauseError> {
        self.save_paused_with(&Arc::from(&super::state::SAVED_MSRS[..]))
    }

    /// The state of a paused vCPU, read by its own thread, with the MSRs `msrs`.
    pub fn save_paused_with(&self, msrs: &Arc<[u32]>) -> Result<VcpuState, PauseError> {
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
    /// it ([`hold`](Self::hold)): then the pause stays until [`release`](Self::release).
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
    pub fn hold(&self) {
        let mut gate = self.pause.lock();
        gate.held = true;
        gate.requested = true;
        self.pause.wanted.store(true, Ordering::Release);
    }

    /// Lifts a [`hold`](Self::hold) and the pause with it (a client says the destination
    /// does not run the VM: `PATCH /vm {"state": "Resumed"}`).
    pub fn release(&self) {
        self.pause.lock().held = false;
        self.resume();
    }

    /// Whether a pause is asked for; no lock, as it is read on every exit.
    fn pause_requested(&self) -> bool {
        self.pause.wanted.load(Ordering::Acquire)
    }

    /// Parks the calling vCPU thread while a pause is requested, saving its state when asked;
    /// false if the vCPU was asked to stop meanwhile.
    fn park(&self, vcpu: &VcpuFd) -> bool {
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
}

/// Whether the vCPU goes on after a port access.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flow {
    /// Enter the guest again.
    Continue,
    /// Stop the vCPU without an error (the guest left, or nobody will drive it again).
    Stop,
}

/// What a guest kind supplies to the exit loop: its port bus and what its devices do. The loop
/// calls it only for port accesses, never with a map version held, so a device may block (the
/// test guest waits there for the host's next command).
pub trait VcpuPorts: Send {
    /// The guest kind's devices, as its bus names them.
    type Device: Copy + std::fmt::Debug;
    /// Why a device stopped the vCPU.
    type Error: std::error::Error + Send + 'static;

    /// The port bus the exit handler routes accesses with.
    fn bus(&self) -> &PortBus<Self::Device>;

    /// Called once on the vCPU's thread before it first enters the guest; `Stop` ends the
    /// vCPU there.
    fn before_run(&mut self, vcpu: &VcpuFd) -> Flow {
        let _ = vcpu;
        Flow::Continue
    }

    /// The guest reads `data.len()` bytes from `device` at `offset`: fill `data`.
    fn read(
        &mut self,
        device: Self::Device,
        offset: u16,
        data: &mut [u8],
    ) -> Result<Flow, Self::Error>;

    /// Device windows and absent memory where there is no slot (none by default).
    fn mmio(&self) -> Option<&MmioBus> {
        None
    }

    /// The guest reads `data.len()` bytes of MMIO device `device` at `offset`: fill `data`.
    fn mmio_read(
        &mut self,
        device: usize,
        offset: u64,
        data: &mut [u8],
    ) -> Result<Flow, Self::Error> {
        let _ = (device, offset);
        data.fill(0xff);
        Ok(Flow::Continue)
    }

    /// The guest writes `data` to MMIO device `device` at `offset`.
    fn mmio_write(&mut self, device: usize, offset: u64, data: &[u8]) -> Result<Flow, Self::Error> {
        let _ = (device, offset, data);
        Ok(Flow::Continue)
    }

    /// The guest writes `data` to `device` at `offset`. `vcpu` is the vCPU, out of
    /// `KVM_RUN`: a device that blocks here (the test guest between commands) may read or set
    /// its state meanwhile.
    fn write(
        &mut self,
        vcpu: &VcpuFd,
        device: Self::Device,
        offset: u16,
        data: &[u8],
    ) -> Result<Flow, Self::Error>;
}

/// Why a vCPU stopped other than by request; `E` is the guest kind's device error.
#[derive(Debug, thiserror::Error)]
pub enum VcpuError<E: std::error::Error + 'static> {
    /// `KVM_RUN` failed.
    #[error("vCPU {vcpu}: KVM_RUN failed: {source}")]
    Run {
        /// The vCPU.
        vcpu: usize,
        /// The kernel's error.
        source: kvm_ioctls::Error,
    },
    /// `KVM_EXIT_INTERNAL_ERROR` in guest ring 0 on a host that emulates it (kvm_pvm), with no
    /// slot change under way: the emulator met an instruction it does not have.
    #[error("vCPU {vcpu} at rip {rip:#x} (KVM suberror {suberror}): KVM could not emulate a guest instruction (KVM_EXIT_INTERNAL_ERROR) and no slot change was under way; on a host without hardware virtualisation (kvm_pvm) guest ring 0 runs in KVM's instruction emulator, which lacks some instructions: a limitation of the host, not a VMM crash")]
    HostLimitation {
        /// The vCPU.
        vcpu: usize,
        /// The guest's instruction pointer.
        rip: u64,
        /// KVM's `internal.suberror` (1: emulation failure).
        suberror: u32,
    },
    /// `KVM_EXIT_INTERNAL_ERROR`, emulation failure, with no slot change under way, where the
    /// host runs the guest's instructions itself (hardware virtualisation, or guest ring 3):
    /// most likely the guest ran an instruction KVM's emulator lacks where it has no memory.
    #[error("vCPU {vcpu} at rip {rip:#x} (ring {cpl}): KVM could not emulate a guest instruction (KVM_EXIT_INTERNAL_ERROR, emulation failure) and no slot change was under way: most likely the guest ran an instruction KVM's emulator lacks (a VEX/AVX load or store, an instruction fetch) at a guest address with no memory slot (a device window, or memory that is not there), not a limitation of the host")]
    EmulationFailure {
        /// The vCPU.
        vcpu: usize,
        /// The guest's instruction pointer.
        rip: u64,
        /// The guest's privilege level (CS.DPL).
        cpl: u8,
    },
    /// The guest triple-faulted (or a reset by triple fault, `reboot=t`).
    #[error("vCPU {vcpu}: the guest shut down (triple fault) at rip {rip:#x}")]
    TripleFault {
        /// The vCPU.
        vcpu: usize,
        /// Its instruction pointer.
        rip: u64,
    },
    /// The exit handler gave up.
    #[error("vCPU {vcpu}: {error}")]
    Exit {
        /// The vCPU.
        vcpu: usize,
        /// Why.
        error: ExitError,
    },
    /// Finishing an access against the memory map failed.
    #[error("vCPU {vcpu}: finishing an access at {gpa:#x} against memory failed: {source}")]
    Memory {
        /// The vCPU.
        vcpu: usize,
        /// The address.
        gpa: u64,
        /// vm-memory's error.
        source: vm_memory::GuestMemoryError,
    },
    /// Collecting the dirty rings when this vCPU's was full failed (the entries collected are
    /// kept for the next harvest).
    #[error("vCPU {vcpu}: its dirty ring is full, and collecting the rings failed: {source}")]
    DirtyRing {
        /// The vCPU.
        vcpu: usize,
        /// The manager's error.
        source: kvm_memslots::Error,
    },
    /// Guest memory was gone under the VM: its backing file (a file-backed restore's memory
    /// file) was truncated or replaced, and an access got `SIGBUS`.
    #[error(
        "vCPU {vcpu}: guest memory at {place} is gone: its backing file was truncated or \
         replaced under the VM; the VM stopped, and nothing of it can be saved"
    )]
    MemoryGone {
        /// The vCPU.
        vcpu: usize,
        /// Where: the guest address, the region and the file, as far as known.
        place: String,
    },
    /// A device of the guest kind stopped the vCPU.
    #[error("vCPU {vcpu}: {error}")]
    Device {
        /// The vCPU.
        vcpu: usize,
        /// The device's error.
        error: E,
    },
}

/// One vCPU, ready to run on its own thread.
#[derive(Debug)]
pub struct Vcpu<P> {
    /// Its index (and KVM vCPU id).
    pub index: usize,
    /// KVM's vCPU, set up.
    pub fd: VcpuFd,
    /// The guest's memory.
    pub memory: Arc<MemoryManager<KvmVm>>,
    /// Shared with the host.
    pub shared: Arc<VcpuShared>,
    /// The guest kind's ports.
    pub ports: P,
}

impl<P: VcpuPorts + 'static> Vcpu<P> {
    /// Starts the vCPU on a thread of its own (named `vcpuN`). When the loop ends, the thread
    /// passes its outcome to `finish`, then signals `stopped` (the event loop's wake-up) and
    /// returns what `finish` returned.
    pub fn spawn<T: Send + 'static>(
        self,
        stopped: Arc<EventFd>,
        finish: impl FnOnce(Result<(), VcpuError<P::Error>>) -> T + Send + 'static,
    ) -> std::io::Result<JoinHandle<T>> {
        std::thread::Builder::new()
            .name(format!("vcpu{}", self.index))
            .spawn(move || {
                // SAFETY: pthread_self has no preconditions.
                let me = unsafe { libc::pthread_self() };
                *self.shared.thread.lock().unwrap_or_else(|p| p.into_inner()) = Some(me);
                let shared = Arc::clone(&self.shared);
                STARTED
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .push(Arc::clone(&shared));
                let outcome = self.run();
                // No kick after this: whoever joins the thread may do so once it returns.
                *shared.thread.lock().unwrap_or_else(|p| p.into_inner()) = None;
                shared.finished.store(true, Ordering::Release);
                shared.pause.changed.notify_all();
                let outcome = finish(outcome);
                // The loop may have gone already; nothing is left to tell then.
                let _ = stopped.write(1);
                outcome
            })
    }
}

/// Host address `hva` as the guest and the operator know it: the guest address, its region,
/// and the file behind it.
fn gone_place(memory: &MemoryManager<KvmVm>, hva: u64) -> String {
    let Some(found) = memory
        .find_by_hva(kvm_memslots::HostAddress(hva))
        .into_iter()
        .next()
    else {
        return format!("host address {hva:#x}");
    };
    let file = memory
        .load()
        .get(found.slot)
        .and_then(|slot| slot.payload().memory().file_offset().cloned())
        .and_then(|fo| {
            std::fs::read_link(format!(
                "/proc/self/fd/{}",
                std::os::fd::AsRawFd::as_raw_fd(fo.file())
            ))
            .ok()
        })
        .map_or_else(String::new, |path| format!(", file {}", path.display()));
    format!(
        "guest address {:#x} (region {}{file})",
        found.gpa.0, found.region
    )
}

/// Guest memory whose file is shorter than the VM maps it (a file-backed restore's memory
/// file truncated or replaced under the VM): where, for the first such region. Asked when the
/// guest stops on an error a missing page would cause (KVM_RUN's `EFAULT`, a triple fault:
/// KVM found no page to map, and the guest, not the VMM, touched it).
fn cut_memory<K: KvmMemory>(memory: &MemoryManager<K>) -> Option<String> {
    memory.regions().into_iter().find_map(|region| {
        let cut = Cut::of(memory, &region)?;
        // The first guest address past the file's end.
        let first = region.gpa.0 + cut.len.saturating_sub(cut.start).min(region.size);
        Some(format!(
            "guest address {first:#x} and on ({})",
            cut.describe(&region)
        ))
    })
}

/// Where the guest touched memory KVM could not map (`KVM_EXIT_MEMORY_FAULT` at `gpa`), if it
/// is a file-backed region's page past its file's end: the exact guest address, the region and
/// the file.
fn cut_at<K: KvmMemory>(memory: &MemoryManager<K>, gpa: u64) -> Option<String> {
    let region = memory
        .regions()
        .into_iter()
        .find(|r| (r.gpa.0..r.gpa.0 + r.size).contains(&gpa))?;
    let cut = Cut::of(memory, &region)?;
    (cut.start + (gpa - region.gpa.0) >= cut.len)
        .then(|| format!("guest address {gpa:#x} ({})", cut.describe(&region)))
}

/// A file-backed region whose file is shorter than the VM maps it.
struct Cut {
    /// The file, as `/proc/self/fd` names it.
    path: String,
    /// Where the region starts in it.
    start: u64,
    /// The file's size now.
    len: u64,
}

impl Cut {
    fn of<K: KvmMemory>(memory: &MemoryManager<K>, region: &RegionInfo) -> Option<Cut> {
        let mapping = memory.region_memory(region.id)?;
        let file = mapping.file_offset()?;
        let len = file.file().metadata().ok()?.len();
        (len < file.start().saturating_add(region.size)).then(|| Cut {
            path: std::fs::read_link(format!(
                "/proc/self/fd/{}",
                std::os::fd::AsRawFd::as_raw_fd(file.file())
            ))
            .map_or_else(
                |_| "its file".to_owned(),
                |p| format!("file {}", p.display()),
            ),
            start: file.start(),
            len,
        })
    }

    /// The region, the file and how much of it is left.
    fn describe(&self, region: &RegionInfo) -> String {
        format!(
            "region {} [{:#x}, {:#x}), {}, now {} bytes where the VM maps {}",
            region.id,
            region.gpa.0,
            region.gpa.0 + region.size,
            self.path,
            self.len,
            self.start.saturating_add(region.size)
        )
    }
}

fn rip(fd: &VcpuFd) -> u64 {
    fd.get_regs().map(|r| r.rip).unwrap_or(u64::MAX)
}

/// `internal.suberror` of the run area, after a run that ended in `KVM_EXIT_INTERNAL_ERROR`.
fn internal_suberror(fd: &mut VcpuFd) -> u32 {
    let kvm_run = fd.get_kvm_run();
    // SAFETY: the last KVM_RUN ended in KVM_EXIT_INTERNAL_ERROR (the only caller's exit), for
    // which KVM fills the `internal` member of the union (`emulation_failure` shares its
    // first fields); reading a u32 of it is always defined.
    unsafe { kvm_run.__bindgen_anon_1.internal.suberror }
}

/// Waits while a slot change is being applied; false if the vCPU was asked to stop meanwhile.
fn wait_for_change(memory: &MemoryManager<KvmVm>, shared: &VcpuShared) -> bool {
    memory.wait_settled(|| shared.stop_requested()).is_some()
}

impl<P: VcpuPorts> Vcpu<P> {
    /// Runs the guest until the host asks the vCPU to stop or a device says so (`Ok`), or an
    /// error stops it.
    pub fn run(self) -> Result<(), VcpuError<P::Error>> {
        let Vcpu {
            index: vcpu,
            mut fd,
            memory,
            shared,
            mut ports,
        } = self;
        if ports.before_run(&fd) == Flow::Stop {
            return Ok(());
        }
        let ended = Self::exit_loop(vcpu, &mut fd, &memory, &shared, &mut ports);
        if ended.is_err() {
            // Where the guest was, for whoever reports the failure.
            let _ = shared.failed_rip.set(rip(&fd));
        }
        ended
    }

    /// Enters the guest and handles its exits until the host asks the vCPU to stop or a
    /// device says so (`Ok`), or an error stops it.
    fn exit_loop(
        vcpu: usize,
        fd: &mut VcpuFd,
        memory: &MemoryManager<KvmVm>,
        shared: &VcpuShared,
        ports: &mut P,
    ) -> Result<(), VcpuError<P::Error>> {
        let (mut immediate_exit, mut interrupted) = (false, false);
        loop {
            if shared.stop_requested() {
                return Ok(());
            }
            if let Some(hva) = super::memory_gone::memory_gone() {
                return Err(VcpuError::MemoryGone {
                    vcpu,
                    place: gone_place(memory, hva),
                });
            }
            // A pause parks the vCPU at a whole instruction: KVM finishes what the last exit
            // left pending (a port or MMIO read's data goes into the guest on the next entry)
            // in a run with `immediate_exit` set, which returns at once without entering the
            // guest. That run's return is the point to park at.
            if immediate_exit && interrupted {
                fd.set_kvm_immediate_exit(0);
                immediate_exit = false;
                if shared.pause_requested() && !shared.park(fd) {
                    return Ok(());
                }
                continue;
            }
            if !immediate_exit && shared.pause_requested() {
                fd.set_kvm_immediate_exit(1);
                immediate_exit = true;
            }
            let sequence_at_entry = memory.change_sequence();
            let (exit, buffer) = match Exit::from_kvm(fd.run()) {
                Ok(exit) => exit,
                // An access to unreachable memory under a slot (an unplugged virtio-mem block
                // in a plugged piece) that KVM did not say where: its slot goes, and the
                // access, run again, exits as absent memory. Bounded: once nothing is left to
                // isolate, the same fault is fatal. A file cut under the VM is named below
                // instead.
                Err(source)
                    if source.errno() == libc::EFAULT
                        && cut_memory(memory).is_none()
                        && ports.mmio().is_some_and(|bus| bus.isolate(None)) =>
                {
                    shared
                        .counters
                        .unreachable_isolated
                        .fetch_add(1, Ordering::Relaxed);
                    continue;
                }
                Err(source) => {
                    return Err(
                        match (source.errno() == libc::EFAULT).then(|| cut_memory(memory)) {
                            Some(Some(place)) => VcpuError::MemoryGone { vcpu, place },
                            _ => VcpuError::Run { vcpu, source },
                        },
                    )
                }
            };
            // kvm-ioctls leaves an internal error's suberror in the run area.
            let (exit, mut buffer) = match exit {
                Exit::InternalError { .. } => (Exit::with_suberror(internal_suberror(fd)), None),
                exit => (exit, buffer),
            };
            let counters = &shared.counters;
            counters.by_kind[exit.kind()].fetch_add(1, Ordering::Relaxed);
            // KVM said where: a page of a file cut under the VM is named exactly (other
            // memory faults are the handler's fatal error, with the address).
            if let Exit::MemoryFault { gpa, .. } = exit {
                if let Some(place) = cut_at(memory, gpa) {
                    return Err(VcpuError::MemoryGone { vcpu, place });
                }
                // Unreachable memory under a slot, as above, where KVM said where.
                if ports.mmio().is_some_and(|bus| bus.isolate(Some(gpa))) {
                    counters
                        .unreachable_isolated
                        .fetch_add(1, Ordering::Relaxed);
                    continue;
                }
            }
            interrupted = matches!(exit, Exit::Interrupted);
            let mmio = exit.is_mmio();
            let memory_error = |gpa: u64| move |source| VcpuError::Memory { vcpu, gpa, source };
            let action = loop {
                // A sequence and a map that agree (the manager re-reads the sequence around
                // the load). `load_consistent` borrows the version without a shared
                // reference-count update, so exits on several vCPUs do not contend.
                let (sequence_now, map) = memory.load_consistent();
                let expected_mmio = if mmio {
                    let window = shared.expected_mmio.lock();
                    window.unwrap_or_else(|p| p.into_inner()).clone()
                } else {
                    None
                };
                let ctx = ExitContext {
                    memory: &map,
                    sequence_at_entry,
                    sequence_now,
                    expected_mmio,
                    ports: ports.bus(),
                    mmio: ports.mmio(),
                };
                match handle_exit(&exit, &ctx) {
                    ExitAction::WaitForChange => {
                        // A slot is away for a moment: wait for the change (pinning no map
                        // version), then handle the exit again against the map afterwards.
                        drop(map);
                        if !wait_for_change(memory, shared) {
                            return Ok(());
                        }
                    }
                    ExitAction::WriteMemory { gpa, data } => {
                        GuestMemorySlots::of(&map)
                            .write_slice(&data, gpa)
                            .map_err(memory_error(gpa.0))?;
                        counters
                            .completed_after_change
                            .fetch_add(1, Ordering::Relaxed);
                        break ExitAction::Resume;
                    }
                    ExitAction::ReadMemory { gpa, len } => {
                        let buffer = buffer.as_deref_mut().expect("a read exit has a buffer");
                        GuestMemorySlots::of(&map)
                            .read_slice(&mut buffer[..len], gpa)
                            .map_err(memory_error(gpa.0))?;
                        counters
                            .completed_after_change
                            .fetch_add(1, Ordering::Relaxed);
                        break ExitAction::Resume;
                    }
                    // The map version is let go here: what follows may block.
                    action => break action,
                }
            };
            let device_error = |error| VcpuError::Device { vcpu, error };
            let flow = match action {
                ExitAction::Resume => Flow::Continue,
                ExitAction::RetryAfterChange => {
                    // KVM left RIP on the instruction: the next entry runs it, against the
                    // slots as they are now.
                    counters
                        .retried_after_change
                        .fetch_add(1, Ordering::Relaxed);
                    Flow::Continue
                }
                ExitAction::CountExpected => {
                    if let Some(buffer) = buffer {
                        buffer.fill(0xff);
                    }
                    counters.expected.fetch_add(1, Ordering::Relaxed);
                    Flow::Continue
                }
                ExitAction::DropReadOnlyWrite => {
                    counters.read_only_writes.fetch_add(1, Ordering::Relaxed);
                    Flow::Continue
                }
                ExitAction::CollectDirtyRings => {
                    // Never fatal: the entries go into the regions' pending bits for the next
                    // harvest, and the guest goes on.
                    memory
                        .collect_dirty_rings()
                        .map_err(|source| VcpuError::DirtyRing { vcpu, source })?;
                    Flow::Continue
                }
                ExitAction::ReadAllOnes => {
                    if let Some(buffer) = buffer {
                        buffer.fill(0xff);
                    }
                    Flow::Continue
                }
                ExitAction::AbsentMemory => {
                    if let Some(buffer) = buffer {
                        buffer.fill(0xff);
                    }
                    if counters.absent_memory.fetch_add(1, Ordering::Relaxed) == 0 {
                        let gpa = match exit {
                            Exit::MmioRead { gpa, .. } | Exit::MmioWrite { gpa, .. } => gpa,
                            _ => 0,
                        };
                        eprintln!(
                            "tinyvmm: vCPU {vcpu} touched absent (unplugged) memory at {gpa:#x}; \
                             reads see all ones, writes are dropped (reported once per vCPU)"
                        );
                    }
                    Flow::Continue
                }
                ExitAction::MmioRead { device, offset } => {
                    let buffer = buffer.expect("an MMIO read has a buffer");
                    ports
                        .mmio_read(device, offset, buffer)
                        .map_err(device_error)?
                }
                ExitAction::MmioWrite { device, offset } => {
                    let Exit::MmioWrite { data, .. } = exit else {
                        unreachable!("an MMIO write comes from an MmioWrite exit")
                    };
                    // At most 8 bytes: copied out of the run area, as for ports.
                    let mut bytes = [0u8; 8];
                    let len = data.len().min(bytes.len());
                    bytes[..len].copy_from_slice(&data[..len]);
                    ports
                        .mmio_write(device, offset, &bytes[..len])
                        .map_err(device_error)?
                }
                ExitAction::PortRead { device, offset } => {
                    let buffer = buffer.expect("a port read has a buffer");
                    ports.read(device, offset, buffer).map_err(device_error)?
                }
                ExitAction::PortWrite { device, offset } => {
                    let Exit::IoOut { data, .. } = exit else {
                        unreachable!("a port write comes from an IoOut exit")
                    };
                    // A port write is at most 4 bytes: copy it out of the run area, so that
                    // the device may use the vCPU itself.
                    let mut bytes = [0u8; 8];
                    let len = data.len().min(bytes.len());
                    bytes[..len].copy_from_slice(&data[..len]);
                    ports
                        .write(fd, device, offset, &bytes[..len])
                        .map_err(device_error)?
                }
                ExitAction::Fatal(ExitError::EmulationFailure) => {
                    let rip = rip(fd);
                    let cpl = fd.get_sregs().map_or(0, |s| s.cs.dpl);
                    // Guest ring 0 in KVM's emulator (kvm_pvm) meets instructions it lacks
                    // anywhere; elsewhere the emulator mostly runs accesses with no slot.
                    if cpl == 0 && super::host_emulates_ring0() {
                        return Err(VcpuError::HostLimitation {
                            vcpu,
                            rip,
                            suberror: super::exit::KVM_INTERNAL_ERROR_EMULATION,
                        });
                    }
                    return Err(VcpuError::EmulationFailure { vcpu, rip, cpl });
                }
                ExitAction::Fatal(ExitError::Shutdown) => {
                    if let Some(place) = cut_memory(memory) {
                        return Err(VcpuError::MemoryGone { vcpu, place });
                    }
                    let rip = rip(fd);
                    return Err(VcpuError::TripleFault { vcpu, rip });
                }
                ExitAction::Fatal(error) => return Err(VcpuError::Exit { vcpu, error }),
                ExitAction::WaitForChange
                | ExitAction::WriteMemory { .. }
                | ExitAction::ReadMemory { .. } => unreachable!("handled with the map above"),
            };
            if flow == Flow::Stop {
                return Ok(());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A memory fault on a page of a file cut under the VM names that guest address, the
    /// region and the file; a page the file still has, or memory with no file, is not taken
    /// for cut memory.
    #[test]
    fn a_memory_fault_past_a_cut_files_end_names_the_guest_address_and_the_file() {
        use kvm_memslots::testing::FakeKvm;
        use kvm_memslots::{Backing, RegionSpec};
        use vm_memory::{FileOffset, GuestAddress};
        const BASE: u64 = 0x10_0000;
        let path = std::env::temp_dir().join(format!("tinyvmm-cut-at-{}", std::process::id()));
        let file = std::fs::File::options()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .expect("a file");
        file.set_len(0x8000).expect("sized");
        let memory = MemoryManager::new(FakeKvm::new(8, false));
        let backing = Backing::PrivateFile(FileOffset::new(file.try_clone().expect("dup"), 0));
        memory
            .add_region(RegionSpec::new(GuestAddress(BASE), 0x8000).with_backing(backing))
            .expect("a file region");
        memory
            .add_region(RegionSpec::new(GuestAddress(0x20_0000), 0x1000))
            .expect("an anonymous region");
        assert_eq!(cut_at(&memory, BASE + 0x6000), None, "the file is whole");
        file.set_len(0x3000).expect("cut");
        let place = cut_at(&memory, BASE + 0x6010).expect("a page past the end");
        let _ = std::fs::remove_file(&path);
        assert!(
            place.starts_with("guest address 0x106010 (region 0 [0x100000, 0x108000), file "),
            "{place}"
        );
        assert!(
            place.contains(&path.display().to_string())
                && place.ends_with("now 12288 bytes where the VM maps 32768)"),
            "{place}"
        );
        assert_eq!(cut_at(&memory, BASE + 0x2fff), None, "a page the file has");
        assert_eq!(cut_at(&memory, 0x20_0000), None, "memory with no file");
        assert_eq!(cut_at(&memory, 0x30_0000), None, "no memory");
        // Without KVM's address, the first address past the end, as before.
        let first = cut_memory(&memory).expect("cut memory");
        assert!(
            first.starts_with("guest address 0x103000 and on (region 0 "),
            "{first}"
        );
    }

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
