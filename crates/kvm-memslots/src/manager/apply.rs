//! The change pipeline: a change's planned KVM requests applied in order, the applied ones
//! undone last first when KVM refuses one (or put back as well as can be when a KVM call
//! panics), and the new map version published only once all of them succeeded.

use std::sync::{Arc, MutexGuard};

use memslot_map::{Change, MapError, MemslotMap, SlotId};
use vmm_sys_util::errno::Error as Errno;

use super::plan::{KvmOp, Step};
use super::sequence::ChangeSequence;
use super::{Broken, MemoryManager, State, Writer};
use crate::error::Error;
use crate::kvm::{KvmMemory, KvmSlot};
use crate::memory::SlotBacking;
use crate::region_memory::RegionId;
use crate::PAGE_SIZE;

impl<K: KvmMemory> MemoryManager<K> {
    /// Applies `steps` to KVM in order; on a refusal, undoes the applied ones in reverse.
    fn run(&self, state: &mut State, steps: &[Step]) -> Result<(), Error> {
        let mut log = Vec::new();
        for (i, step) in steps.iter().enumerate() {
            let request = step.op.request();
            // A panicking KVM wrapper (a bug) leaves this step's effect unknown: the manager is
            // marked broken, the memory of regions being added stays mapped for good, and the
            // step and those before it are put back as well as can be before the panic goes
            // on (see `recover_from_panic`).
            let attempt = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                match step.op {
                    // Bitmap mode: a logging slot is parked before its log is read (see
                    // `delete_logging_slot`).
                    KvmOp::Delete(old) if step.read_log && !self.kvm.dirty_ring() => {
                        self.delete_logging_slot(state, step.region, old, &mut log)
                    }
                    _ => {
                        let read = if step.read_log && !self.kvm.dirty_ring() {
                            self.read_freed_log(state, step, &mut log)
                        } else {
                            Ok(())
                        };
                        read.and_then(|()| self.request(step.region, step.op.verb(), &request))
                    }
                }
            }));
            let applied = match attempt {
                Ok(applied) => applied,
                Err(panic) => {
                    state.broken = Some(Broken::Panicked { slot: request.slot });
                    let adding = std::mem::take(&mut state.adding);
                    state.orphans.extend(adding);
                    self.recover_from_panic(state, step, &steps[..i], &mut log);
                    std::panic::resume_unwind(panic);
                }
            };
            if let Err(failed) = applied {
                if state.broken.is_some() {
                    // The step's own undo failed (a parked slot that could not be moved
                    // back): KVM and the map disagree already.
                    return Err(failed);
                }
                return Err(match self.undo(state, &steps[..i], &mut log) {
                    Ok(()) => failed,
                    Err((undo_op, slot, undo_errno)) => Error::UndoFailed {
                        failed: Box::new(failed),
                        undo_op,
                        slot,
                        undo_errno,
                    },
                });
            }
        }
        Ok(())
    }

    /// After a KVM call of `step` panicked (the steps `done` applied before it): puts KVM's
    /// slots back as the published map has them, as far as KVM lets it, so that harvests go
    /// on working (a slot whose logging was switched off while the map says it logs would fail
    /// every later harvest with `ENOENT`). The step's own effect is unknown, so it is put back
    /// with requests that are right whatever it did: an update or a delete by setting the slot
    /// as it was (a no-op if it is so already, a move back if it was parked, a create if it was
    /// deleted), a create by its undo (whose failure, where the slot was never made, is
    /// ignored). Then `done` is undone as after a refusal. Pages of a slot whose logging may
    /// have been off meanwhile are marked dirty. The manager stays broken (changes refused:
    /// [`Error::BrokenByPanic`], or [`Error::Broken`] if an undo was refused); a panic while
    /// recovering is swallowed, the first one goes on.
    fn recover_from_panic(
        &self,
        state: &mut State,
        step: &Step,
        done: &[Step],
        log: &mut Vec<u64>,
    ) {
        let slot = step.op.request().slot;
        // `undo` reads a set `broken` as its own move back having failed.
        state.broken = None;
        let undone = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            match step.op {
                KvmOp::Update { old, .. } | KvmOp::Delete(old) => {
                    if self.request(step.region, "restore", &old).is_ok() {
                        mark_if_logging_paused(state, step);
                    }
                }
                KvmOp::Create(_) => {
                    // Refused where the call made no slot: nothing to put back then.
                    let _ = self.undo(state, std::slice::from_ref(step), log);
                    state.broken = None;
                }
            }
            self.undo(state, done, log)
        }));
        state.broken = Some(match undone {
            Ok(Err((_, slot, errno))) => Broken::UndoFailed { slot, errno },
            Ok(Ok(())) | Err(_) => Broken::Panicked { slot },
        });
    }

    /// Reverses the steps `done` (all applied), last first. A slot the change created that
    /// logs, for a region in place (a read-only toggle's re-created slot, a re-slot's new
    /// one), is deleted as the change itself deletes one in bitmap mode
    /// ([`delete_logging_slot`](Self::delete_logging_slot)): its log, which holds the guest's
    /// writes since it was created, goes into the region's pending bits first. If that fails
    /// (and the slot is still where it was), the slot is deleted in place and all its pages are
    /// marked dirty. On a refused reversal the rest are not attempted, the manager is marked
    /// broken, and the reversal, its slot and KVM's error are returned.
    fn undo(
        &self,
        state: &mut State,
        done: &[Step],
        log: &mut Vec<u64>,
    ) -> Result<(), (&'static str, u32, Errno)> {
        for step in done.iter().rev() {
            let undo = step.op.inverse();
            let request = undo.request();
            let kept = match undo {
                KvmOp::Delete(created)
                    if created.flags.log_dirty
                        && !self.kvm.dirty_ring()
                        && state.regions.contains_key(&step.region) =>
                {
                    match self.delete_logging_slot(state, step.region, created, log) {
                        Ok(()) => continue,
                        Err(_) if state.broken.is_some() => {
                            // The parked slot could not be moved back.
                            let errno = match state.broken {
                                Some(Broken::UndoFailed { errno, .. }) => errno,
                                _ => Errno::new(libc::EIO),
                            };
                            return Err(("move back", created.slot, errno));
                        }
                        // Still in place, its log unread (or read in part): delete it there
                        // and report every page it covers.
                        Err(_) => Some(created),
                    }
                }
                _ => None,
            };
            // SAFETY: an undo restores a slot KVM had before this change (over memory the
            // manager keeps mapped while KVM has it: see `request`), or deletes one, which
            // needs no memory.
            let undone = unsafe { self.kvm.set_user_memory_region(&request) };
            if let Err(errno) = undone {
                state.broken = Some(Broken::UndoFailed {
                    slot: request.slot,
                    errno,
                });
                return Err((undo.verb(), request.slot, errno));
            }
            if let Some(slot) = kept {
                let owner = &state.regions[&step.region];
                let first = (slot.gpa - owner.gpa.0) / PAGE_SIZE;
                owner.pending().mark(first, slot.size / PAGE_SIZE);
            }
            mark_if_logging_paused(state, step);
        }
        Ok(())
    }

    /// Makes one KVM request for a step of a change of `region`'s slots (`op` names it in an
    /// error).
    pub(super) fn request(
        &self,
        region: RegionId,
        op: &'static str,
        request: &KvmSlot,
    ) -> Result<(), Error> {
        // SAFETY: every request that creates or updates a slot describes memory of a
        // `RegionMemory` that the manager keeps mapped for as long as KVM has the slot: the
        // region's entry in `state.regions` holds it (for a region being added, `state.adding`
        // holds it until it moves into `state.regions` on success, or into `state.orphans` if
        // an undo fails or a call panics), and it is dropped only after KVM's slots in it were
        // deleted. A parked slot (`delete_logging_slot`) is the same memory at another guest
        // address.
        unsafe { self.kvm.set_user_memory_region(request) }.map_err(|source| Error::Kvm {
            region,
            op,
            slot: request.slot,
            gpa: request.gpa,
            size: request.size,
            source,
        })
    }

    /// Validates `changes` against the current version, applies `steps` to KVM, and publishes
    /// the new map version only if both succeeded, all under the writer lock `state` holds.
    pub(super) fn commit(
        &self,
        state: &mut Writer<'_>,
        changes: impl IntoIterator<Item = Change<SlotBacking>>,
        steps: &[Step],
    ) -> Result<(), Error> {
        let current = Arc::clone(state.current());
        let next = current
            .with_changes(changes)
            .map_err(|e| map_error(&current, e.source))?;
        // Ring mode: a step that deletes a slot or stops its logging ends what KVM reports of
        // it. Take its entries first (while its id still names it), and again once the steps
        // are done, for the entries published meanwhile: a deleted slot's id may be reused by
        // another region once the change is done, and an entry left in a ring would then be
        // taken for that region's.
        let ring = self.kvm.dirty_ring();
        let drain = ring
            && steps
                .iter()
                .any(|s| s.read_log || matches!(s.op, KvmOp::Delete(_)));
        if drain {
            self.collect_rings()?;
        }
        // Ring mode: a slot this change creates under a new number for a region in place (a
        // re-slot) is a new view of memory whose pages are not all pending: its entries must
        // find it before it is published, by any collection.
        let creates = ring
            && steps.iter().any(|s| match s.op {
                KvmOp::Create(k) => {
                    state.regions.contains_key(&s.region) && current.get(SlotId(k.slot)).is_none()
                }
                _ => false,
            });
        if creates {
            *self.in_flight() = Some(Arc::new(next.clone()));
        }
        self.sequence.begin();
        // Even again when this returns, and also if a KVM call panics: a vCPU waiting for an
        // even sequence must not wait forever.
        let _even = EndOfChange(&self.sequence);
        let _landed = InFlight(self, creates);
        let applied = self.run(state, steps);
        if (drain && applied.is_ok()) || (creates && applied.is_err()) {
            // The change is made (or undone): a failure here only leaves entries for the next
            // harvest (the ids are not reused before the caller releases them, after this).
            // An undone change drains too: a slot it created and deleted again may have
            // entries, and its number goes back to the allocator.
            let _ = self.collect_rings();
        }
        if applied.is_ok() {
            state.publish(next);
        }
        applied
    }

    /// Ring mode: the version being made, see `in_flight`. Poisoning is ignored: it is only
    /// replaced whole.
    pub(super) fn in_flight(&self) -> MutexGuard<'_, Option<Arc<MemslotMap<SlotBacking>>>> {
        self.in_flight.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// After `step` was reversed (or put back): if it had switched a slot's logging off, the guest
