//! Booting a Linux kernel on kvm-memslots, with the e820 map built from the memory manager's
//! regions.
//!
//! `LinuxVm::new` creates the VM with the in-kernel irqchip and PIT; gives it RAM as regions
//! split into KVM slots (`ram::ram_regions`); builds the e820 map from the manager's
//! regions (`e820::build`); loads the kernel, command line and initramfs and writes the boot
//! parameters (`loader::load`), the ACPI tables (`acpi`) and the MP table (`mptable`), the
//! GDT and page tables. `LinuxVm::create_vcpus` creates the vCPUs (CPUID, MSRs, FPU, LAPIC,
//! entry registers: `cpu`). The boot job (`jobs::boot`) then runs them while the event loop
//! carries console input (`console`) and the API socket ([`controller`]), and waits for the
//! guest's reset, a vCPU stopping, a signal or the timeout. See `docs/BOOT.md`.

mod acpi;
pub mod config;
mod console;
pub mod controller;
pub mod cpu;
pub mod e820;
pub mod hotplug;
mod layout;
mod loader;
mod mptable;
pub mod ports;
mod ram;
mod restore;
pub mod state;
mod vcpus;

use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use kvm_memslots::{KvmVm, MemoryManager, RegionSpec};
use vmm_sys_util::eventfd::EventFd;

use crate::vm::vcpu::{Vcpu, VcpuShared};
use crate::vm::{self, Vm, VmError, VmOptions};

pub use config::{BootConfig, BootProtocol, ConfigError};
pub use e820::{E820Entry, E820Kind};
pub use loader::{KernelFormat, LoadError};
pub use ports::GuestStop;

use crate::devices::legacy::SERIAL_IRQ;
use crate::devices::{self, legacy::ConsoleOutput, legacy::DeviceError, legacy::LegacyDevices};
use console::ConsoleSubscriber;
use loader::Entry;
use ports::LinuxPorts;
use state::LinuxMachine;
pub(crate) use vcpus::LinuxVcpus;

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
    /// A snapshot's or a migration's state could not be restored.
    #[error("restoring the guest: {0}")]
    Restore(String),
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
    /// The caller asked for a stop (`Console::stop`), or a client did (`PUT /actions`).
    Stopped,
    /// The VM migrated away: it runs on the destination now.
    Migrated,
}

