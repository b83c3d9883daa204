//! The KVM ioctls the manager issues, behind a trait so that tests can inject failures.

use std::os::fd::AsRawFd;
use std::sync::{Arc, Mutex};

use kvm_bindings::{
    kvm_clear_dirty_log, kvm_clear_dirty_log__bindgen_ty_1, kvm_enable_cap,
    kvm_userspace_memory_region, kvm_userspace_memory_region2, KVMIO, KVM_CAP_DIRTY_LOG_RING,
    KVM_CAP_DIRTY_LOG_RING_ACQ_REL, KVM_CAP_DISABLE_QUIRKS2, KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2,
    KVM_DIRTY_LOG_MANUAL_PROTECT_ENABLE, KVM_MEM_LOG_DIRTY_PAGES, KVM_MEM_READONLY,
    KVM_X86_QUIRK_SLOT_ZAP_ALL,
};
use kvm_ioctls::{Cap, Kvm, VcpuFd, VmFd};
use memslot_map::SlotFlags;
use vmm_sys_util::errno::Error as Errno;
use vmm_sys_util::ioctl::{ioctl, ioctl_with_ref};

use crate::ring::{check_entries, DirtyRing, RingCollection, RingError, KVM_RESET_DIRTY_RINGS};
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
///
/// Every method is required, the properties too: a default would be the right answer for one
/// KVM and the wrong one for a wrapper of another (a wrapper of [`KvmVm`] that inherited
/// `initially_set_logs() == manual_dirty_log()` would make the manager skip marking the pages
/// of a region whose logging starts, and the first harvest would miss what the guest wrote).
/// To share one KVM, implement nothing: `Arc<K>` and `&K` are `KvmMemory` for every
/// `K: KvmMemory` and forward every method; to watch, delay or fail calls in tests, wrap it in
/// `testing::Hooked` (the `testing` feature) with a hook. A wrapper written by hand must
/// decide every method, so that one that forwards only the calls does not compile:
///
/// ```compile_fail,E0046
/// use kvm_memslots::{KvmMemory, KvmSlot};
/// use vmm_sys_util::errno::Error as Errno;
///
/// struct Forward<K>(K);
///
/// impl<K: KvmMemory> KvmMemory for Forward<K> {
///     fn max_slots(&self) -> u32 {
///         self.0.max_slots()
///     }
///     unsafe fn set_user_memory_region(&self, slot: &KvmSlot) -> Result<(), Errno> {
///         // SAFETY: the caller's guarantee, passed on.
///         unsafe { self.0.set_user_memory_region(slot) }
///     }
///     fn get_dirty_log(&self, slot: u32, bitmap: &mut [u64]) -> Result<(), Errno> {
///         self.0.get_dirty_log(slot, bitmap)
///     }
///     fn clear_dirty_log(&self, slot: u32, first: u64, n: u32, bits: &[u64]) -> Result<(), Errno> {
///         self.0.clear_dirty_log(slot, first, n, bits)
///     }
///     fn manual_dirty_log(&self) -> bool {
///         self.0.manual_dirty_log()
///     }
///     // No initially_set_logs, dirty_ring, collect_dirty_rings, reset_dirty_rings.
/// }
/// ```
pub trait KvmMemory: Send + Sync {
    /// How many slot numbers the VM has (`KVM_CAP_NR_MEMSLOTS`).
    ///
    /// [`KvmVm`]: no call; the number was read once, in [`KvmVm::new`] or
    /// [`KvmVm::with_dirty_ring`].
    fn max_slots(&self) -> u32;

    /// Creates, deletes, moves or changes the flags of one slot (`KVM_SET_USER_MEMORY_REGION`).
    ///
    /// # Safety
    ///
    /// Unless `slot.size` is 0, `[slot.hva, slot.hva + slot.size)` must be memory mapped in this
    /// process (writable unless the slot is read-only) and must stay mapped for as long as KVM
    /// has this slot: until a later call deletes or replaces it, or the VM is closed. The guest
    /// reads and writes that memory at any time.
    ///
    /// # KVM calls
    ///
    /// [`KvmVm`]: one `KVM_SET_USER_MEMORY_REGION2` where KVM has `KVM_CAP_USER_MEMORY2`,
    /// else one `KVM_SET_USER_MEMORY_REGION`; no retry.
    unsafe fn set_user_memory_region(&self, slot: &KvmSlot) -> Result<(), Errno>;

