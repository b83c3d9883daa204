//! Booting a Linux kernel on kvm-memslots, with the e820 map built from the memory manager's
//! regions.
//!
//! [`boot`] goes: create the VM with the in-kernel irqchip and PIT; give it RAM as regions split
//! into KVM slots ([`layout::ram_regions`]); build the e820 map from the manager's regions
//! ([`e820::build`]); load the kernel, command line and initramfs and write the boot parameters
//! ([`loader::load`]), the MP table ([`mptable`]), the GDT and page tables; create the vCPUs
//! (CPUID, MSRs, FPU, LAPIC, entry registers: [`cpu`]); then run them while the event loop
//! carries console input and waits for the guest's reset, a vCPU stopping, a signal or the
//! timeout. See `docs/BOOT.md`.

pub mod config;
pub mod cpu;
pub mod e820;
pub mod layout;
pub mod loader;
pub mod mptable;
pub mod run;

use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::vm::vcpu::{install_kick_handler, kick_until_finished};
use kvm_bindings::{kvm_pit_config, KVM_PIT_SPEAKER_DUMMY};
use kvm_ioctls::Kvm;
use kvm_memslots::{KvmVm, MemoryManager, RegionSpec};

pub use config::{BootConfig, BootProtocol, ConfigError};
pub use e820::{E820Entry, E820Kind};
pub use loader::{KernelFormat, LoadError};
pub use run::GuestStop;

use crate::devices::legacy::{ConsoleOutput, DeviceError, LegacyDevices, SERIAL_IRQ};
use crate::lifecycle::{EventLoop, LoopError};
use run::{ConsoleSubscriber, LinuxVcpu, RawTerminal};

