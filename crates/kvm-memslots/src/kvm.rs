//! The KVM ioctls the manager issues, behind a trait so that tests can inject failures.

use std::os::fd::AsRawFd;
use std::sync::Arc;

use kvm_bindings::{
    kvm_clear_dirty_log, kvm_clear_dirty_log__bindgen_ty_1, kvm_enable_cap,
    kvm_userspace_memory_region, kvm_userspace_memory_region2, KVMIO,
    KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2, KVM_DIRTY_LOG_INITIALLY_SET,
    KVM_DIRTY_LOG_MANUAL_PROTECT_ENABLE, KVM_MEM_LOG_DIRTY_PAGES, KVM_MEM_READONLY,
};
use kvm_ioctls::{Cap, Kvm, VmFd};
use memslot_map::SlotFlags;
use vmm_sys_util::errno::Error as Errno;
use vmm_sys_util::ioctl::ioctl_with_ref;
use vmm_sys_util::ioctl_iowr_nr;

ioctl_iowr_nr!(KVM_CLEAR_DIRTY_LOG, KVMIO, 0xc0, kvm_clear_dirty_log);

/// One KVM memory slot, as `KVM_SET_USER_MEMORY_REGION` takes it. A `size` of 0 deletes the
/// slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvmSlot {
    /// KVM's slot number.
    pub slot: u32,
    /// Guest-physical base.
    pub gpa: u64,
    /// Size in bytes (0: delete).
    pub size: u64,
    /// Host-virtual base.
    pub hva: u64,
    /// Dirty logging and read-only.
    pub flags: SlotFlags,
}

impl KvmSlot {
    /// The same slot with size 0: the request that deletes it.
    pub fn deleted(self) -> Self {
        KvmSlot { size: 0, ..self }
    }

    /// KVM's flag bits for this slot: the only place slot flags become KVM flags.
    pub fn kvm_flags(&self) -> u32 {
        let mut flags = 0;
        if self.flags.log_dirty {
            flags |= KVM_MEM_LOG_DIRTY_PAGES;
        }
        if self.flags.read_only {
            flags |= KVM_MEM_READONLY;
        }
        flags
    }
}

impl From<&KvmSlot> for kvm_userspace_memory_region {
    fn from(s: &KvmSlot) -> Self {
        kvm_userspace_memory_region {
            slot: s.slot,
            flags: s.kvm_flags(),
            guest_phys_addr: s.gpa,
            memory_size: s.size,
            userspace_addr: s.hva,
        }
    }
}

impl From<&KvmSlot> for kvm_userspace_memory_region2 {
    fn from(s: &KvmSlot) -> Self {
        kvm_userspace_memory_region2 {
            slot: s.slot,
            flags: s.kvm_flags(),
            guest_phys_addr: s.gpa,
            memory_size: s.size,
            userspace_addr: s.hva,
            ..Default::default()
        }
    }
}

/// The memory-slot ioctls of one VM.
pub trait KvmMemory: Send + Sync {
    /// How many slot numbers the VM has (`KVM_CAP_NR_MEMSLOTS`).
    fn max_slots(&self) -> u32;

    /// Creates, deletes, moves or changes the flags of one slot (`KVM_SET_USER_MEMORY_REGION`).
    ///
    /// # Safety
    ///
    /// Unless `slot.size` is 0, `[slot.hva, slot.hva + slot.size)` must be memory mapped in this
    /// process (writable unless the slot is read-only) and must stay mapped for as long as KVM
    /// has this slot: until a later call deletes or replaces it, or the VM is closed. The guest
    /// reads and writes that memory at any time.
    unsafe fn set_user_memory_region(&self, slot: &KvmSlot) -> Result<(), Errno>;

    /// Copies the dirty log of `slot` (one bit per page, `KVM_GET_DIRTY_LOG`) into `bitmap`,
    /// which has a bit for every page of the slot. Unless [`manual_dirty_log`] is true, this
    /// also clears KVM's log.
    ///
    /// [`manual_dirty_log`]: KvmMemory::manual_dirty_log
    fn get_dirty_log(&self, slot: u32, bitmap: &mut [u64]) -> Result<(), Errno>;

