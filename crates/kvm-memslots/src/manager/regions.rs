//! Region operations: add, remove, move, read-only.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use memslot_map::{AddressRange, Change, SlotFlags};
use vm_memory::GuestAddress;

use super::batch::RegionChange;
use super::plan::{KvmOp, Step};
use super::{
    check_aligned_to, check_range, region_in_the_way, region_slots, MemoryManager, RegionSpec,
    Reslot,
};
use crate::error::Error;
use crate::kvm::{KvmMemory, KvmSlot};
use crate::memory::GuestSlotData;
use crate::region_memory::RegionId;

impl<K: KvmMemory> MemoryManager<K> {
    /// Maps a new region and gives it to the guest. Returns its id.
    ///
    /// # KVM calls
    ///
    /// 1. [`Backing::Memfd`](crate::Backing::Memfd) only: `memfd_create` (`MFD_CLOEXEC`), then
    ///    `ftruncate` to the region's size.
    /// 2. One `mmap` of the whole region, read-write, `MAP_NORESERVE`: private anonymous,
    ///    `MAP_SHARED` of the memfd or [`Backing::File`](crate::Backing::File), `MAP_PRIVATE`
    ///    of a [`Backing::PrivateFile`](crate::Backing::PrivateFile).
    /// 3. `KVM_SET_USER_MEMORY_REGION` creating each slot, lowest guest address first.
    ///
    /// No log is read and no ring drained. On a refusal in step 3: the slots already created
    /// are deleted again (size 0), last first; then the mapping is unmapped (`munmap`) and a
    /// memfd made in step 1 closed. If KVM refuses one of those deletes, the mapping is instead
    /// kept for the process's lifetime. A failure in step 1 or 2 makes no KVM call and closes
    /// or unmaps what was made.
    pub fn add_region(&self, spec: RegionSpec) -> Result<RegionId, Error> {
        let added = self.apply(vec![RegionChange::Add(spec)])?;
        Ok(added[0])
    }

    /// Takes a region away from the guest and unmaps it (once no snapshot holds it).
    ///
    /// # KVM calls
    ///
    /// 1. Ring mode: a ring drain (see [`MemoryManager`]).
    /// 2. For each slot, lowest guest address first: `KVM_SET_USER_MEMORY_REGION` deleting it
    ///    (size 0); in bitmap mode, if the slot logs, *deleting a logging slot* instead (see
    ///    [`MemoryManager`]: its bits matter if the remove is undone).
    /// 3. Ring mode: a second ring drain; its failure is ignored.
    /// 4. `munmap` of the mapping (closing a memfd the manager made) as its last reference
    ///    goes: at the end of this call, unless a snapshot, a map guard or a running harvest
    ///    still holds it.
    ///
    /// On a refusal in step 2 (of a delete or of a `KVM_GET_DIRTY_LOG`): the slots already
    /// deleted are created again (same ranges and flags; new logs, in bitmap mode), last
    /// first; nothing is unmapped.
    pub fn remove_region(&self, id: RegionId) -> Result<(), Error> {
        self.remove_regions([id])
    }