/// Why a boot could not start (or the VMM failed while it ran).
#[derive(Debug, thiserror::Error)]
pub enum BootError {
    /// The configuration is not valid.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// `/dev/kvm` could not be opened.
    #[error("cannot open /dev/kvm: {0}")]
    Kvm(kvm_ioctls::Error),
    /// A KVM ioctl of the set-up failed.
    #[error("{what} failed: {source}")]
    Setup {
        /// What was being set up.
        what: &'static str,
        /// The kernel's error.
        source: kvm_ioctls::Error,
    },
    /// The memory manager refused the RAM.
    #[error("giving the guest its RAM failed: {0}")]
    Memory(#[from] kvm_memslots::Error),
    /// The kernel, initramfs or boot parameters could not be loaded.
    #[error(transparent)]
    Load(#[from] LoadError),
    /// The MP table could not be written.
    #[error(transparent)]
    MpTable(#[from] mptable::MpTableError),
    /// A vCPU could not be set up.
    #[error(transparent)]
    Cpu(#[from] cpu::CpuError),
    /// A device could not be created.
    #[error(transparent)]
    Device(#[from] DeviceError),
    /// The event loop could not be set up.
    #[error(transparent)]
    Loop(#[from] LoopError),
    /// A vCPU thread could not be started.
    #[error("starting vCPU thread {vcpu} failed: {source}")]
    Thread {
        /// The vCPU.
        vcpu: u8,
        /// The system's error.
        source: std::io::Error,
    },
}

/// How a boot ended.
#[derive(Debug)]
pub enum BootEnding {
    /// The guest asked the i8042 for a reset (`reboot=k`): a clean end.
    Reset,
    /// A vCPU stopped on its own: the guest's fault or the host's limitation.
    GuestStopped(GuestStop),
    /// The timeout came first.
    Timeout,
    /// SIGINT or SIGTERM.
    Interrupted,
    /// The caller asked for a stop ([`Console::stop`]).
    Stopped,
}

impl BootEnding {
    /// The process exit code for it: 0 reset, 2 the guest stopped on an error, 3 the host's
    /// limitation (`KVM_EXIT_INTERNAL_ERROR` on kvm_pvm), 124 timeout (as timeout(1)), 130
    /// interrupted. (1 is a VMM error before or outside the run.)
    pub fn exit_code(&self) -> u8 {
        match self {
            BootEnding::Reset | BootEnding::Stopped => 0,
            BootEnding::GuestStopped(GuestStop::HostLimitation { .. }) => 3,
            BootEnding::GuestStopped(_) => 2,
            BootEnding::Timeout => 124,
            BootEnding::Interrupted => 130,
        }
    }
}

impl std::fmt::Display for BootEnding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BootEnding::Reset => write!(f, "the guest reset the machine (i8042)"),
            BootEnding::GuestStopped(stop) => write!(f, "{stop}"),
            BootEnding::Timeout => write!(f, "timed out: the VM was stopped"),
            BootEnding::Interrupted => write!(f, "interrupted by a signal: the VM was stopped"),
            BootEnding::Stopped => write!(f, "stopped on request"),
        }
    }
}

/// What the VMM built and how the run ended.
#[derive(Debug)]
pub struct BootReport {
    /// How it ended.
    pub ending: BootEnding,
    /// The kernel's format.
    pub format: KernelFormat,
    /// The e820 map the kernel was given, whole.
    pub e820: Vec<E820Entry>,
    /// How many of its ranges were in the zero page; the rest were in `SETUP_E820_EXT`.
    pub zero_page_entries: usize,
    /// The `SETUP_E820_EXT` entry's address and length, if there was one.
    pub setup_data: Option<(u64, u64)>,
    /// The command line.
    pub cmdline: String,
    /// Where the initramfs went and its size, if there was one.
    pub initramfs: Option<(u64, u64)>,
    /// RAM regions and the KVM slots they took.
    pub regions: usize,
    /// KVM slots of RAM.
    pub slots: usize,
    /// Time from the start of [`boot`] to entering the guest.
    pub setup_time: Duration,
}

/// What the VMM prints about the boot before it starts the guest.
pub fn describe(report: &BootReport) -> String {
    let mut text = format!(
        "tinyvmm: {} RAM regions in {} KVM slots; e820 map of {} ranges ({} in the zero page{}); command line: {}\n",
        report.regions,
        report.slots,
        report.e820.len(),
        report.zero_page_entries,
        match report.setup_data {
            Some((addr, len)) => format!(", the rest in SETUP_E820_EXT at {addr:#x}, {len} bytes"),
            None => String::new(),
        },
        report.cmdline
    );
    for line in e820::kernel_lines(&report.e820, "e820") {
        text.push_str("tinyvmm: ");
        text.push_str(&line);
        text.push('\n');
    }
    text
}

/// Where the console goes and comes from.
pub struct Console {
    /// The serial console's output.
    pub output: ConsoleOutput,
    /// Read console input from the process's stdin (only when it is a terminal).
    pub stdin: bool,
    /// Set by the caller to stop the VM (for example once the console showed what it waited
    /// for); the boot then ends as [`BootEnding::Stopped`].
    pub stop: Option<Arc<AtomicBool>>,
}

/// Boots `config`'s kernel and runs it until it resets, a vCPU stops, a signal or the timeout.
/// `on_start` sees the report (ending aside) just before the vCPUs start.
pub fn boot(
    config: &BootConfig,
    console: Console,
    on_start: impl FnOnce(&BootReport),
) -> Result<BootReport, BootError> {
    let started = Instant::now();
    config.validate()?;
    let Console {
        output,
        stdin,
        stop: stop_request,
    } = console;
    let setup = |what| move |source| BootError::Setup { what, source };
    let kvm = Kvm::new().map_err(BootError::Kvm)?;
    let vm = Arc::new(kvm.create_vm().map_err(setup("KVM_CREATE_VM"))?);
    // Intel's VMX needs three pages for real mode's TSS below 4 GiB; in the MMIO gap.
    vm.set_tss_address(0xfffb_d000)
        .map_err(setup("KVM_SET_TSS_ADDR"))?;
    // The irqchip (PIC, IOAPIC, local APICs) comes before any vCPU.
    vm.create_irq_chip().map_err(setup("KVM_CREATE_IRQCHIP"))?;
    let pit = kvm_pit_config {
        flags: KVM_PIT_SPEAKER_DUMMY,
        ..Default::default()
    };
    vm.create_pit2(pit).map_err(setup("KVM_CREATE_PIT2"))?;

    let kvm_vm =
        KvmVm::new(&kvm, Arc::clone(&vm)).map_err(setup("enabling dirty-log protection"))?;
    let memory = Arc::new(MemoryManager::new(kvm_vm));
    for region in layout::ram_regions(config) {
        memory.add_region(
            RegionSpec::new(region.gpa, region.size).with_slot_size(region.slot_size),
        )?;
    }
    let regions = memory.regions();
    let e820 = e820::build(&regions);
    let snapshot = memory.snapshot();
    let loaded = loader::load(
        &*snapshot,
        &config.kernel,
        config.initramfs.as_deref(),
        &config.cmdline,
        e820,
        config.protocol,
    )?;
    cpu::write_tables(&*snapshot, loaded.entry)?;
    mptable::write(&*snapshot, config.vcpus)?;
    drop(snapshot);

    let serial_irq = LegacyDevices::eventfd("serial interrupt")?;
    let reset = LegacyDevices::eventfd("i8042 reset")?;
    vm.register_irqfd(&serial_irq, SERIAL_IRQ)
        .map_err(setup("KVM_IRQFD for the serial console"))?;
    let devices = Arc::new(LegacyDevices::new(
        output,
        serial_irq,
        reset
            .try_clone()
            .map_err(|e| BootError::Device(DeviceError::new("i8042 reset", e)))?,
    ));
    let bus = Arc::new(LegacyDevices::bus());

    let mut event_loop = EventLoop::new()?;
    let stopped = Arc::clone(&event_loop.context().vcpu_stopped);
    let terminal = if stdin {
        RawTerminal::new(std::io::stdin().as_raw_fd())
    } else {
        None
    };
    let reset_seen = Arc::new(AtomicBool::new(false));
    event_loop.add(Arc::new(Mutex::new(ConsoleSubscriber {
        devices: Arc::clone(&devices),
        reset,
        reset_seen: Arc::clone(&reset_seen),
        input: terminal.as_ref().map(|_| std::io::stdin().as_raw_fd()),
    })));

    install_kick_handler();
    let stop = Arc::new(AtomicBool::new(false));
    let mut vcpus = Vec::new();
    for index in 0..config.vcpus {
        let fd = vm
            .create_vcpu(u64::from(index))
            .map_err(setup("KVM_CREATE_VCPU"))?;
        cpu::setup_vcpu(&kvm, &fd, index, config.vcpus, loaded.entry)?;
        vcpus.push(LinuxVcpu {
            index,
            fd,
            memory: Arc::clone(&memory),
            devices: Arc::clone(&devices),
            bus: Arc::clone(&bus),
            stop: Arc::clone(&stop),
            stopped: Arc::clone(&stopped),
        });
    }

    let mut report = BootReport {
        ending: BootEnding::Timeout,
        format: loaded.format,
        zero_page_entries: loaded.zero_page_entries,
        setup_data: loaded.setup_data.map(|(a, l)| (a.0, l)),
        e820: loaded.e820,
        cmdline: loaded.cmdline,
        initramfs: loaded.initramfs.map(|(a, l)| (a.0, l)),
        regions: regions.len(),
        slots: regions.iter().map(|r| r.slots).sum(),
        setup_time: started.elapsed(),
    };
    on_start(&report);

    let mut threads: Vec<JoinHandle<Result<(), GuestStop>>> = Vec::new();
    for vcpu in vcpus {
        let index = vcpu.index;
        match std::thread::Builder::new()
            .name(format!("vcpu{index}"))
            .spawn(move || vcpu.run())
        {
            Ok(thread) => threads.push(thread),
            Err(source) => {
                stop_vcpus(&stop, threads);
                return Err(BootError::Thread {
                    vcpu: index,
                    source,
                });
            }
        }
    }

    let deadline = config
        .timeout_secs
        .map(|t| Instant::now() + Duration::from_secs_f64(t));
    let ending = loop {
        let wait = match deadline {
            Some(d) => d.saturating_duration_since(Instant::now()),
            None => Duration::from_secs(1),
        };
        // A caller's stop request is polled.
        let most = if stop_request.is_some() { 20 } else { 1000 };
        let wait_ms = wait.as_millis().clamp(1, most) as i32;
        if event_loop.dispatch(wait_ms) == Some(crate::lifecycle::Ending::Interrupted) {
            break BootEnding::Interrupted;
        }
        if reset_seen.load(Ordering::Acquire) {
            break BootEnding::Reset;
        }
        if stop_request
            .as_ref()
            .is_some_and(|s| s.load(Ordering::Acquire))
        {
            break BootEnding::Stopped;
        }
        if let Some(at) = threads.iter().position(|t| t.is_finished()) {
            let thread = threads.swap_remove(at);
            match thread.join() {
                Ok(Err(stop)) => break BootEnding::GuestStopped(stop),
                // A vCPU that stopped without an error was asked to: keep going.
                Ok(Ok(())) => {}
                Err(panic) => std::panic::resume_unwind(panic),
            }
            if threads.is_empty() {
                break BootEnding::Timeout;
            }
        }
        if deadline.is_some_and(|d| Instant::now() >= d) {
            break BootEnding::Timeout;
        }
    };
    stop_vcpus(&stop, threads);
    devices.flush();
    drop(terminal);
    report.ending = ending;
    Ok(report)
}

/// Stops every vCPU thread (a flag, then kicks out of `KVM_RUN`) and joins them.
fn stop_vcpus(stop: &AtomicBool, threads: Vec<JoinHandle<Result<(), GuestStop>>>) {
    stop.store(true, Ordering::Release);
    for thread in threads {
        // Its outcome no longer matters: the run's ending is decided. A vCPU that does not
        // leave the guest within 10 s is left behind rather than waited for forever.
        if kick_until_finished(&thread, Duration::from_secs(10)) {
            let _ = thread.join();
        }
    }
}
