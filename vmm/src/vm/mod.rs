//! A KVM VM and what every guest kind shares: creating it with its memory manager, its vCPUs,
//! and the one vCPU exit loop ([`vcpu`]) with its pure exit handler ([`exit`]) and port bus
//! ([`ports`]).

pub mod exit;
mod memory_gone;
pub mod mmio;
pub mod ports;
pub(crate) mod restore;
pub mod state;
pub mod vcpu;

use std::sync::Arc;

use kvm_bindings::{
    kvm_enable_cap, kvm_pit_config, KVM_CAP_EXIT_ON_EMULATION_FAILURE, KVM_PIT_SPEAKER_DUMMY,
};
use kvm_ioctls::{Kvm, VcpuFd, VmFd};
use kvm_memslots::{KvmVm, MemoryLimits, MemoryManager, RingError};

/// Where KVM puts the three pages Intel's VMX needs for real mode's TSS: in the 3-4 GiB MMIO
/// gap, below 4 GiB.
const TSS_ADDRESS: usize = 0xfffb_d000;

/// What a VM is created with besides its memory.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct VmOptions {
    /// The in-kernel irqchip (PIC, IOAPIC, local APICs) and PIT, and the real-mode TSS: what
    /// a Linux guest needs. The test guest runs without interrupts.
    pub irqchip: bool,
    /// What the memory manager admits; by default this host's
    /// ([`MemoryLimits::for_this_host`]).
    pub limits: Option<MemoryLimits>,
    /// Harvest dirty pages from per-vCPU rings of this many entries (a power of two) instead
    /// of per-slot bitmaps.
    pub dirty_ring: Option<u32>,
    /// Keep KVM's `KVM_X86_QUIRK_SLOT_ZAP_ALL` (every guest mapping dropped on any slot's
    /// deletion or move) instead of turning it off where KVM allows: for measuring the two
    /// (`tinyvmm-bench bench --keep-slot-zap-all`). Bitmap mode only: a ring-mode VM turns it off.
    pub keep_slot_zap_all: bool,
}