    /// Copies the dirty log of `slot` (one bit per page, `KVM_GET_DIRTY_LOG`) into `bitmap`,
    /// which has a bit for every page of the slot. Unless [`manual_dirty_log`] is true, this
    /// also clears KVM's log.
    ///
    /// [`KvmVm`]: one `KVM_GET_DIRTY_LOG`, into a buffer kvm-ioctls allocates for the call
    /// (not fallibly), then copied into `bitmap`.
    ///
    /// [`manual_dirty_log`]: KvmMemory::manual_dirty_log
    fn get_dirty_log(&self, slot: u32, bitmap: &mut [u64]) -> Result<(), Errno>;

    /// Clears (and write-protects again) the pages of `slot` whose bits are set in `bitmap`,
    /// which covers `num_pages` pages from page `first_page` (`KVM_CLEAR_DIRTY_LOG`).
    ///
    /// [`KvmVm`]: one `KVM_CLEAR_DIRTY_LOG`; `EINVAL`, with no call, if `bitmap` has fewer
    /// than `num_pages` bits.
    fn clear_dirty_log(
        &self,
        slot: u32,
        first_page: u64,
        num_pages: u32,
        bitmap: &[u64],
    ) -> Result<(), Errno>;

    /// Whether logs are cleared by [`clear_dirty_log`](KvmMemory::clear_dirty_log) rather than
    /// by reading them (`KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2` enabled). [`KvmVm`]: no call; decided
    /// in [`KvmVm::new`].
    fn manual_dirty_log(&self) -> bool;

    /// Whether, with manual protection, a slot's log starts all set when logging is turned on
    /// (`KVM_DIRTY_LOG_INITIALLY_SET`). Where it does not, the manager marks every page itself,
    /// so the first harvest reports every page either way. [`KvmVm`]: false (it never enables
    /// `KVM_DIRTY_LOG_INITIALLY_SET`); no call.
    fn initially_set_logs(&self) -> bool;

    /// Whether the VM reports dirty pages in per-vCPU rings (`KVM_CAP_DIRTY_LOG_RING`) rather
    /// than in per-slot logs; then [`get_dirty_log`](KvmMemory::get_dirty_log) is not used.
    /// [`KvmVm`]: whether it was made by [`KvmVm::with_dirty_ring`]; no call.
    fn dirty_ring(&self) -> bool;

    /// Collects every published entry of every vCPU's ring, handing each to `sink` as (slot
    /// number, page offset in the slot), and marks them for [`reset_dirty_rings`]; returns
    /// how many, and whether a ring overflowed ([`RingCollection::lost`]: entries may have been
    /// written over, and every logging page must count as dirty).
    ///
    /// [`KvmVm`]: no syscall: reads each vCPU's ring (vCPUs in creation order) from its
    /// mapping, and hands each entry back by setting its `RESET` flag; never fails. Outside
    /// ring mode it has no ring and collects nothing.
    ///
    /// [`reset_dirty_rings`]: KvmMemory::reset_dirty_rings
    fn collect_dirty_rings(&self, sink: &mut dyn FnMut(u32, u64)) -> Result<RingCollection, Errno>;

    /// Frees the collected entries and logs their pages again (`KVM_RESET_DIRTY_RINGS`).
    /// [`KvmVm`]: one `KVM_RESET_DIRTY_RINGS` on the VM, issued even if nothing was collected;
    /// no call outside ring mode.
    fn reset_dirty_rings(&self) -> Result<(), Errno>;
}