    /// Clears (and write-protects again) the pages of `slot` whose bits are set in `bitmap`,
    /// which covers `num_pages` pages from page `first_page` (`KVM_CLEAR_DIRTY_LOG`).
    fn clear_dirty_log(
        &self,
        slot: u32,
        first_page: u64,
        num_pages: u32,
        bitmap: &[u64],
    ) -> Result<(), Errno>;

    /// Whether logs are cleared by [`clear_dirty_log`](KvmMemory::clear_dirty_log) rather than
    /// by reading them (`KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2` enabled), and a slot's log starts
    /// all set when logging is turned on (`KVM_DIRTY_LOG_INITIALLY_SET`).
    fn manual_dirty_log(&self) -> bool;
}

/// A real VM's memory-slot ioctls.
#[derive(Debug)]
pub struct KvmVm {
    vm: Arc<VmFd>,
    max_slots: u32,
    region2: bool,
    manual_dirty_log: bool,
}

impl KvmVm {
    /// Wraps `vm`, reading KVM's slot limit, using `KVM_SET_USER_MEMORY_REGION2` where the kernel
    /// has it, and enabling manual dirty-log protection with initially-set logs where available.
    /// Call before logging starts on any slot, so that every log has the same semantics.
    pub fn new(kvm: &Kvm, vm: Arc<VmFd>) -> Result<Self, Errno> {
        let max_slots = u32::try_from(kvm.get_nr_memslots()).unwrap_or(u32::MAX);
        let region2 = vm.check_extension(Cap::UserMemory2);
        let wanted = u64::from(KVM_DIRTY_LOG_MANUAL_PROTECT_ENABLE | KVM_DIRTY_LOG_INITIALLY_SET);
        let offered =
            vm.check_extension_raw(libc::c_ulong::from(KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2));
        let manual_dirty_log = u64::try_from(offered).is_ok_and(|o| o & wanted == wanted);
        if manual_dirty_log {
            let mut cap = kvm_enable_cap {
                cap: KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2,
                ..Default::default()
            };
            cap.args[0] = wanted;
            vm.enable_cap(&cap)?;
        }
        Ok(KvmVm {
            vm,
            max_slots,
            region2,
            manual_dirty_log,
        })
    }

    /// The VM.
    pub fn vm(&self) -> &Arc<VmFd> {
        &self.vm
    }
}

impl KvmMemory for KvmVm {
    fn max_slots(&self) -> u32 {
        self.max_slots
    }

    unsafe fn set_user_memory_region(&self, slot: &KvmSlot) -> Result<(), Errno> {
        if self.region2 {
            // SAFETY: the caller guarantees that the host range stays mapped while KVM has the
            // slot; the request is otherwise checked by KVM.
            unsafe { self.vm.set_user_memory_region2(slot.into()) }
        } else {
            // SAFETY: as above.
            unsafe { self.vm.set_user_memory_region(slot.into()) }
        }
    }

    fn get_dirty_log(&self, slot: u32, bitmap: &mut [u64]) -> Result<(), Errno> {
        let size = bitmap.len() * 64 * crate::PAGE_SIZE as usize;
        let log = self.vm.get_dirty_log(slot, size)?;
        let n = log.len().min(bitmap.len());
        bitmap[..n].copy_from_slice(&log[..n]);
        Ok(())
    }

    fn clear_dirty_log(
        &self,
        slot: u32,
        first_page: u64,
        num_pages: u32,
        bitmap: &[u64],
    ) -> Result<(), Errno> {
        if (num_pages as usize).div_ceil(64) > bitmap.len() {
            return Err(Errno::new(libc::EINVAL));
        }
        let clear = kvm_clear_dirty_log {
            slot,
            num_pages,
            first_page,
            __bindgen_anon_1: kvm_clear_dirty_log__bindgen_ty_1 {
                dirty_bitmap: bitmap.as_ptr() as *mut libc::c_void,
            },
        };
        // SAFETY: `self.vm` is a VM fd; `clear` points at a bitmap of at least `num_pages` bits
        // (checked above) that KVM only reads, and both outlive the call.
        let ret = unsafe { ioctl_with_ref(self.vm.as_ref(), KVM_CLEAR_DIRTY_LOG(), &clear) };
        if ret == 0 {
            Ok(())
        } else {
            Err(Errno::last())
        }
    }

    fn manual_dirty_log(&self) -> bool {
        self.manual_dirty_log
    }
}

impl AsRawFd for KvmVm {
    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        self.vm.as_raw_fd()
    }
}