/// Why a VM could not be created or set up.
#[derive(Debug, thiserror::Error)]
pub enum VmError {
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
    /// The dirty ring could not be set up (or a vCPU with its ring).
    #[error(transparent)]
    Ring(#[from] RingError),
}

impl VmError {
    /// A closure that names the set-up step `what` in the error it makes of KVM's.
    pub(crate) fn setup(what: &'static str) -> impl Fn(kvm_ioctls::Error) -> VmError {
        move |source| VmError::Setup { what, source }
    }
}

/// The real-mode TSS, the in-kernel irqchip and the PIT, on a VM without vCPUs.
fn add_irqchip(fd: &VmFd) -> Result<(), VmError> {
    fd.set_tss_address(TSS_ADDRESS)
        .map_err(VmError::setup("KVM_SET_TSS_ADDR"))?;
    fd.create_irq_chip()
        .map_err(VmError::setup("KVM_CREATE_IRQCHIP"))?;
    let pit = kvm_pit_config {
        flags: KVM_PIT_SPEAKER_DUMMY,
        ..Default::default()
    };
    fd.create_pit2(pit)
        .map_err(VmError::setup("KVM_CREATE_PIT2"))
}

/// Has KVM exit to the VMM on every emulation failure (`KVM_CAP_EXIT_ON_EMULATION_FAILURE`),
/// where it offers that: without it, a failure at guest CPL > 0 injects `#UD` into the guest,
/// which the VMM never sees. An access KVM cannot emulate (a VEX load or store, an instruction
/// fetch) that meets a slot away during a change then exits, and the vCPU loop runs it again
/// once the change is done ([`exit`]). Returns whether KVM offers it.
fn exit_on_emulation_failure(fd: &VmFd) -> Result<bool, VmError> {
    let cap = KVM_CAP_EXIT_ON_EMULATION_FAILURE;
    if fd.check_extension_raw(cap.into()) <= 0 {
        return Ok(false);
    }
    let mut enable = kvm_enable_cap {
        cap,
        ..Default::default()
    };
    enable.args[0] = 1;
    fd.enable_cap(&enable)
        .map_err(VmError::setup("enabling KVM_CAP_EXIT_ON_EMULATION_FAILURE"))?;
    Ok(true)
}

/// Whether this host's KVM runs a guest's ring 0 in its instruction emulator: kvm_pvm (KVM
/// without VT-x or AMD-V), whose module shows in sysfs. A fact of the host, for every guest
/// kind: what its emulator lacks stops ring-0 code, and the vCPU loop says so.
pub fn host_emulates_ring0() -> bool {
    std::path::Path::new("/sys/module/kvm_pvm").exists()
}

/// KVM's number of memory slots (`KVM_CAP_NR_MEMSLOTS`), without creating a VM.
pub fn max_slots() -> Result<usize, VmError> {
    Ok(Kvm::new().map_err(VmError::Kvm)?.get_nr_memslots())
}

/// A KVM VM with its guest memory in a [`MemoryManager`], and no memory yet.
#[derive(Debug)]
pub struct Vm {
    kvm: Kvm,
    fd: Arc<VmFd>,
    memory: Arc<MemoryManager<KvmVm>>,
}

/// For unit tests: a VM with 4 MiB of RAM at 0 whose u64 at 0x1000 holds 0x5a, or `None`
/// without KVM (`test` then skips, loudly).
#[cfg(test)]
pub(crate) fn test_vm_with_a_page(test: &str) -> Option<Vm> {
    use vm_memory::{Bytes, GuestAddress, GuestAddressSpace};

    if !kvm_test_support::require_kvm(test) {
        return None;
    }
    let vm = Vm::new(VmOptions::default()).expect("a VM");
    vm.memory()
        .add_region(kvm_memslots::RegionSpec::new(GuestAddress(0), 4 << 20))
        .expect("a region");
    vm.memory()
        .handle()
        .memory()
        .write_obj(0x5au64, GuestAddress(0x1000))
        .expect("guest memory");
    Some(vm)
}

impl Vm {
    /// Opens `/dev/kvm` and creates the VM: with `options.irqchip`, the real-mode TSS, the
    /// in-kernel irqchip (before any vCPU, as KVM requires) and the PIT; then the memory
    /// manager (admitting memory within `options.limits`), with manual dirty-log protection
    /// where KVM offers it; and exits on every emulation failure where KVM offers that
    /// (`KVM_CAP_EXIT_ON_EMULATION_FAILURE`). Also installs the
    /// signal handler that kicks vCPUs out of the guest, and the one that keeps the process alive
    /// when guest memory's file is cut under it (`memory_gone`).
    pub fn new(options: VmOptions) -> Result<Self, VmError> {
        let kvm = Kvm::new().map_err(VmError::Kvm)?;
        let fd = Arc::new(kvm.create_vm().map_err(VmError::setup("KVM_CREATE_VM"))?);
        exit_on_emulation_failure(&fd)?;
        if options.irqchip {
            add_irqchip(&fd)?;
        }
        let kvm_vm = match options.dirty_ring {
            Some(entries) => KvmVm::with_dirty_ring(&kvm, Arc::clone(&fd), entries)?,
            None if options.keep_slot_zap_all => KvmVm::keeping_slot_zap_all(&kvm, Arc::clone(&fd))
                .map_err(VmError::setup("enabling manual dirty-log protection"))?,
            None => KvmVm::new(&kvm, Arc::clone(&fd)).map_err(VmError::setup(
                "enabling manual dirty-log protection, or turning KVM_X86_QUIRK_SLOT_ZAP_ALL off",
            ))?,
        };
        let limits = options.limits.unwrap_or_else(MemoryLimits::for_this_host);
        let memory = Arc::new(MemoryManager::with_limits(kvm_vm, limits));
        vcpu::install_kick_handler();
        memory_gone::install();
        Ok(Vm { kvm, fd, memory })
    }

    /// Gives a VM made without them the real-mode TSS, the in-kernel irqchip and the PIT (a
    /// migration's destination learns that its guest needs them once its memory came); before
    /// any vCPU exists, as KVM requires.
    pub(crate) fn add_irqchip(&self) -> Result<(), VmError> {
        add_irqchip(&self.fd)
    }

    /// `/dev/kvm`.
    pub(crate) fn kvm(&self) -> &Kvm {
        &self.kvm
    }

    /// KVM's VM.
    pub fn fd(&self) -> &Arc<VmFd> {
        &self.fd
    }

    /// The guest's memory.
    pub fn memory(&self) -> &Arc<MemoryManager<KvmVm>> {
        &self.memory
    }

    /// KVM's number of memory slots.
    pub(crate) fn max_slots(&self) -> usize {
        self.kvm.get_nr_memslots()
    }

    /// Creates vCPU `index` (its KVM id and APIC ID).
    /// In ring mode, its ring is mapped for the memory manager.
    pub fn create_vcpu(&self, index: usize) -> Result<VcpuFd, VmError> {
        Ok(self.memory.kvm().create_vcpu(index as u64)?)
    }
}
