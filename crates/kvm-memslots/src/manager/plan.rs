//! The KVM requests a change is planned as, each with what undoes it.

use crate::kvm::KvmSlot;
use crate::memory::GuestSlotData;
use crate::region_memory::RegionId;

/// One KVM request of a planned change, with what undoes it.
#[derive(Debug, Clone, Copy)]
pub(super) enum KvmOp {
    Create(KvmSlot),
    Delete(KvmSlot),
    /// Same slot number, host range and size: a MOVE (new guest base) or FLAGS_ONLY change.
    Update {
        old: KvmSlot,
        new: KvmSlot,
    },
}

impl KvmOp {
    pub(super) fn request(&self) -> KvmSlot {
        match *self {
            KvmOp::Create(s) => s,
            KvmOp::Delete(s) => s.deleted(),
            KvmOp::Update { new, .. } => new,
        }
    }

    pub(super) fn inverse(&self) -> KvmOp {
        match *self {
            KvmOp::Create(s) => KvmOp::Delete(s),
            KvmOp::Delete(s) => KvmOp::Create(s),
            KvmOp::Update { old, new } => KvmOp::Update { old: new, new: old },
        }
    }

    pub(super) fn verb(&self) -> &'static str {
        match self {
            KvmOp::Create(_) => "create",
            KvmOp::Delete(_) => "delete",
            KvmOp::Update { .. } => "update",
        }
    }
}

pub(super) struct Step {
    pub(super) region: RegionId,
    pub(super) op: KvmOp,
    /// Read the slot's dirty log into the region's pending bits just before this step, which
    /// frees it (logging off, or a delete). Reading it right there, rather than all logs up
    /// front, is also cheaper for the kernel.
    pub(super) read_log: bool,
}

impl From<&GuestSlotData> for KvmSlot {
    fn from(slot: &GuestSlotData) -> Self {
        KvmSlot {
            slot: slot.id().0,
            gpa: slot.gpa().0,
            size: slot.size(),
            hva: slot.hva().0,
            flags: slot.flags(),
        }
    }
}
