//! The test guest's hotplug requests: configuring the area, and carrying a plan
//! ([`HotplugArea::plan`]) out through the memory manager, as one change, with the guest
//! checking the memory it plugs.

use std::sync::Arc;

use kvm_memslots::RegionChange;

use super::{Controller, TestGuest, MIB};
use crate::control::hotplug::{HotplugConfig, HotplugRequest};
use crate::control::{ControllerError, ErrorKind};
use crate::lifecycle::{log, LogLevel};
use crate::test_guest;
use crate::test_guest::hotplug::{HotplugArea, HotplugPlan, HotplugState};
use crate::test_guest::HOTPLUG_GPA;

impl Controller {
    /// Takes back a restored VM's hotplug area: its pieces are the regions at their guest
    /// addresses in the restored memory (the state was checked against the layout). The
    /// layout carries no reachability: each piece's unplugged blocks are made unreachable
    /// again and given back; a piece saved with slots over its plugged blocks only (as states
    /// were before pieces kept one slot) then gets its one slot, all such pieces in one
    /// change.
    pub(crate) fn with_hotplug(
        mut self,
        saved: Option<&HotplugState>,
    ) -> Result<Self, ControllerError> {
        self.guest_mut().restore_hotplug(saved)?;
        Ok(self)
    }
}

impl TestGuest {
    /// [`Controller::with_hotplug`]'s work.
    fn restore_hotplug(&mut self, saved: Option<&HotplugState>) -> Result<(), ControllerError> {
        let Some(saved) = saved else {
            return Ok(());
        };
        let slot_size = saved.config.slot_mib() * MIB;
        let memory = Arc::clone(self.vm.memory());
        let regions = memory.regions();
        let mut area = HotplugArea {
            config: saved.config,
            gpa: HOTPLUG_GPA,
            slot_size,
            plugged_blocks: saved.plugged_blocks,
            pieces: vec![None; saved.mapped.len()],
        };
        let mut reslots = Vec::new();
        for (i, _) in saved.mapped.iter().enumerate().filter(|(_, m)| **m) {
            let (gpa, size) = (area.slot_gpa(i).0, area.piece_size(i));
            let region = regions
                .iter()
                .find(|r| r.gpa.0 == gpa && r.size == size)
                .map(|r| r.id)
                .ok_or_else(|| {
                    ControllerError::bad(format!(
                        "the snapshot's hotplug slot {i} at {gpa:#x} is not in its memory layout"
                    ))
                })?;
            let unreachable = area.piece_unreachable(i, saved.plugged_blocks);
            if !unreachable.is_empty() {
                memory
                    .set_accessible(region, &unreachable, false)
                    .map_err(|e| {
                        ControllerError::from(e)
                            .and("the hotplug area's unplugged blocks were not made unreachable")
                    })?;
                for range in unreachable {
                    let _ = memory.discard_region(region, range);
                }
            }
            let wanted = area.piece_slots(i, saved.plugged_blocks);
            if memory.slot_ranges(region).as_ref() != Some(&wanted) {
                reslots.push(RegionChange::Reslot(kvm_memslots::Reslot {
                    region,
                    range: 0..size,
                    slots: wanted,
                }));
            }
            area.pieces[i] = Some(region);
        }
        if !reslots.is_empty() {
            memory.apply(reslots).map_err(|e| {
                ControllerError::from(e)
                    .and("the hotplug area's partly plugged pieces did not get their one slot")
            })?;
        }
        self.hotplug = Some(area);
        Ok(())
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
        // The slots it may take: KVM's free ones, within the slot budget (`--max-slots`), so
        // that no plug is refused half-way later for want of slots.
        let usage = memory.slot_usage();
        let within_budget = memory.limits().max_slots.saturating_sub(usage.used as u64);
        let area = HotplugArea::new(
            config,
            HOTPLUG_GPA,
            test_guest::IDENTITY_MAPPED,
            usage
                .free
                .min(usize::try_from(within_budget).unwrap_or(usize::MAX)),
        )?;
        // All of it plugged must be admissible now: refuse an area that could only ever be
        // plugged in part.
        let total = area.range().end - area.gpa;
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
            .admit(total, area.piece_size(0))
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
        let before = area.plugged_blocks;
        // Blocks it unplugs must not be under a guest command, as a region removed must not.
        let block = area.block_size();
        let after = request.requested_size_mib.saturating_mul(MIB) / block;
        if after < before {
            let gone = area.gpa + after * block..area.gpa + before * block;
            self.refuse_under_commands(0, &[gone], super::guest::RegionChange::Unplug)?;
        }
        // What the plug maps (pieces that get their first block, or a slot that grows over
        // more of its piece), each piece's part checked by the guest as an added region is.
        let checks: Vec<_> = plan
            .pieces
            .iter()
            .filter_map(|p| p.plugged().map(|range| (p.index, range)))
            .collect();
        if !checks.is_empty() {
            self.guest_can_check(&format!(
                "plugging {} MiB maps new memory, which the guest checks",
                request.requested_size_mib
            ))?;
        }
        if self.interrupted() {
            return Err(self.stopped_early(0, plan.pieces.len()));
        }
        // The whole request in one change of the manager: all of it or none.
        self.carry_out(&plan)?;
        for (done, (piece, range)) in checks.iter().enumerate() {
            let region = self.area_mut().pieces[*piece].expect("a plugged piece has a region");
            let checked = if self.interrupted() {
                Err(None)
            } else {
                let size = range.end - range.start;
                self.check_new(region, range.start, size, size)
                    .map_err(Some)
            };
            let Err(why) = checked else { continue };
            if why.is_none() || self.interrupted() {
                // A signal: what the guest checked stays, the rest goes.
                let area = self.area_mut();
                let kept = if done == 0 {
                    before
                } else {
                    (checks[done - 1].1.end - area.gpa) / area.block_size()
                };
                let undone = self.put_back(kept);
                let stopped = self.stopped_early(done, checks.len());
                let stopped = match why {
                    Some(e) => stopped.and(e),
                    None => stopped,
                };
                return Err(with_undo_failure(stopped, undone));
            }
            let failed = format!(
                "the guest's check of the new memory at {:#x} failed: {}",
                range.start,
                why.unwrap_or_default()
            );
            return Err(match self.put_back(before) {
                Ok(()) => {
                    ControllerError::internal(format!("{failed}; the memory was removed again"))
                }
                Err(stuck) => ControllerError::internal(failed).and(stuck),
            });
        }
        Ok(())
    }