/// could write the slot unlogged until logging came back with a new log, so every page of the
/// slot is marked dirty in its region's pending bits.
fn mark_if_logging_paused(state: &State, step: &Step) {
    if let KvmOp::Update { old, new } = step.op {
        if old.flags.log_dirty && !new.flags.log_dirty {
            if let Some(owner) = state.regions.get(&step.region) {
                let first = (old.gpa - owner.gpa.0) / PAGE_SIZE;
                owner.pending().mark(first, old.size / PAGE_SIZE);
            }
        }
    }
}

/// Names the region in the way of a refused map change.
fn map_error(current: &MemslotMap<SlotBacking>, error: MapError) -> Error {
    if let MapError::Overlap {
        range,
        other,
        other_range,
        ..
    } = error
    {
        if let Some(slot) = current.get(other) {
            return Error::Overlap {
                range,
                other: slot.payload().region(),
                other_range,
            };
        }
    }
    Error::Map(error)
}

/// Forgets the version a change was making (`in_flight`) when dropped: after it is published
/// (or the change undone), so that no moment exists where a created slot is in neither.
struct InFlight<'a, K: KvmMemory>(&'a MemoryManager<K>, bool);

impl<K: KvmMemory> Drop for InFlight<'_, K> {
    fn drop(&mut self) {
        if self.1 {
            *self.0.in_flight() = None;
        }
    }
}

/// Ends a change in the change sequence (makes it even again) when dropped.
struct EndOfChange<'a>(&'a ChangeSequence);

impl Drop for EndOfChange<'_> {
    fn drop(&mut self) {
        self.0.end();
    }
}
