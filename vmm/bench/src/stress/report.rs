//! What a stress run did: the changes the host made and what the vCPUs did, and how it reads.

use std::time::Duration;

use serde::Serialize;

use super::config::{ABOVE_PAGES, MOVER_PAGES, VERIFY_SLOTS};

/// How many changes of each kind the host made.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ChangeCounts {
    /// Iterations run.
    pub iterations: u64,
    /// One-page regions added and removed just below the test area.
    pub below_add_removes: u64,
    /// Regions of one-page slots added and removed just above the test area.
    pub above_add_removes: u64,
    /// Moves of the two-slot region.
    pub moves: u64,
    /// Read-only toggles of the verifier's region (each way counts).
    pub read_only_toggles: u64,
    /// Dirty logging started on the test area.
    pub dirty_log_starts: u64,
    /// Dirty logging stopped on the test area.
    pub dirty_log_stops: u64,
    /// Harvests of the test area.
    pub harvests: u64,
    /// Pages those harvests reported.
    pub dirty_pages_harvested: u64,
    /// Harvests checked against what the writers changed since the one before.
    pub dirty_rounds_checked: u64,
    /// Scans of the writers' parts for lost writes while they ran.
    pub scans: u64,
}

/// What a stress run did.
#[derive(Debug, Clone, Serialize)]
pub struct StressReport {
    /// Writer vCPUs.
    pub vcpus: usize,
    /// The verifier's vCPU.
    pub verifier_vcpu: usize,
    /// Whether the verifier ran beside the writers (otherwise in a phase after them).
    pub verifier_alongside: bool,
    /// The test area's base.
    pub area_gpa: u64,
    /// Bytes of test area.
    pub area_size: u64,
    /// Its KVM slots.
    pub area_slots: u64,
    /// The writers' stride.
    pub stride: u64,
    /// Changes the host made (both phases).
    pub changes: ChangeCounts,
    /// Write passes each writer completed.
    pub passes: Vec<u64>,
    /// Verify commands the verifier completed.
    pub verifies: u64,
    /// Exits of every vCPU.
    pub exits: u64,
    /// Accesses to slots that were away during a change, finished against memory, per vCPU.
    pub completed_after_change: Vec<u64>,
    /// Writes to read-only memory dropped (none expected).
    pub read_only_writes: u64,
    /// In ring mode, the size of each vCPU's dirty ring.
    pub dirty_ring: Option<u32>,
    /// Exits on a full dirty ring, all vCPUs together (ring mode).
    pub dirty_ring_full: u64,
    /// From starting the write loops to the end of the last check.
    #[serde(rename = "duration_ms", serialize_with = "tinyvmm::jobs::millis")]
    pub duration: Duration,
}

impl StressReport {
    /// Accesses completed after a change, all vCPUs together.
    pub fn total_completed_after_change(&self) -> u64 {
        self.completed_after_change.iter().sum()
    }
}

impl std::fmt::Display for StressReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let c = &self.changes;
        writeln!(
            f,
            "stress: {} writer vCPU(s) over {} KiB at {:#x} ({} slots, stride {}); verifier: vCPU {} {}",
            self.vcpus,
            self.area_size / 1024,
            self.area_gpa,
            self.area_slots,
            self.stride,
            self.verifier_vcpu,
            if self.verifier_alongside {
                "alongside the writers"
            } else {
                "after the writers stopped"
            }
        )?;
        writeln!(f, "  iterations          {:8}", c.iterations)?;
        writeln!(
            f,
            "  below add+remove    {:8}  (a one-page region right under the area)",
            c.below_add_removes
        )?;
        writeln!(
            f,
            "  above add+remove    {:8}  ({ABOVE_PAGES} one-page slots right over the area)",
            c.above_add_removes
        )?;
        writeln!(
            f,
            "  moves               {:8}  (a region of {MOVER_PAGES} one-page slots)",
            c.moves
        )?;
        writeln!(
            f,
            "  read-only toggles   {:8}  ({VERIFY_SLOTS} slots deleted and re-created each)",
            c.read_only_toggles
        )?;
        writeln!(
            f,
            "  dirty logging       {:8} starts, {} stops (flags-only), {} harvests",
            c.dirty_log_starts, c.dirty_log_stops, c.harvests
        )?;
        writeln!(
            f,
            "  dirty pages         {:8} harvested; {} harvests checked against the writers",
            c.dirty_pages_harvested, c.dirty_rounds_checked
        )?;
        writeln!(
            f,
            "  lost-write scans    {:8}  (of one writer's part while it ran)",
            c.scans
        )?;
        writeln!(f, "  passes per writer   {:?}", self.passes)?;
        writeln!(f, "  verifies            {:8}", self.verifies)?;
        writeln!(
            f,
            "  exits               {:8}; completed after a change: {} (per vCPU {:?})",
            self.exits,
            self.total_completed_after_change(),
            self.completed_after_change
        )?;
        if let Some(entries) = self.dirty_ring {
            writeln!(
                f,
                "  dirty ring          {:8} entries per vCPU; {} exits on a full ring",
                entries, self.dirty_ring_full
            )?;
        }
        write!(
            f,
            "  duration            {:8.3} s",
            self.duration.as_secs_f64()
        )
    }
}