    /// Carries `plan` out ([`HotplugArea::carry_out`]: nothing changes if it fails), which
    /// gives back to the host the memory of blocks it unplugged in pieces that stay.
    fn carry_out(&mut self, plan: &HotplugPlan) -> Result<(), ControllerError> {
        let memory = Arc::clone(self.vm.memory());
        // Best effort: the blocks are unplugged (unreachable) whatever madvise says, and a
        // later plug of them is the area's to reuse.
        for e in self.area_mut().carry_out(&memory, plan)? {
            log(
                LogLevel::Warn,
                format!("giving back unplugged hotplug memory: {e}"),
            );
        }
        Ok(())
    }

    /// Puts the area back to `blocks` plugged (after a check failed, or a signal), in one
    /// change; the error says what stays if even that fails.
    fn put_back(&mut self, blocks: u64) -> Result<(), String> {
        let plan = self.area_mut().plan_blocks(blocks);
        self.carry_out(&plan).map_err(|e| {
            let area = self.area_mut();
            format!(
                "putting the hotplug area back to {} MiB failed too ({e}): {} MiB stay plugged",
                blocks * area.config.block_size_mib,
                area.plugged_blocks * area.config.block_size_mib
            )
        })
    }

    /// A signal stopped a plug or unplug after `done` of `of` slots: `GET /hotplug/memory`
    /// reports what the area holds now.
    fn stopped_early(&mut self, done: usize, of: usize) -> ControllerError {
        let area = self.area_mut();
        let mib = area.plugged_blocks * area.config.block_size_mib;
        ControllerError::new(
            ErrorKind::Unavailable,
            format!(
                "the VMM is stopping (a signal came): the request stopped after {done} of {of} slots; {mib} MiB are plugged"
            ),
        )
    }

    fn area_mut(&mut self) -> &mut HotplugArea {
        self.hotplug
            .as_mut()
            .expect("the hotplug area is configured")
    }
}

/// `error`, made internal and told what stays plugged, if `undone` failed.
fn with_undo_failure(error: ControllerError, undone: Result<(), String>) -> ControllerError {
    match undone {
        Ok(()) => error,
        Err(stuck) => ControllerError::internal(error.message).and(stuck),
    }
}

pub(super) fn no_hotplug_area() -> ControllerError {
    ControllerError::not_found("no hotplug area: configure one with PUT /hotplug/memory")
}