impl BootEnding {
    /// The process exit code for it: 0 reset, 2 the guest stopped on an error, 3 the host's
    /// limitation (`KVM_EXIT_INTERNAL_ERROR` on kvm_pvm), 124 timeout (as timeout(1)), 130
    /// interrupted. (1 is a VMM error before or outside the run.)
    pub(crate) fn exit_code(&self) -> u8 {
        match self {
            BootEnding::Reset | BootEnding::Stopped | BootEnding::Migrated => 0,
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
            BootEnding::Migrated => write!(f, "the VM migrated: it runs on the destination now"),
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
    /// Time from the start of the boot (`jobs::boot::boot`) to entering the guest.
    pub setup_time: Duration,
}

/// What the VMM prints about the boot before it starts the guest.
pub(crate) fn describe(report: &BootReport) -> String {
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

/// A Linux guest set up to boot (or restored from a snapshot): its VM, RAM, tables and loaded
/// kernel, its devices and, once [`LinuxVm::create_vcpus`] ran, its vCPUs; nothing runs yet.
/// The boot job (`jobs::boot`) runs it under the event loop.
#[derive(Debug)]
pub(crate) struct LinuxVm {
    vm: Vm,
    /// What its state is saved from: the VM, its devices, the machine booted.
    machine: Arc<LinuxMachine>,
    reset: EventFd,
    /// The virtio-mem device's MMIO window and area, if it has one.
    hotplug_mmio: Option<Arc<vm::mmio::MmioBus>>,
    /// Where the boot vCPU enters the kernel (none for a restored guest).
    entry: Option<Entry>,
    /// The fault handler of a guest restored with userfaultfd, held for the VM's life (and by
    /// its controller, which can end its working-set recording).
    loader: Option<Arc<kvm_memslots_persist::LazyLoader>>,
}

/// The serial console and the i8042 on `vm`, with their interrupt and reset lines: new, or as
/// `serial` saved them.
fn legacy_devices(
    vm: &Vm,
    output: ConsoleOutput,
    serial: Option<&devices::legacy::SerialSnapshot>,
) -> Result<(Arc<LegacyDevices>, EventFd), BootError> {
    let serial_irq = LegacyDevices::eventfd("serial interrupt")?;
    let reset = LegacyDevices::eventfd("i8042 reset")?;
    vm.fd()
        .register_irqfd(&serial_irq, SERIAL_IRQ)
        .map_err(VmError::setup("KVM_IRQFD for the serial console"))?;
    let line = reset
        .try_clone()
        .map_err(|e| BootError::Device(DeviceError::new("i8042 reset", e)))?;
    let devices = match serial {
        None => LegacyDevices::new(output, serial_irq, line),
        Some(state) => {
            LegacyDevices::restore(output, serial_irq, line, state).map_err(BootError::Restore)?
        }
    };
    Ok((Arc::new(devices), reset))
}

impl LinuxVm {
    /// The fault handler of a guest restored with userfaultfd.
    pub(crate) fn loader(&self) -> Option<&Arc<kvm_memslots_persist::LazyLoader>> {
        self.loader.as_ref()
    }

    /// Validates `config`, creates the VM, gives it RAM, builds the e820 map, sets the hotplug
    /// device up, writes the ACPI tables, loads the kernel, writes the page tables and the MP
    /// table, and creates the serial console (writing to `output`) and the i8042. Returns it
    /// with the report of what was built (its ending and set-up time still to fill in).
    pub(crate) fn new(
        config: &BootConfig,
        output: ConsoleOutput,
    ) -> Result<(Self, BootReport), BootError> {
        config.validate()?;
        if config.dirty_ring.is_some() && cpu::host_emulates_ring0() {
            return Err(ConfigError::RingOnEmulatedHost.into());
        }
        let vm = Vm::new(VmOptions {
            irqchip: true,
            limits: config.limits,
            dirty_ring: config.dirty_ring,
            ..VmOptions::default()
        })?;
        let memory = vm.memory();
        for region in ram::ram_regions(config) {
            let spec = match region.slot_ranges() {
                Some(ranges) => RegionSpec::new(region.gpa, region.size).with_slot_ranges(ranges),
                None => RegionSpec::new(region.gpa, region.size).with_slot_size(region.slot_size),
            };
            let spec = spec.with_page_size(config.page_size.into());
            memory.add_region(if config.memfd {
                spec.with_backing(kvm_memslots::Backing::Memfd)
            } else {
                spec
            })?;
        }
        let regions = memory.regions();
        let e820 = e820::build(&regions);
        // The hotplug area has no region until the guest plugs: it stays out of the e820 map.
        let hotplug = config
            .hotplug()
            .map(|area| hotplug::setup(&vm, &area))
            .transpose()?;
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
        let kernel = state::KernelRecord::of(&config.kernel).map_err(|source| {
            BootError::Load(LoadError::File {
                what: "kernel",
                path: config.kernel.clone(),
                source,
            })
        })?;

        let (devices, reset) = legacy_devices(&vm, output, None)?;
        let report = BootReport {
            ending: BootEnding::Timeout,
            format: loaded.format,
            zero_page_entries: loaded.zero_page_entries,
            setup_data: loaded.setup_data.map(|(a, l)| (a.0, l)),
            e820: loaded.e820,
            cmdline: loaded.cmdline,
            initramfs: loaded.initramfs.map(|(a, l)| (a.0, l)),
            regions: regions.len(),
            slots: regions.iter().map(|r| r.slots).sum(),
            setup_time: Duration::ZERO,
        };
        let machine = LinuxMachine {
            vm_fd: Arc::clone(vm.fd()),
            devices,
            bus: Arc::new(LegacyDevices::bus()),
            hotplug: hotplug.as_ref().map(|h| Arc::clone(&h.device)),
            machine: state::Machine::of(config, kernel),
            msrs: Arc::from(Vec::new()),
            clock: Default::default(),
        };
        let linux = LinuxVm {
            vm,
            machine: Arc::new(machine),
            reset,
            hotplug_mmio: hotplug.map(|h| h.mmio),
            entry: Some(loaded.entry),
            loader: None,
        };
        Ok((linux, report))
    }

    /// The guest's memory.
    pub(crate) fn memory(&self) -> &Arc<MemoryManager<KvmVm>> {
        self.vm.memory()
    }

    /// What the guest's state is saved from.
    pub(crate) fn machine(&self) -> &Arc<LinuxMachine> {
        &self.machine
    }

    /// The event loop's part of the guest: console input from the host's terminal on stdin
    /// (with `stdin`) into the serial FIFO, and the i8042's reset line, which sets
    /// `reset_seen`.
    pub(crate) fn console(
        &self,
        reset_seen: Arc<AtomicBool>,
        stdin: bool,
    ) -> Result<ConsoleSubscriber, BootError> {
        Ok(ConsoleSubscriber {
            devices: Arc::clone(&self.machine.devices),
            reset: self
                .reset
                .try_clone()
                .map_err(|e| BootError::Device(DeviceError::new("i8042 reset", e)))?,
            reset_seen,
            stdin,
        })
    }

    fn ports(&self) -> LinuxPorts {
        LinuxPorts {
            devices: Arc::clone(&self.machine.devices),
            bus: Arc::clone(&self.machine.bus),
            hotplug: self
                .machine
                .hotplug
                .as_ref()
                .zip(self.hotplug_mmio.as_ref())
                .map(|(device, mmio)| (Arc::clone(device), Arc::clone(mmio))),
        }
    }

    /// Creates and sets up `config`'s vCPUs; returns them, not yet running. The MSRs the
    /// first one lets the VMM read are those every vCPU saves.
    pub(crate) fn create_vcpus(&mut self, config: &BootConfig) -> Result<LinuxVcpus, BootError> {
        let entry = self.entry.ok_or(BootError::Restore(
            "a restored guest's vCPUs come from its state".into(),
        ))?;
        let ports = self.ports();
        let mut vcpus = Vec::new();
        for index in 0..config.vcpus {
            let fd = self.vm.create_vcpu(usize::from(index))?;
            cpu::setup_vcpu(self.vm.kvm(), &fd, index, config.vcpus, entry)?;
            if index == 0 {
                let msrs = vm::state::readable_msrs(self.vm.kvm(), &fd)
                    .map_err(|e| BootError::Restore(e.to_string()))?;
                Arc::get_mut(&mut self.machine)
                    .expect("the machine is not shared before the vCPUs exist")
                    .msrs = Arc::from(msrs);
            }
            vcpus.push(Vcpu {
                index: usize::from(index),
                fd,
                memory: Arc::clone(self.memory()),
                shared: Arc::new(VcpuShared::default()),
                ports: ports.clone(),
            });
        }
        Ok(LinuxVcpus::new(vcpus, Arc::clone(&self.machine.msrs)))
    }

    /// Writes out what the serial console holds.
    pub(crate) fn flush_console(&self) {
        self.machine.devices.flush();
    }
}
