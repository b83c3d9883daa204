//! What a vCPU's exits add up to: each vCPU's own counters, readable while it runs, and the
//! totals of every vCPU this process started, for `GET /metrics`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use crate::vm::exit::{Exit, EXIT_KINDS};

/// Counts of the exits a vCPU handled, readable while it runs.
#[derive(Debug, Default)]
pub struct ExitCounters {
    /// Accesses to memory that was away during a slot change, finished against the map.
    pub completed_after_change: AtomicU64,
    /// Exits inside the expected window.
    pub expected: AtomicU64,
    /// Writes to read-only slots, dropped.
    pub read_only_writes: AtomicU64,
    /// Accesses to memory that is absent on purpose (unplugged virtio-mem blocks).
    pub absent_memory: AtomicU64,
    /// Instructions KVM could not emulate (VEX accesses, instruction fetches) that met a slot
    /// away during a change, run again once it was done.
    pub retried_after_change: AtomicU64,
    /// Accesses that faulted inside KVM on unreachable memory under a slot (an unplugged
    /// virtio-mem block in a plugged piece), after which its slot was taken away and the
    /// access run again (it then exits as absent memory).
    pub unreachable_isolated: AtomicU64,
    /// Instructions KVM could not emulate at guest CPL > 0 with no slot change during the run,
    /// answered with `#UD` in the guest (as KVM answers them without
    /// `KVM_CAP_EXIT_ON_EMULATION_FAILURE`).
    pub(crate) invalid_opcodes_injected: AtomicU64,
    /// Every exit by its kind ([`Exit::kind`], named by [`EXIT_KINDS`]).
    pub(crate) by_kind: [AtomicU64; EXIT_KINDS.len()],
}

impl ExitCounters {
    /// Every exit: the kinds' counts added up.
    pub fn exits(&self) -> u64 {
        self.by_kind.iter().map(|c| c.load(Ordering::Relaxed)).sum()
    }

    /// Exits on a full dirty ring.
    pub fn dirty_ring_full(&self) -> u64 {
        self.by_kind[Exit::DirtyRingFull.kind()].load(Ordering::Relaxed)
    }
}

/// The counters of every vCPU this process started, for [`exit_totals`]: kept for the
/// process's life (a few hundred bytes each), so that totals never go down when a VM's vCPUs
/// end.
static STARTED: Mutex<Vec<Arc<ExitCounters>>> = Mutex::new(Vec::new());

/// Counts a starting vCPU's `counters` in [`exit_totals`], for the rest of the process's life.
pub(super) fn register(counters: Arc<ExitCounters>) {
    STARTED
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .push(counters);
}

/// The exits of every vCPU this process started ([`exit_totals`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ExitTotals {
    /// Every exit, by its kind ([`EXIT_KINDS`]): they add up to all exits.
    pub(crate) by_kind: Vec<(&'static str, u64)>,
    /// Exits the loop handled its own way (some of the MMIO, memory-fault and
    /// emulation-failure ones): writes to read-only memory dropped (`read_only_write`),
    /// accesses to absent memory (`absent_memory`), accesses completed against the map after a
    /// slot change (`completed_after_change`), instructions KVM could not emulate, run again
    /// after a slot change (`retried_after_change`) or, in guest user mode with no change,
    /// answered with `#UD` in the guest (`invalid_opcode_injected`), and faults on unreachable
    /// memory under a slot after which the slot went and the access ran again
    /// (`unreachable_isolated`).
    pub(crate) handled: Vec<(&'static str, u64)>,
}

/// The exits of every vCPU this process started, for `GET /metrics`. Read from each vCPU's
/// own counters, so counting costs the exit loop no cache line shared with another vCPU.
pub(crate) fn exit_totals() -> ExitTotals {
    let started = STARTED.lock().unwrap_or_else(|p| p.into_inner());
    let sum = |count: &dyn Fn(&ExitCounters) -> &AtomicU64| -> u64 {
        started
            .iter()
            .map(|counters| count(counters).load(Ordering::Relaxed))
            .sum()
    };
    ExitTotals {
        by_kind: EXIT_KINDS
            .iter()
            .enumerate()
            .map(|(i, &name)| (name, sum(&|c| &c.by_kind[i])))
            .collect(),
        handled: vec![
            ("read_only_write", sum(&|c| &c.read_only_writes)),
            ("absent_memory", sum(&|c| &c.absent_memory)),
            (
                "completed_after_change",
                sum(&|c| &c.completed_after_change),
            ),
            ("retried_after_change", sum(&|c| &c.retried_after_change)),
            ("unreachable_isolated", sum(&|c| &c.unreachable_isolated)),
            (
                "invalid_opcode_injected",
                sum(&|c| &c.invalid_opcodes_injected),
            ),
        ],
    }
}
