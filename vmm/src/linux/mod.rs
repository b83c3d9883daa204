//! Booting a Linux kernel on kvm-memslots, with the e820 map built from the memory manager's
//! regions.
//!
//! [`LinuxVm::new`] creates the VM with the in-kernel irqchip and PIT; gives it RAM as regions
//! split into KVM slots ([`layout::ram_regions`]); builds the e820 map from the manager's
//! regions ([`e820::build`]); loads the kernel, command line and initramfs and writes the boot
//! parameters ([`loader::load`]), the ACPI tables ([`acpi`]) and the MP table ([`mptable`]), the
//! GDT and page tables. [`LinuxVm::create_vcpus`] creates the vCPUs (CPUID, MSRs, FPU, LAPIC,
//! entry registers: [`cpu`]). The boot job (`jobs::boot`) then runs them while the event loop
//! carries console input ([`console`]) and the API socket ([`controller`]), and waits for the
//! guest's reset, a vCPU stopping, a signal or the timeout. See `docs/BOOT.md`.

pub mod acpi;
pub mod config;
pub mod console;
pub mod controller;
pub mod cpu;
pub mod e820;
pub mod hotplug;
pub mod layout;
pub mod loader;
pub mod mptable;
pub mod ports;

use std::os::fd::RawFd;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use kvm_memslots::{KvmVm, MemoryManager, RegionSpec};
use vmm_sys_util::eventfd::EventFd;

use crate::vm::ports::PortBus;
use crate::vm::vcpu::{kick_until_finished, Vcpu, VcpuShared};
use crate::vm::{Vm, VmError, VmOptions};

pub use config::{BootConfig, BootProtocol, ConfigError};
pub use e820::{E820Entry, E820Kind};
pub use loader::{KernelFormat, LoadError};
pub use ports::GuestStop;

use crate::devices::legacy::{ConsoleOutput, DeviceError, LegacyDevice, LegacyDevices, SERIAL_IRQ};
use console::ConsoleSubscriber;
use hotplug::VirtioMemDevice;
use loader::Entry;
use ports::LinuxPorts;

