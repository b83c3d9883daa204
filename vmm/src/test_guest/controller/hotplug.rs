//! The test guest's hotplug requests: configuring the area, and carrying a plan
//! ([`HotplugArea::plan`]) out through the memory manager with the guest checking each slot it
//! maps.

use kvm_memslots::{RegionId, RegionSpec};

use super::{Controller, HOTPLUG_GPA, MIB};
use crate::control::hotplug::{HotplugConfig, HotplugRequest};
use crate::control::{ControllerError, ErrorKind};
use crate::test_guest;
use crate::test_guest::hotplug::HotplugArea;
use crate::test_guest::snapshot::HotplugState;

impl Controller {
    /// Takes back a restored VM's hotplug area: its mapped slots are the regions at their guest
    /// addresses in the restored memory.
    pub fn with_hotplug(mut self, saved: Option<&HotplugState>) -> Result<Self, ControllerError> {
        let Some(saved) = saved else {
            return Ok(self);
        };
        let block = saved.config.block_size_mib;
        let slot_size = saved.config.slot_size_mib.unwrap_or(block) * MIB;
        let regions = self.vm.memory().regions();
        let slots = saved
            .mapped
            .iter()
            .enumerate()
            .map(|(i, mapped)| {
                let gpa = HOTPLUG_GPA + i as u64 * slot_size;
                if !mapped {
                    return Ok(None);
                }
                regions
                    .iter()
                    .find(|r| r.gpa.0 == gpa && r.size == slot_size)
                    .map(|r| Some(r.id))
                    .ok_or_else(|| {
                        ControllerError::bad(format!(
                            "the snapshot's hotplug slot {i} at {gpa:#x} is not in its memory layout"
                        ))
                    })
            })
            .collect::<Result<Vec<_>, _>>()?;
        self.hotplug = Some(HotplugArea {
            config: saved.config,
            gpa: HOTPLUG_GPA,
            slot_size,
            plugged_blocks: saved.plugged_blocks,
            slots,
        });
        Ok(self)
    }

    pub(super) fn configure_hotplug(
        &mut self,
        config: HotplugConfig,
    ) -> Result<(), ControllerError> {
        if self.hotplug.as_ref().is_some_and(|h| h.plugged_blocks > 0) {
            return Err(ControllerError::conflict(
                "the hotplug area has plugged memory: unplug it all first",
            ));
        }
        let memory = self.vm.memory();
        let area = HotplugArea::new(
            config,
            HOTPLUG_GPA,
            test_guest::IDENTITY_MAPPED,
            memory.slot_usage().free,
        )?;
        // All of it plugged must be admissible now: refuse an area that could only ever be
        // plugged in part.
        let total = area.slots.len() as u64 * area.slot_size;
        // Its range is reserved from now on: nothing else may be there.
        if let Some(other) = memory
            .snapshot()
            .map()
            .first_overlap(area.gpa, area.gpa + total)
        {
            return Err(ControllerError::conflict(format!(
                "region {} at {} is inside the hotplug area [{:#x}, {:#x}): move or remove it first",
                other.payload().region(),
                other.gpa_range(),
                area.gpa,
                area.gpa + total
            )));
        }
        memory
            .admit(total, area.slot_size)
            .map_err(|e| ControllerError::from(e).and("the hotplug area was not configured"))?;
        self.hotplug = Some(area);
        Ok(())
    }

    pub(super) fn request_hotplug(
        &mut self,
        request: HotplugRequest,
    ) -> Result<(), ControllerError> {
        let area = self.hotplug.as_ref().ok_or_else(no_hotplug_area)?;
        let plan = area.plan(request.requested_size_mib)?;
        let slot_size = area.slot_size;
        // Plug: map the slots that get a first block, and let the guest check them. If any of
        // that fails, the slots mapped so far go again: the area stays as it was.
        let mut added = Vec::new();
        for &(i, gpa) in &plan.map {
            if self.interrupted() {
                // Stop at a slot boundary: the slots plugged so far stay, each checked.
                return Err(self.stop_hotplug_early(plan.blocks, added.len(), plan.map.len()));
            }
            let spec = RegionSpec::new(gpa, slot_size);
            match self.add_checked(spec, slot_size, true) {
                Ok(id) => {
                    self.area_mut().slots[i] = Some(id);
                    added.push((i, id));
                }
                Err(failed) if self.interrupted() => {
                    // The signal came during this slot's check, which removed the slot again.
                    let stopped = self.stop_hotplug_early(plan.blocks, added.len(), plan.map.len());
                    return Err(stopped.and(failed.message));
                }
                Err(failed) => return Err(self.unplug_after_failure(failed, added)),
            }
        }
        // Unplug: unmap the slots left with no plugged block; give back unplugged blocks
        // inside a slot that stays.
        for (done, &(i, id)) in plan.unmap.iter().enumerate() {
            if self.interrupted() {
                return Err(self.stop_hotplug_early(plan.blocks, done, plan.unmap.len()));
            }
            if let Err(e) = self.vm.memory().remove_region(id) {
                let area = self.area_mut();
                area.settle(area.plugged_blocks);
                return Err(e.into());
            }
            self.area_mut().slots[i] = None;
        }
        if let Some((gpa, len)) = plan.discard {
            self.vm.memory().discard(gpa, len)?;
        }
        self.area_mut().plugged_blocks = plan.blocks;
        Ok(())
    }

    /// A signal stopped a plug or unplug after `done` of `of` slots: the area counts as
    /// plugged what its mapped slots hold (never past the request on a plug, never more than
    /// before on an unplug), which `GET /hotplug/memory` reports.
    fn stop_hotplug_early(&mut self, requested: u64, done: usize, of: usize) -> ControllerError {
        let area = self.area_mut();
        let mib = area.settle(requested.max(area.plugged_blocks)) * area.config.block_size_mib;
        ControllerError::new(
            ErrorKind::Unavailable,
            format!(
                "the VMM is stopping (a signal came): the request stopped after {done} of {of} slots; {mib} MiB are plugged"
            ),
        )
    }

    /// Removes the slots a failed plug mapped, newest first; returns `failed`, or an internal
    /// error naming the slots that could not be removed.
    fn unplug_after_failure(
        &mut self,
        failed: ControllerError,
        added: Vec<(usize, RegionId)>,
    ) -> ControllerError {
        let mut stuck = Vec::new();
        for (i, id) in added.into_iter().rev() {
            match self.vm.memory().remove_region(id) {
                Ok(()) => self.area_mut().slots[i] = None,
                Err(e) => stuck.push(format!("slot {i} (region {id}): {e}")),
            }
        }
        if stuck.is_empty() {
            return failed;
        }
        ControllerError::internal(failed.message).and(format!(
            "undoing the slots plugged before failed too: {}",
            stuck.join("; ")
        ))
    }

    fn area_mut(&mut self) -> &mut HotplugArea {
        self.hotplug
            .as_mut()
            .expect("the hotplug area is configured")
    }
}

pub(super) fn no_hotplug_area() -> ControllerError {
    ControllerError::not_found("no hotplug area: configure one with PUT /hotplug/memory")
}