    /// Gives part of a region new KVM slots, without unmapping, copying or touching its
    /// memory: neighbouring slots merged into one, one split into several, a hole given a slot
    /// or a slot taken away (a hole made). A batch of one ([`apply`](Self::apply) with a
    /// [`RegionChange::Reslot`]): all or nothing.
    ///
    /// The guest's view between KVM's requests: KVM cannot resize a slot, so a merged or split
    /// slot is deleted and its successor created; a vCPU that touches it in between exits to
    /// the VMM while [`change_sequence`](Self::change_sequence) is odd, and should wait for the
    /// change ([`wait_settled`](Self::wait_settled)) and complete the access against the map
    /// afterwards, where the memory is (its contents never moved). Dirty pages stay exact: a
    /// logging slot's log is read into the region's pending bits before it is deleted (bitmap
    /// mode), and ring entries of deleted and created slots are attributed to the region.
    ///
    /// ```
    /// use kvm_memslots::testing::FakeKvm;
    /// use kvm_memslots::{MemoryManager, RegionSpec, Reslot};
    /// use vm_memory::{Bytes, GuestAddress};
    ///
    /// const MIB: u64 = 1 << 20;
    /// let memory = MemoryManager::new(FakeKvm::new(64, true));
    /// // 8 MiB, of which only the first 2 MiB and the last 2 MiB have slots.
    /// let spec = RegionSpec::new(GuestAddress(0), 8 * MIB).with_slot_ranges(vec![0..2 * MIB, 6 * MIB..8 * MIB]);
    /// let region = memory.add_region(spec)?;
    /// memory.current().write_obj(7u64, GuestAddress(MIB))?;
    /// assert!(memory.current().read_obj::<u64>(GuestAddress(4 * MIB)).is_err(), "a hole");
    /// // Cover the hole and merge everything into one slot.
    /// memory.reslot(Reslot { region, range: 0..8 * MIB, slots: vec![0..8 * MIB] })?;
    /// assert_eq!(memory.slot_ranges(region), Some(vec![0..8 * MIB]));
    /// assert_eq!(memory.current().read_obj::<u64>(GuestAddress(MIB))?, 7);
    /// // Split it again, with a hole in the middle.
    /// memory.reslot(Reslot { region, range: 0..8 * MIB, slots: vec![0..MIB, MIB..3 * MIB, 5 * MIB..8 * MIB] })?;
    /// assert_eq!(memory.kvm().slots().len(), 3);
    /// assert_eq!(memory.current().read_obj::<u64>(GuestAddress(MIB))?, 7);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// # KVM calls
    ///
    /// None if the range's slots are those asked for already (nor a new map version or a
    /// change counted). Otherwise:
    ///
    /// 1. Ring mode, if a slot is deleted: a ring drain (see [`MemoryManager`]).
    /// 2. Going up the range, for each new slot: for each old slot not kept that starts below
    ///    its end and was not deleted yet, `KVM_SET_USER_MEMORY_REGION` deleting it (in bitmap
    ///    mode, if it logs, *deleting a logging slot*: see [`MemoryManager`]); then
    ///    `KVM_SET_USER_MEMORY_REGION` creating the new slot (the region's flags). Then the
    ///    old slots left, deleted the same way. Slots kept as they are get no request.
    /// 3. Ring mode, if a slot is deleted: a second ring drain; its failure is ignored.
    ///
    /// On a refusal in step 2: the requests already made are reversed, last first (created
    /// slots deleted, deleted ones created again, with new logs in bitmap mode; the bits read
    /// are kept, and a created slot that logs is deleted as *deleting a logging slot*, its log
    /// read first), so every slot ends as it was.
    pub fn reslot(&self, reslot: Reslot) -> Result<(), Error> {
        self.apply(vec![RegionChange::Reslot(reslot)]).map(drop)
    }

    /// Moves a region to a new guest-physical base (KVM moves each slot in place).
    ///
    /// ```
    /// use kvm_memslots::testing::FakeKvm;
    /// use kvm_memslots::{MemoryManager, RegionSpec};
    /// use vm_memory::{Bytes, GuestAddress, GuestAddressSpace};
    ///
    /// let memory = MemoryManager::new(FakeKvm::new(64, true));
    /// let rom = memory.add_region(RegionSpec::new(GuestAddress(0x10_0000), 0x8000).with_slot_size(0x2000))?;
    /// memory.handle().memory().write_obj(0xfeedu64, GuestAddress(0x10_2000))?;
    /// // The contents move with it; the old range is no longer memory.
    /// memory.move_region(rom, GuestAddress(0x40_0000))?;
    /// assert_eq!(memory.handle().memory().read_obj::<u64>(GuestAddress(0x40_2000))?, 0xfeed);
    /// assert!(memory.handle().memory().read_obj::<u64>(GuestAddress(0x10_2000)).is_err());
    /// // KVM cannot flip KVM_MEM_READONLY in place: each slot is deleted and created again.
    /// memory.set_read_only(rom, true)?;
    /// assert!(memory.kvm().slots().iter().all(|s| s.flags.read_only));
    /// // An overlapping move is refused and changes nothing.
    /// let ram = memory.add_region(RegionSpec::new(GuestAddress(0), 0x10_0000))?;
    /// assert!(memory.move_region(ram, GuestAddress(0x3f_f000)).is_err());
    /// assert!(memory.regions().iter().any(|r| r.id == ram && r.gpa == GuestAddress(0)));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// # KVM calls
    ///
    /// None if the region is at `gpa` already. Otherwise:
    ///
    /// 1. `KVM_SET_USER_MEMORY_REGION` moving each slot to its new guest address (same number,
    ///    host range, size and flags), the slot at the leading edge first: highest guest
    ///    address first when moving up, lowest first when moving down.
    ///
    /// No log is read, no ring drained, and the mapping is untouched. On a refusal: the slots
    /// already moved are moved back, last first.
    pub fn move_region(&self, id: RegionId, gpa: GuestAddress) -> Result<(), Error> {
        let mut state = self.state_for_change()?;
        let current = Arc::clone(state.current());
        let region = state.regions.get(&id).ok_or(Error::UnknownRegion(id))?;
        check_range(gpa.0, region.size)?;
        check_aligned_to(
            "guest address",
            gpa.0,
            region.memory.page_size().alignment(),
        )?;
        if gpa == region.gpa {
            return Ok(());
        }
        // The map finds slots in the way; a hole of either region is found here.
        let range = AddressRange {
            start: gpa.0,
            end: gpa.0 + region.size,
        };
        if let Some((other, other_range)) = region_in_the_way(&state, range, |o| o == id) {
            let other_region = &state.regions[&other];
            if region.covered < region.size || other_region.covered < other_region.size {
                return Err(Error::Overlap {
                    range,
                    other,
                    other_range,
                });
            }
        }
        // Move the slot at the leading edge first so that no slot lands on one of its own
        // region's slots that has not moved yet.
        let mut slots = region_slots(&current, region);
        if gpa > region.gpa {
            slots.reverse();
        }
        let new_gpa = |s: &GuestSlotData| GuestAddress(gpa.0 + s.payload().offset());
        let steps: Vec<Step> = slots
            .iter()
            .map(|s| {
                let old = KvmSlot::from(s.as_ref());
                let new = KvmSlot {
                    gpa: new_gpa(s).0,
                    ..old
                };
                Step {
                    region: id,
                    op: KvmOp::Update { old, new },
                    read_log: false,
                }
            })
            .collect();
        let changes = slots.iter().map(|s| Change::Move {
            id: s.id(),
            gpa: new_gpa(s),
        });
        self.commit(&mut state, changes, &steps)?;
        let old_gpa = state.regions[&id].gpa;
        state.spans.remove(&old_gpa.0);
        state.spans.insert(gpa.0, id);
        let region = state.regions.get_mut(&id).expect("looked up above");
        region.gpa = gpa;
        region.shared.gpa.store(gpa.0, Ordering::Release);
        Ok(())
    }

