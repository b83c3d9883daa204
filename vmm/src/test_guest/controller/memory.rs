//! The test guest's memory requests: adding (checked by the guest), removing and moving
//! regions, and where a region without a guest address goes.

use std::sync::Arc;

use kvm_memslots::{Backing, RegionId, RegionSpec, PAGE_SIZE};
use vm_memory::GuestAddress;

use super::guest::RegionChange;
use super::{TestGuest, AUTO_PLACE_BASE, MIB};
use crate::control::memory::{AddRegion, PatchRegion, RegionAdded, RegionBacking};
use crate::control::vm::RunState;
use crate::control::ControllerError;
use crate::test_guest;
use crate::test_guest::area::{check_area, TestArea};
use crate::test_guest::hotplug::HotplugArea;

impl TestGuest {
    /// The first free place for `size` bytes at or above [`AUTO_PLACE_BASE`], aligned to the
    /// size's largest power-of-two factor up to 2 MiB.
    /// Never inside the hotplug area.
    fn auto_place(&self, size: u64) -> Option<u64> {
        let at = self.first_free(AUTO_PLACE_BASE, size)?;
        match self.reserved() {
            Some(area) if at < area.end && area.start < at.checked_add(size)? => {
                self.first_free(area.end, size)
            }
            _ => Some(at),
        }
    }

    /// The first free place for `size` bytes at or above `from`, aligned as `auto_place` says.
    fn first_free(&self, from: u64, size: u64) -> Option<u64> {
        let align = (size & size.wrapping_neg()).clamp(PAGE_SIZE, 2 * MIB);
        let snapshot = self.vm.memory().current();
        let mut at = from.checked_next_multiple_of(align)?;
        for slot in snapshot.map().iter_from_gpa(GuestAddress(at)) {
            if slot.gpa().0 >= at.checked_add(size)? {
                break;
            }
            at = slot.gpa_range().end.checked_next_multiple_of(align)?;
        }
        Some(at)
    }

    /// The hotplug area's guest range, once configured: reserved for its slots.
    fn reserved(&self) -> Option<std::ops::Range<u64>> {
        self.hotplug.as_ref().map(HotplugArea::range)
    }

    /// Refuses `[gpa, gpa + size)` if it reaches into the hotplug area.
    fn outside_hotplug_area(&self, gpa: u64, size: u64) -> Result<(), ControllerError> {
        let end = gpa.saturating_add(size);
        match self.reserved() {
            Some(area) if gpa < area.end && area.start < end => {
                Err(ControllerError::conflict(format!(
                    "guest range [{gpa:#x}, {end:#x}) reaches into the hotplug area [{:#x}, {:#x}), which is reserved for PATCH /hotplug/memory",
                    area.start, area.end
                )))
            }
            _ => Ok(()),
        }
    }

    /// Checks that `[start, end)` is all guest memory the test guest can reach.
    pub(super) fn reachable(&self, start: u64, end: u64) -> Result<(), ControllerError> {
        if start < test_guest::SYSTEM_SIZE {
            return Err(ControllerError::bad(format!(
                "guest range [{start:#x}, {end:#x}) overlaps the system region [0, {:#x}): the guest's code, tables and command blocks are off limits",
                test_guest::SYSTEM_SIZE
            )));
        }
        if end > test_guest::IDENTITY_MAPPED {
            return Err(ControllerError::bad(format!(
                "the test guest reaches guest addresses below {:#x} only",
                test_guest::IDENTITY_MAPPED
            )));
        }
        // No slot, or unreachable under one (an unplugged hotplug block): the guest's access
        // would not be memory.
        if let Some(hole) = self.vm.memory().first_unreachable(start, end) {
            return Err(ControllerError::bad(format!(
                "guest range [{start:#x}, {end:#x}) is not all memory: nothing at {hole:#x}"
            )));
        }
        Ok(())
    }

    pub(super) fn add_region(&mut self, add: AddRegion) -> Result<RegionAdded, ControllerError> {
        let slot_size = add.slot_size.unwrap_or(add.size);
        if add.slot_size.is_some() && (slot_size == 0 || !add.size.is_multiple_of(slot_size)) {
            return Err(ControllerError::bad(format!(
                "size {:#x} is not a multiple of slot_size {slot_size:#x}",
                add.size
            )));
        }
        let gpa = match add.guest_address {
            Some(gpa) => gpa,
            None => self.auto_place(add.size).ok_or_else(|| {
                ControllerError::bad(format!("no free guest range of {:#x} bytes", add.size))
            })?,
        };
        self.outside_hotplug_area(gpa, add.size)?;
        let backing = match add.backing {
            RegionBacking::Anonymous => Backing::Anonymous,
            RegionBacking::Memfd => Backing::Memfd,
        };
        let mut spec = RegionSpec::new(GuestAddress(gpa), add.size)
            .with_backing(backing)
            .with_page_size(add.page_size.into());
        spec.slot_size = add.slot_size;
        spec.read_only = add.read_only;
        spec.log_dirty = add.dirty_log;
        let checkable = add.guest_check && !add.read_only;
        if checkable {
            // Refuse a check the guest cannot do before anything is added.
            self.guest_can_check("the guest checks every slot of a new region (guest_check)")?;
            // (A range that wraps is the manager's to refuse, with its own message.)
            if gpa
                .checked_add(add.size)
                .is_some_and(|end| end > test_guest::IDENTITY_MAPPED)
            {
                return Err(ControllerError::bad(format!(
                    "guest_check: the test guest reaches guest addresses below {:#x} only",
                    test_guest::IDENTITY_MAPPED
                )));
            }
        }
        let region = self.add_checked(spec, slot_size, checkable)?;
        Ok(RegionAdded {
            id: region.0,
            guest_address: gpa,
            size: add.size,
            slots: add.size / slot_size,
            guest_checked: checkable,
        })
    }

