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
            .current()
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
        // Plug: map every slot that gets a first block in one batch (all or none of them),
        // then let the guest check each, as it checks an added region (an unplug, or a plug
        // into slots already mapped, runs nothing in the guest). If a check fails, they all go
        // again in one batch: the area stays as it was.
        if !plan.map.is_empty() {
            self.guest_can_check(&format!(
                "plugging {} MiB maps {} new slots, which the guest checks",
                request.requested_size_mib,
                plan.map.len()
            ))?;
            if self.interrupted() {
                return Err(self.stop_hotplug_early(plan.blocks, 0, plan.map.len()));
            }
            let specs: Vec<RegionSpec> = plan
                .map
                .iter()
                .map(|&(_, gpa)| RegionSpec::new(gpa, slot_size))
                .collect();
            let ids = self.vm.memory().add_regions(specs)?;
            let added: Vec<(usize, RegionId)> = plan.map.iter().map(|&(i, _)| i).zip(ids).collect();
            for &(i, id) in &added {
                self.area_mut().slots[i] = Some(id);
            }
            // A signal stops the checks at a slot boundary (or during one's check, with why).
            let mut cut = None;
            for (done, (&(_, gpa), &(_, id))) in plan.map.iter().zip(&added).enumerate() {
                if self.interrupted() {
                    cut = Some((done, None));
                    break;
                }
                if let Err(e) = self.check_new(id, gpa.0, slot_size, slot_size) {
                    if self.interrupted() {
                        cut = Some((done, Some(e)));
                        break;
                    }
                    let failed = ControllerError::internal(format!(
                        "the guest's check of the new memory at {:#x} failed: {e}; the memory was removed again",
                        gpa.0
                    ));
                    let dropped = self.drop_slots(&added);
                    return Err(with_drop_failure(failed, dropped));
                }
            }
            if let Some((done, why)) = cut {
                // The slots checked so far stay, the others go.
                let dropped = self.drop_slots(&added[done..]);
                let stopped = self.stop_hotplug_early(plan.blocks, done, plan.map.len());
                let stopped = match why {
                    Some(e) => stopped.and(e),
                    None => stopped,
                };
                return Err(with_drop_failure(stopped, dropped));
            }
        }
        // Unplug: unmap the slots left with no plugged block, in one batch; give back unplugged
        // blocks inside a slot that stays.
        if !plan.unmap.is_empty() {
            if self.interrupted() {
                return Err(self.stop_hotplug_early(plan.blocks, 0, plan.unmap.len()));
            }
            self.vm
                .memory()
                .remove_regions(plan.unmap.iter().map(|&(_, id)| id))?;
            for &(i, _) in &plan.unmap {
                self.area_mut().slots[i] = None;
            }
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

    /// Removes the slots `added` in one batch (those of a plug that failed or stopped).
    fn drop_slots(&mut self, added: &[(usize, RegionId)]) -> Result<(), String> {
        self.vm
            .memory()
            .remove_regions(added.iter().map(|&(_, id)| id))
            .map_err(|e| {
                let ids: Vec<u64> = added.iter().map(|&(_, id)| id.0).collect();
                format!("removing the slots mapped for it failed too ({e}): regions {ids:?} stay")
            })?;
        for &(i, _) in added {
            self.area_mut().slots[i] = None;
        }
        Ok(())
    }

    fn area_mut(&mut self) -> &mut HotplugArea {
        self.hotplug
            .as_mut()
            .expect("the hotplug area is configured")
    }
}

/// `error`, made internal and told that the slots mapped for it stay, if `dropped` failed.
fn with_drop_failure(error: ControllerError, dropped: Result<(), String>) -> ControllerError {
    match dropped {
        Ok(()) => error,
        Err(stuck) => ControllerError::internal(error.message).and(stuck),
    }
}

pub(super) fn no_hotplug_area() -> ControllerError {
    ControllerError::not_found("no hotplug area: configure one with PUT /hotplug/memory")
}