    /// Makes a region read-only for the guest, or writable again.
    ///
    /// KVM cannot change this flag in place: each slot is deleted and created again, and
    /// between the two a vCPU that touches the slot exits to the VMM (see
    /// [`change_sequence`](Self::change_sequence)). Dirty bits KVM had for the slot are kept.
    ///
    /// # KVM calls
    ///
    /// None if the region has that setting already. Otherwise:
    ///
    /// 1. Ring mode: a ring drain (see [`MemoryManager`]).
    /// 2. For each slot, lowest guest address first: `KVM_SET_USER_MEMORY_REGION` deleting it
    ///    (size 0; in bitmap mode, if the slot logs, *deleting a logging slot*: see
    ///    [`MemoryManager`]); `KVM_SET_USER_MEMORY_REGION` creating it again with
    ///    `KVM_MEM_READONLY` set or cleared (same number, ranges and logging flag).
    /// 3. Ring mode: a second ring drain; its failure is ignored.
    ///
    /// The mapping is untouched. On a refusal in step 2: the requests already made are
    /// reversed, last first (a re-created slot deleted, a deleted slot created again with its
    /// old flags), so every slot ends as it was (a new log where it logs, in bitmap mode);
    /// the bits read are kept. In bitmap mode a re-created slot that logs is deleted as
    /// *deleting a logging slot* (see [`MemoryManager`]): the guest's writes into it are kept.
    pub fn set_read_only(&self, id: RegionId, read_only: bool) -> Result<(), Error> {
        let mut state = self.state_for_change()?;
        let current = Arc::clone(state.current());
        let region = state.regions.get_mut(&id).ok_or(Error::UnknownRegion(id))?;
        if region.flags.read_only == read_only {
            return Ok(());
        }
        let slots = region_slots(&current, region);
        let flags = SlotFlags {
            read_only,
            ..region.flags
        };
        let mut steps = Vec::with_capacity(2 * slots.len());
        for s in &slots {
            let old = KvmSlot::from(s.as_ref());
            // Deleting a slot frees its KVM log: keep its bits first.
            steps.push(Step {
                region: id,
                op: KvmOp::Delete(old),
                read_log: old.flags.log_dirty,
            });
            steps.push(Step {
                region: id,
                op: KvmOp::Create(KvmSlot { flags, ..old }),
                read_log: false,
            });
        }
        let changes = slots.iter().map(|s| Change::SetFlags { id: s.id(), flags });
        self.commit(&mut state, changes, &steps)?;
        state.regions.get_mut(&id).expect("looked up above").flags = flags;
        Ok(())
    }
}