    /// Refuses a request whose new memory the guest would check (`what` says so) while the
    /// guest cannot run the check: the VM is paused, or a vCPU runs a command of its own (the
    /// check runs on every vCPU).
    pub(super) fn guest_can_check(&mut self, what: &str) -> Result<(), ControllerError> {
        if self.state == RunState::Paused {
            return Err(ControllerError::conflict(format!(
                "the VM is paused: {what}, and the guest runs no command until it is resumed \
                 (PATCH /vm {{\"state\": \"Resumed\"}})"
            )));
        }
        self.vcpus()?;
        self.refuse_if_busy()
            .map_err(|busy| ControllerError::conflict(format!("{what}: {}", busy.message)))
    }

    /// Has the guest check both ends of every slot of `area` both ways.
    fn check(&mut self, area: &TestArea) -> Result<(), String> {
        self.refuse_if_busy().map_err(|e| e.message)?;
        let Some(vcpus) = self.vcpus.as_mut() else {
            return Err("the VM is shutting down".into());
        };
        check_area(&self.vm, vcpus, area, self.interrupt)
            .map(drop)
            .map_err(|e| e.to_string())
    }

    /// Adds the region `spec`; with `check`, the test guest then checks both ends of every slot
    /// of `slot_size` both ways, and if that fails the region goes again, so that the memory is
    /// as it was. The error says whether even that removal failed.
    pub(super) fn add_checked(
        &mut self,
        spec: RegionSpec,
        slot_size: u64,
        check: bool,
    ) -> Result<RegionId, ControllerError> {
        let (gpa, size) = (spec.gpa.0, spec.size);
        let memory = Arc::clone(self.vm.memory());
        let region = memory.add_region(spec)?;
        if !check {
            return Ok(region);
        }
        if let Err(e) = self.check_new(region, gpa, size, slot_size) {
            let cleanup = match memory.remove_region(region) {
                Ok(()) => "the memory was removed again".to_owned(),
                Err(r) => format!("removing it again failed too ({r}): region {region} stays"),
            };
            return Err(ControllerError::internal(format!(
                "the guest's check of the new memory at {gpa:#x} failed: {e}; {cleanup}"
            )));
        }
        Ok(region)
    }

    /// Has the test guest check both ends of every slot of `slot_size` of the new region
    /// `region` (`size` bytes at `gpa`) both ways.
    pub(super) fn check_new(
        &mut self,
        region: RegionId,
        gpa: u64,
        size: u64,
        slot_size: u64,
    ) -> Result<(), String> {
        self.check(&TestArea {
            region,
            gpa,
            slot_size,
            slots: size / slot_size,
        })
    }

    fn protect_system(&self, id: u64) -> Result<RegionId, ControllerError> {
        let id = RegionId(id);
        if id == self.vm.system_region() {
            return Err(ControllerError::conflict(format!(
                "region {id} holds the guest's code and page tables: it stays"
            )));
        }
        if self
            .hotplug
            .as_ref()
            .is_some_and(|h| h.pieces.contains(&Some(id)))
        {
            return Err(ControllerError::conflict(format!(
                "region {id} belongs to the hotplug area: change it with PATCH /hotplug/memory"
            )));
        }
        Ok(id)
    }

    pub(super) fn remove_region(&mut self, id: u64) -> Result<(), ControllerError> {
        let id = self.protect_system(id)?;
        if let Some(region) = self.vm.memory().region(id) {
            let range = region.gpa.0..region.gpa.0.saturating_add(region.size);
            self.refuse_under_commands(id.0, &[range], RegionChange::Remove)?;
        }
        Ok(self.vm.memory().remove_region(id)?)
    }

    pub(super) fn patch_region(
        &mut self,
        id: u64,
        patch: PatchRegion,
    ) -> Result<(), ControllerError> {
        let id = self.protect_system(id)?;
        let memory = Arc::clone(self.vm.memory());
        if let Some(region) = memory.region(id) {
            let size = region.size;
            let at = |gpa: u64| gpa..gpa.saturating_add(size);
            let mut ranges = vec![at(region.gpa.0)];
            ranges.extend(patch.guest_address.map(at));
            if patch.guest_address.is_some_and(|gpa| gpa != region.gpa.0) {
                self.refuse_under_commands(id.0, &ranges, RegionChange::Move)?;
            }
            if patch.read_only == Some(true) {
                self.refuse_under_commands(id.0, &ranges, RegionChange::ReadOnly)?;
            }
        }
        let Some(gpa) = patch.guest_address else {
            let read_only = patch.read_only.ok_or_else(|| {
                ControllerError::bad("nothing to change: give guest_address and/or read_only")
            })?;
            return Ok(memory.set_read_only(id, read_only)?);
        };
        let region = memory
            .region(id)
            .ok_or(kvm_memslots::Error::UnknownRegion(id))?;
        let (old_gpa, size) = (region.gpa, region.size);
        self.outside_hotplug_area(gpa, size)?;
        memory.move_region(id, GuestAddress(gpa))?;
        if let Some(read_only) = patch.read_only {
            if let Err(e) = memory.set_read_only(id, read_only) {
                // Both changes or neither: move it back.
                let undo = match memory.move_region(id, old_gpa) {
                    Ok(()) => "the move was undone".to_owned(),
                    Err(u) => {
                        format!("undoing the move failed too ({u}): the region is at {gpa:#x}")
                    }
                };
                return Err(ControllerError::from(e).and(undo));
            }
        }
        Ok(())
    }
}
