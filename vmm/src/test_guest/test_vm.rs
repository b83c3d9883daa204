//! The test guest's VM ([`TestVm`]), made fresh or restored from a snapshot with the memory
//! backend a restore uses ([`MemBackend`], the generic VM's); its vCPUs start in `vcpus.rs`.

use std::sync::Arc;

use kvm_memslots::{KvmVm, MemoryManager, RegionId, RegionSpec};
use kvm_memslots_persist::{LazyLoader, LazyOptions, MemoryLayout};
use vm_memory::GuestAddress;

use super::vcpus::{check_slot_count, system_region, GuestError};
use crate::test_guest;
use crate::vm::mmio::MmioBus;
pub use crate::vm::restore::MemBackend;
use crate::vm::restore::{restore_memory_with, RestoredMemory};
use crate::vm::{Vm, VmOptions};

/// The test guest's VM: the generic VM with the system region in place and the guest's code
/// and tables in it.
#[derive(Debug)]
pub struct TestVm {
    pub(super) vm: Vm,
    system: RegionId,
    /// The fault handler of a VM restored with [`MemBackend::Uffd`]: held for as long as the
    /// VM lives (dropping it stops the handler).
    loader: Option<LazyLoader>,
    /// Absent memory the vCPUs answer without stopping (see [`TestVm::with_mmio`]).
    pub(super) mmio: Option<Arc<MmioBus>>,
}

impl TestVm {
    /// Creates the VM and its system region (guest address 0, one slot: tables, code, stacks,
    /// command blocks).
    pub fn new() -> Result<Self, GuestError> {
        Self::with_options(VmOptions::default())
    }

    /// As [`new`](Self::new), with `options` for the VM (its memory limits, say).
    pub fn with_options(options: VmOptions) -> Result<Self, GuestError> {
        let vm = Vm::new(options)?;
        let memory = vm.memory();
        let system =
            memory.add_region(RegionSpec::new(GuestAddress(0), test_guest::SYSTEM_SIZE))?;
        test_guest::write_system_memory(&*memory.current())?;
        Ok(TestVm {
            vm,
            system,
            loader: None,
            mmio: None,
        })
    }

    /// A VM restored from a snapshot: the saved layout's regions (the system region among
    /// them) in fresh memory, loaded from `memory_file`, with `lazy`'s working-set prefetch and
    /// recording (`restore_memory_with`). Start its vCPUs with
    /// [`start_restored_vcpus`](Self::start_restored_vcpus).
    pub fn restore_with(
        layout: &MemoryLayout,
        memory_file: &std::fs::File,
        backend: MemBackend,
        lazy: LazyOptions,
        options: VmOptions,
    ) -> Result<Self, GuestError> {
        let vm = Vm::new(options)?;
        let RestoredMemory { ids, loader } =
            restore_memory_with(vm.memory(), layout, memory_file, backend, lazy)?;
        let system = system_region(layout, &ids)?;
        Ok(TestVm {
            vm,
            system,
            loader,
            mmio: None,
        })
    }

    /// The test guest's VM on `vm`, which holds `layout`'s regions (`ids`, in its order; the
    /// system region among them).
    pub(crate) fn from_vm(
        vm: Vm,
        layout: &MemoryLayout,
        ids: &[RegionId],
    ) -> Result<Self, GuestError> {
        let system = system_region(layout, ids)?;
        Ok(TestVm {
            vm,
            system,
            loader: None,
            mmio: None,
        })
    }

    /// Has vCPUs started from now on answer `bus`'s ranges where there is no slot: absent
    /// memory reads as all ones and drops writes, and the guest goes on (an unplugged
    /// virtio-mem block, say), where an access to no memory otherwise stops the vCPU.
    pub fn with_mmio(self, bus: MmioBus) -> Self {
        TestVm {
            mmio: Some(Arc::new(bus)),
            ..self
        }
    }

    /// The fault handler of a VM restored with [`MemBackend::Uffd`] (its statistics, its
    /// recording).
    pub fn loader(&self) -> Option<&LazyLoader> {
        self.loader.as_ref()
    }

    /// The guest's memory.
    pub fn memory(&self) -> &Arc<MemoryManager<KvmVm>> {
        self.vm.memory()
    }

    /// The system region.
    pub(super) fn system_region(&self) -> RegionId {
        self.system
    }

    /// KVM's number of memory slots.
    fn max_slots(&self) -> usize {
        self.vm.max_slots()
    }

    /// Checks that `slots` KVM slots in all (the system region's and a test area's) are at
    /// least two and at most KVM's number.
    pub fn check_slot_count(&self, slots: usize) -> Result<(), GuestError> {
        check_slot_count(slots, self.max_slots())
    }
}