/// `KvmMemory` for a pointer to a `KvmMemory`: every method forwarded, unchanged.
macro_rules! forward_kvm_memory {
    ([$($generics:tt)*] $pointer:ty) => {
        /// The pointed-to KVM's: every method forwarded, unchanged.
        impl<$($generics)*> KvmMemory for $pointer {
            fn max_slots(&self) -> u32 {
                (**self).max_slots()
            }

            unsafe fn set_user_memory_region(&self, slot: &KvmSlot) -> Result<(), Errno> {
                // SAFETY: the caller's guarantee about `slot`'s memory is passed on unchanged.
                unsafe { (**self).set_user_memory_region(slot) }
            }

            fn get_dirty_log(&self, slot: u32, bitmap: &mut [u64]) -> Result<(), Errno> {
                (**self).get_dirty_log(slot, bitmap)
            }

            fn clear_dirty_log(
                &self,
                slot: u32,
                first_page: u64,
                num_pages: u32,
                bitmap: &[u64],
            ) -> Result<(), Errno> {
                (**self).clear_dirty_log(slot, first_page, num_pages, bitmap)
            }

            fn manual_dirty_log(&self) -> bool {
                (**self).manual_dirty_log()
            }

            fn initially_set_logs(&self) -> bool {
                (**self).initially_set_logs()
            }

            fn dirty_ring(&self) -> bool {
                (**self).dirty_ring()
            }

            fn collect_dirty_rings(
                &self,
                sink: &mut dyn FnMut(u32, u64),
            ) -> Result<RingCollection, Errno> {
                (**self).collect_dirty_rings(sink)
            }

            fn reset_dirty_rings(&self) -> Result<(), Errno> {
                (**self).reset_dirty_rings()
            }
        }
    };
}