/// Why a boot could not start (or the VMM failed while it ran).
#[derive(Debug, thiserror::Error)]
pub enum BootError {
    /// The configuration is not valid.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// Creating or setting up the VM failed.
    #[error(transparent)]
    Vm(#[from] VmError),
    /// The memory manager refused the RAM.
    #[error("giving the guest its RAM failed: {0}")]
    Memory(#[from] kvm_memslots::Error),
    /// The kernel, initramfs or boot parameters could not be loaded.
    #[error(transparent)]
    Load(#[from] LoadError),
    /// The MP table could not be written.
    #[error(transparent)]
    MpTable(#[from] mptable::MpTableError),
    /// The ACPI tables could not be written.
    #[error(transparent)]
    Acpi(#[from] acpi::AcpiError),
    /// A vCPU could not be set up.
    #[error(transparent)]
    Cpu(#[from] cpu::CpuError),
    /// A device could not be created.
    #[error(transparent)]
    Device(#[from] DeviceError),
    /// The hotplug device could not be set up.
    #[error(transparent)]
    Hotplug(#[from] hotplug::HotplugError),
    /// A vCPU thread could not be started.
    #[error("starting vCPU thread {vcpu} failed: {source}")]
    Thread {
        /// The vCPU.
        vcpu: usize,
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
    /// The caller asked for a stop ([`Console::stop`]), or a client did (`PUT /actions`).
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
    /// The ACPI RSDP's address, if the guest has ACPI tables.
    pub rsdp: Option<u64>,
    /// RAM regions and the KVM slots they took.
    pub regions: usize,
    /// KVM slots of RAM.
    pub slots: usize,
    /// Time from the start of the boot (`jobs::boot::boot`) to entering the guest.
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

impl std::fmt::Debug for Console {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Console")
            .field("stdin", &self.stdin)
            .field("stop", &self.stop)
            .finish_non_exhaustive()
    }
}

/// A Linux guest set up to boot: its VM, RAM, tables and loaded kernel, its devices and, once
/// [`LinuxVm::create_vcpus`] ran, its vCPUs; nothing runs yet. The boot job
/// (`jobs::boot`) runs it under the event loop.
#[derive(Debug)]
pub struct LinuxVm {
    vm: Vm,
    devices: Arc<LegacyDevices>,
    reset: EventFd,
    hotplug: Option<hotplug::Hotplug>,
    bus: Arc<PortBus<LegacyDevice>>,
    entry: Entry,
}

impl LinuxVm {
    /// Validates `config`, creates the VM, gives it RAM, builds the e820 map, sets the hotplug
    /// device up, writes the ACPI tables, loads the kernel, writes the page tables and the MP
    /// table, and creates the serial console (writing to `output`) and the i8042. Returns it
    /// with the report of what was built (its ending and set-up time still to fill in).
    pub fn new(
        config: &BootConfig,
        output: ConsoleOutput,
    ) -> Result<(Self, BootReport), BootError> {
        config.validate()?;
        let vm = Vm::new(VmOptions {
            irqchip: true,
            limits: config.limits,
            ..VmOptions::default()
        })?;
        let memory = vm.memory();
        for region in layout::ram_regions(config) {
            memory.add_region(
                RegionSpec::new(region.gpa, region.size).with_slot_size(region.slot_size),
            )?;
        }
        let regions = memory.regions();
        let e820 = e820::build(&regions);
        // The hotplug area has no region until the guest plugs: it stays out of the e820 map.
        let hotplug = match config.hotplug_mib {
            0 => None,
            mib => Some(hotplug::setup(&vm, mib, config.hotplug_block_mib)?),
        };
        let mut cmdline = config.cmdline.clone();
        if let Some(hotplug) = &hotplug {
            cmdline.push_str(&hotplug.cmdline(config.acpi));
        }
        let snapshot = memory.current();
        let rsdp = if config.acpi {
            let windows: Vec<acpi::MmioDevice> = hotplug.iter().map(|h| h.window).collect();
            Some(acpi::write(&*snapshot, config.vcpus, &windows)?.rsdp())
        } else {
            None
        };
        let loaded = loader::load(
            &*snapshot,
            &config.kernel,
            config.initramfs.as_deref(),
            &cmdline,
            e820,
            config.protocol,
            rsdp,
        )?;
        cpu::write_tables(&*snapshot, loaded.entry)?;
        mptable::write(&*snapshot, config.vcpus)?;
        drop(snapshot);

        let serial_irq = LegacyDevices::eventfd("serial interrupt")?;
        let reset = LegacyDevices::eventfd("i8042 reset")?;
        vm.fd()
            .register_irqfd(&serial_irq, SERIAL_IRQ)
            .map_err(VmError::setup("KVM_IRQFD for the serial console"))?;
        let devices = Arc::new(LegacyDevices::new(
            output,
            serial_irq,
            reset
                .try_clone()
                .map_err(|e| BootError::Device(DeviceError::new("i8042 reset", e)))?,
        ));
        let report = BootReport {
            ending: BootEnding::Timeout,
            format: loaded.format,
            zero_page_entries: loaded.zero_page_entries,
            setup_data: loaded.setup_data.map(|(a, l)| (a.0, l)),
            e820: loaded.e820,
            cmdline: loaded.cmdline,
            initramfs: loaded.initramfs.map(|(a, l)| (a.0, l)),
            rsdp: rsdp.map(|a| a.0),
            regions: regions.len(),
            slots: regions.iter().map(|r| r.slots).sum(),
            setup_time: Duration::ZERO,
        };
        let linux = LinuxVm {
            vm,
            devices,
            reset,
            hotplug,
            bus: Arc::new(LegacyDevices::bus()),
            entry: loaded.entry,
        };
        Ok((linux, report))
    }

    /// The guest's memory.
    pub fn memory(&self) -> &Arc<MemoryManager<KvmVm>> {
        self.vm.memory()
    }

    /// The virtio-mem device, if the guest has one.
    pub fn hotplug_device(&self) -> Option<VirtioMemDevice> {
        self.hotplug.as_ref().map(|h| Arc::clone(&h.device))
    }

    /// The event loop's part of the guest: console input from `input` (a terminal) into the
    /// serial FIFO, and the i8042's reset line, which sets `reset_seen`.
    pub fn console(
        &self,
        reset_seen: Arc<AtomicBool>,
        input: Option<RawFd>,
    ) -> Result<ConsoleSubscriber, BootError> {
        Ok(ConsoleSubscriber {
            devices: Arc::clone(&self.devices),
            reset: self
                .reset
                .try_clone()
                .map_err(|e| BootError::Device(DeviceError::new("i8042 reset", e)))?,
            reset_seen,
            input,
        })
    }

    /// Creates and sets up `config`'s vCPUs; returns them, not yet running.
    pub fn create_vcpus(&self, config: &BootConfig) -> Result<LinuxVcpus, BootError> {
        let ports = LinuxPorts {
            devices: Arc::clone(&self.devices),
            bus: Arc::clone(&self.bus),
            hotplug: self
                .hotplug
                .as_ref()
                .map(|h| (Arc::clone(&h.device), Arc::clone(&h.mmio))),
        };
        let mut vcpus = Vec::new();
        for index in 0..config.vcpus {
            let fd = self.vm.create_vcpu(usize::from(index))?;
            cpu::setup_vcpu(self.vm.kvm(), &fd, index, config.vcpus, self.entry)?;
            vcpus.push(Vcpu {
                index: usize::from(index),
                fd,
                memory: Arc::clone(self.memory()),
                shared: Arc::new(VcpuShared::default()),
                ports: ports.clone(),
            });
        }
        Ok(LinuxVcpus(vcpus))
    }

    /// Writes out what the serial console holds.
    pub fn flush_console(&self) {
        self.devices.flush();
    }
}

/// A Linux guest's vCPUs, created and set up, not yet running.
#[derive(Debug)]
pub struct LinuxVcpus(Vec<Vcpu<LinuxPorts>>);

impl LinuxVcpus {
    /// Starts a thread for each vCPU on the shared exit loop; each tells `stopped` when it
    /// stops. If one cannot start, those started are stopped again.
    pub fn start(self, stopped: &Arc<EventFd>) -> Result<RunningVcpus, BootError> {
        let mut threads: Vec<VcpuThread> = Vec::new();
        for vcpu in self.0 {
            let index = vcpu.index;
            let shared = Arc::clone(&vcpu.shared);
            match vcpu.spawn(Arc::clone(stopped), |outcome| outcome) {
                Ok(thread) => threads.push((thread, shared)),
                Err(source) => {
                    RunningVcpus(threads).stop();
                    return Err(BootError::Thread {
                        vcpu: index,
                        source,
                    });
                }
            }
        }
        Ok(RunningVcpus(threads))
    }
}

/// A Linux vCPU's thread and what it shares with the host.
type VcpuThread = (JoinHandle<Result<(), GuestStop>>, Arc<VcpuShared>);

/// A Linux guest's running vCPU threads.
#[derive(Debug)]
pub struct RunningVcpus(Vec<VcpuThread>);

impl RunningVcpus {
    /// How the run ended, if a vCPU's end decides it: a vCPU that stopped on its own
    /// ([`BootEnding::GuestStopped`]), or every vCPU gone ([`BootEnding::Timeout`]). Joins at
    /// most one finished thread a call; a vCPU that stopped without an error was asked to.
    pub fn ended(&mut self) -> Option<BootEnding> {
        let at = self.0.iter().position(|(t, _)| t.is_finished())?;
        let (thread, _) = self.0.swap_remove(at);
        match thread.join() {
            Ok(Err(stop)) => return Some(BootEnding::GuestStopped(stop)),
            // A vCPU that stopped without an error was asked to: keep going.
            Ok(Ok(())) => {}
            Err(panic) => std::panic::resume_unwind(panic),
        }
        self.0.is_empty().then_some(BootEnding::Timeout)
    }

    /// Stops every vCPU thread (a flag, then kicks out of `KVM_RUN`) and joins them.
    pub fn stop(self) {
        for (_, shared) in &self.0 {
            shared.request_stop();
        }
        for (thread, _) in self.0 {
            // Its outcome no longer matters: the run's ending is decided. A vCPU that does not
            // leave the guest within 10 s is left behind rather than waited for forever.
            if kick_until_finished(&thread, Duration::from_secs(10)) {
                let _ = thread.join();
            }
        }
    }
}