forward_kvm_memory!([K: KvmMemory + ?Sized] Arc<K>);
forward_kvm_memory!(['a, K: KvmMemory + ?Sized] &'a K);

/// A real VM's memory-slot ioctls.
#[derive(Debug)]
pub struct KvmVm {
    vm: Arc<VmFd>,
    max_slots: u32,
    region2: bool,
    manual_dirty_log: bool,
    /// Entries per vCPU ring, in ring mode.
    ring_entries: Option<u32>,
    /// Every vCPU's ring, in ring mode.
    rings: Mutex<Vec<DirtyRing>>,
    /// KVM still zaps every guest mapping when any slot is deleted or moved
    /// (`KVM_X86_QUIRK_SLOT_ZAP_ALL`).
    zaps_all: bool,
}

/// Turns off `KVM_X86_QUIRK_SLOT_ZAP_ALL` where KVM offers it (`KVM_CAP_DISABLE_QUIRKS2`):
/// deleting or moving a slot then drops only that slot's mappings, as "KVM: x86/mmu: Remove fast
/// invalidate mechanism" asks, instead of every vCPU's translations. Whether KVM still zaps all.
fn zap_only_the_slot(vm: &VmFd) -> Result<bool, Errno> {
    let offered = vm.check_extension_raw(libc::c_ulong::from(KVM_CAP_DISABLE_QUIRKS2));
    let quirk = u64::from(KVM_X86_QUIRK_SLOT_ZAP_ALL);
    if u64::try_from(offered).map_or(true, |o| o & quirk == 0) {
        return Ok(true);
    }
    let mut cap = kvm_enable_cap {
        cap: KVM_CAP_DISABLE_QUIRKS2,
        ..Default::default()
    };
    cap.args[0] = quirk;
    vm.enable_cap(&cap)?;
    Ok(false)
}

impl KvmVm {
    /// Wraps `vm`, reading KVM's slot limit, using `KVM_SET_USER_MEMORY_REGION2` where the kernel
    /// has it, and enabling manual dirty-log protection where available. Call before logging
    /// starts on any slot, so that every log has the same semantics.
    ///
    /// Not `KVM_DIRTY_LOG_INITIALLY_SET`: with it, a slot KVM creates with logging on (a
    /// read-only toggle re-creates its slots) starts with every page "dirty" and untracked, and
    /// the manager could never tell which of them the guest wrote. Without it, KVM
    /// write-protects a slot when logging starts (the cost moves from the first clear to the
    /// start), every write is tracked, and the manager marks the first harvest's pages itself.
    ///
    /// # KVM calls
    ///
    /// 1. `KVM_CHECK_EXTENSION(KVM_CAP_NR_MEMSLOTS)` on `kvm` (32 slots if it answers 0).
    /// 2. `KVM_CHECK_EXTENSION(KVM_CAP_USER_MEMORY2)` on the VM.
    /// 3. `KVM_CHECK_EXTENSION(KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2)` on the VM.
    /// 4. If it offers `KVM_DIRTY_LOG_MANUAL_PROTECT_ENABLE`: `KVM_ENABLE_CAP` of
    ///    `KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2` with that bit alone. Its error is returned;
    ///    nothing to undo.
    /// 5. `KVM_CHECK_EXTENSION(KVM_CAP_DISABLE_QUIRKS2)` on the VM; if it offers
    ///    `KVM_X86_QUIRK_SLOT_ZAP_ALL`, `KVM_ENABLE_CAP` of it with that bit alone, so that a
    ///    slot's deletion or move drops only that slot's mappings
    ///    ([`zaps_all_on_slot_change`](Self::zaps_all_on_slot_change)). Its error is returned.
    ///
    /// [`keeping_slot_zap_all`](Self::keeping_slot_zap_all) leaves out step 5.
    pub fn new(kvm: &Kvm, vm: Arc<VmFd>) -> Result<Self, Errno> {
        let mut this = Self::keeping_slot_zap_all(kvm, vm)?;
        this.zaps_all = zap_only_the_slot(&this.vm)?;
        Ok(this)
    }

    /// As [`new`](Self::new), but KVM keeps zapping every guest mapping whenever a slot is
    /// deleted or moved (its default, `KVM_X86_QUIRK_SLOT_ZAP_ALL`): for comparing the two, or
    /// for a kernel where turning it off misbehaves.
    pub fn keeping_slot_zap_all(kvm: &Kvm, vm: Arc<VmFd>) -> Result<Self, Errno> {
        let max_slots = u32::try_from(kvm.get_nr_memslots()).unwrap_or(u32::MAX);
        let region2 = vm.check_extension(Cap::UserMemory2);
        let wanted = u64::from(KVM_DIRTY_LOG_MANUAL_PROTECT_ENABLE);
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
            ring_entries: None,
            rings: Mutex::new(Vec::new()),
            zaps_all: true,
        })
    }

    /// Whether KVM drops every guest mapping (all vCPUs' translations) when any slot is
    /// deleted or moved, rather than only that slot's: true unless [`new`](Self::new) or
    /// [`with_dirty_ring`](Self::with_dirty_ring) could turn `KVM_X86_QUIRK_SLOT_ZAP_ALL` off.
    pub fn zaps_all_on_slot_change(&self) -> bool {
        self.zaps_all
    }

    /// Wraps `vm` in ring mode: KVM reports the guest's dirty pages in a ring of `entries`
    /// entries per vCPU (a power of two; 16 bytes each) instead of per-slot logs. KVM takes
    /// this only before the VM has any vCPU; create them with
    /// [`create_vcpu`](Self::create_vcpu), which maps each one's ring for the manager.
    ///
    /// # KVM calls
    ///
    /// 1. `KVM_CHECK_EXTENSION(KVM_CAP_DIRTY_LOG_RING_ACQ_REL)` on the VM; only if that
    ///    answers 0, `KVM_CHECK_EXTENSION(KVM_CAP_DIRTY_LOG_RING)`.
    /// 2. `KVM_ENABLE_CAP` of the first capability offered, with `entries` × 16 bytes (after
    ///    checking `entries`, without a call).
    /// 3. `KVM_CHECK_EXTENSION(KVM_CAP_NR_MEMSLOTS)` on `kvm`, then
    ///    `KVM_CHECK_EXTENSION(KVM_CAP_USER_MEMORY2)` on the VM.
    /// 4. As [`new`](Self::new)'s step 5: `KVM_X86_QUIRK_SLOT_ZAP_ALL` turned off where offered.
    ///
    /// Manual dirty-log protection is not enabled. On a failure, nothing is undone (an enabled
    /// ring stays enabled).
    pub fn with_dirty_ring(kvm: &Kvm, vm: Arc<VmFd>, entries: u32) -> Result<Self, RingError> {
        let entry = size_of::<kvm_bindings::kvm_dirty_gfn>() as u64;
        // The release/acquire variant where KVM has it; on x86 the plain one behaves the same.
        let (cap, max_bytes) = [KVM_CAP_DIRTY_LOG_RING_ACQ_REL, KVM_CAP_DIRTY_LOG_RING]
            .into_iter()
            .map(|cap| (cap, vm.check_extension_raw(libc::c_ulong::from(cap))))
            .find(|(_, bytes)| *bytes > 0)
            .ok_or(RingError::Unsupported)?;
        let max = u32::try_from(max_bytes as u64 / entry).unwrap_or(u32::MAX);
        check_entries(entries, max)?;
        let mut enable = kvm_enable_cap {
            cap,
            ..Default::default()
        };
        enable.args[0] = u64::from(entries) * entry;
        vm.enable_cap(&enable).map_err(RingError::Enable)?;
        let max_slots = u32::try_from(kvm.get_nr_memslots()).unwrap_or(u32::MAX);
        let region2 = vm.check_extension(Cap::UserMemory2);
        let zaps_all = zap_only_the_slot(&vm).map_err(RingError::Quirk)?;
        Ok(KvmVm {
            vm,
            max_slots,
            region2,
            manual_dirty_log: false,
            ring_entries: Some(entries),
            rings: Mutex::new(Vec::new()),
            zaps_all,
        })
    }

    /// Creates vCPU `id`; in ring mode, also maps its ring so that harvests see its entries.
    /// (A vCPU created on the `VmFd` directly would have its dirty pages missed in ring mode.)
    ///
    /// # KVM calls
    ///
    /// 1. `KVM_CREATE_VCPU(id)` on the VM.
    /// 2. Ring mode: `mmap` (`MAP_SHARED`, read-write) of the vCPU file's ring, `entries` × 16
    ///    bytes at page `KVM_DIRTY_LOG_PAGE_OFFSET`; unmapped (`munmap`) only when this
    ///    `KvmVm` is dropped.
    ///
    /// If the `mmap` fails, the vCPU's file is closed, but KVM keeps the vCPU: `id` cannot be
    /// created again.
    pub fn create_vcpu(&self, id: u64) -> Result<VcpuFd, RingError> {
        let vcpu = self
            .vm
            .create_vcpu(id)
            .map_err(|source| RingError::Vcpu { vcpu: id, source })?;
        if let Some(entries) = self.ring_entries {
            let ring = DirtyRing::map(vcpu.as_raw_fd(), entries)
                .map_err(|source| RingError::Map { vcpu: id, source })?;
            self.rings().push(ring);
        }
        Ok(vcpu)
    }

    /// Entries per vCPU ring, in ring mode.
    pub fn ring_entries(&self) -> Option<u32> {
        self.ring_entries
    }

    fn rings(&self) -> std::sync::MutexGuard<'_, Vec<DirtyRing>> {
        self.rings.lock().unwrap_or_else(|p| p.into_inner())
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

    fn initially_set_logs(&self) -> bool {
        false
    }

    fn dirty_ring(&self) -> bool {
        self.ring_entries.is_some()
    }

    fn collect_dirty_rings(&self, sink: &mut dyn FnMut(u32, u64)) -> Result<RingCollection, Errno> {
        Ok(self
            .rings()
            .iter_mut()
            .map(|ring| ring.collect(sink))
            .fold(RingCollection::default(), |a, b| a + b))
    }

    fn reset_dirty_rings(&self) -> Result<(), Errno> {
        if self.ring_entries.is_none() {
            return Ok(());
        }
        // SAFETY: `self.vm` is a VM fd; KVM_RESET_DIRTY_RINGS takes no argument.
        let ret = unsafe { ioctl(self.vm.as_ref(), KVM_RESET_DIRTY_RINGS()) };
        if ret < 0 {
            Err(Errno::last())
        } else {
            self.rings().iter_mut().for_each(DirtyRing::reset_done);
            Ok(())
        }
    }
}

impl AsRawFd for KvmVm {
    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        self.vm.as_raw_fd()
    }
}
