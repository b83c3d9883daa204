//! What the stress mode runs and how it fails: the configuration, the layout's constants and the
//! errors.

use std::time::Duration;

use kvm_memslots::{MemoryLimits, PAGE_SIZE};

use tinyvmm::test_guest;
use tinyvmm::test_guest::area::AreaError;
use tinyvmm::test_guest::vcpus::GuestError;

/// Where the region the verifier reads (and the host toggles read-only) starts.
pub const VERIFY_GPA: u64 = 128 << 20;
/// Size of the verifier's region.
pub const VERIFY_SIZE: u64 = 1 << 20;
/// KVM slots of the verifier's region (each is deleted and re-created on a toggle).
pub(super) const VERIFY_SLOTS: u64 = 8;
/// The verifier checks every u64 of its region.
pub(super) const VERIFY_STRIDE: u64 = 8;
pub(super) const VERIFY_SEED: u64 = 0x5eed_0000_7e51_0003;
/// Writer `i` starts its passes at `WRITE_SEED + (i << 32)`.
pub(super) const WRITE_SEED: u64 = 0x5eed_1000_0000_0000;
/// One-page slots of the region added and removed just above the area.
pub(super) const ABOVE_PAGES: u64 = 4;
/// One-page slots of the region that moves around.
pub(super) const MOVER_PAGES: u64 = 2;
/// Pages of the window (right above the area's neighbour) the mover moves within.
pub(super) const MOVE_WINDOW_PAGES: u64 = 64;
pub(super) const MOVER_STAMP: u64 = 0x5eed_0000_0000_ab0e;
/// Harvests checked in each period of dirty logging.
pub(super) const ROUNDS_PER_LOGGING: u32 = 3;
/// How long the host waits for the writers to make progress before calling them stalled.
pub(super) const STALL_TIMEOUT: Duration = Duration::from_secs(60);

/// What to run.
#[derive(Debug, Clone)]
pub struct StressConfig {
    /// Writer vCPUs (1 to 15); a verifier vCPU runs beside them when there is room for it.
    pub vcpus: usize,
    /// Bytes of the test area per writer (trimmed to whole slots).
    pub part_size: u64,
    /// KVM slots of the test area per writer.
    pub slots_per_vcpu: u64,
    /// Distance between the addresses the writers write (a multiple of 8).
    pub stride: u64,
    /// Iterations of changes (each: every kind of change once, one dirty-logging step); at
    /// least one runs.
    pub iterations: u64,
    /// Changes stop after about this long even if iterations are left (the last round of
    /// dirty logging and the checks follow; without a verifier alongside the writers, half
    /// goes to them and half to the verifier's phase).
    pub duration: Duration,
    /// For testing the checker: after the loops stop, the host puts back what the pass before
    /// the last wrote at the start of this page (an index into the test area), as if the last
    /// pass's write there had been lost; the final check must then fail naming its address.
    pub corrupt_page: Option<u64>,
    /// Harvest from per-vCPU dirty rings of this many entries instead of per-slot bitmaps.
    pub dirty_ring: Option<u32>,
    /// What guest memory is admitted against; `None`: this host's defaults
    /// ([`MemoryLimits::for_this_host`]).
    pub limits: Option<MemoryLimits>,
}

impl Default for StressConfig {
    fn default() -> Self {
        StressConfig {
            vcpus: 2,
            part_size: 4 << 20,
            slots_per_vcpu: 2,
            stride: PAGE_SIZE,
            iterations: 1000,
            duration: Duration::from_secs(10),
            corrupt_page: None,
            dirty_ring: None,
            limits: None,
        }
    }
}

/// Why a stress run failed.
#[derive(Debug, thiserror::Error)]
pub enum StressError {
    /// The VM failed, or a vCPU stopped on an error, or the verifier found wrong data.
    #[error(transparent)]
    Vm(#[from] GuestError),
    /// The test area could not be made.
    #[error(transparent)]
    Area(#[from] AreaError),
    /// The manager refused a change.
    #[error("{what} failed: {source}")]
    Change {
        /// The change.
        what: &'static str,
        /// The manager's error.
        source: kvm_memslots::Error,
    },
    /// A writer count the test guest has no room for.
    #[error("{0} writer vCPUs asked for; the stress mode runs 1 to {max}", max = test_guest::MAX_VCPUS)]
    VcpuCount(usize),
    /// A stride that is no multiple of 8 or does not fit a part.
    #[error("stride {stride:#x} must be a non-zero multiple of 8 and at most a part ({part_size:#x} bytes)")]
    Stride {
        /// The stride asked for.
        stride: u64,
        /// Bytes per writer.
        part_size: u64,
    },
    /// The writers' memory (and the regions above it) would not fit in what the guest maps.
    #[error("{size:#x} bytes of writers' memory asked for; the guest's page tables leave room for {limit:#x}")]
    AreaSize {
        /// Bytes asked for.
        size: u64,
        /// Bytes that fit.
        limit: u64,
    },
    /// The page to corrupt is not in the test area.
    #[error("page {page} is outside the test area of {pages} pages")]
    CorruptPage {
        /// The page asked for.
        page: u64,
        /// Pages in the area.
        pages: u64,
    },
    /// An address holds an older pass's pattern than the writer has since written there.
    #[error("lost write at {gpa:#x} (vCPU {vcpu}): found {found:#x}, but pass {pass} (pattern {expected:#x}) or a later one had been written there")]
    LostWrite {
        /// The writer.
        vcpu: usize,
        /// The address.
        gpa: u64,
        /// What it holds.
        found: u64,
        /// The oldest pass it may hold.
        pass: u64,
        /// That pass's pattern.
        expected: u64,
    },
    /// An address holds something no pass of its writer has written (yet).
    #[error("wrong data at {gpa:#x} (vCPU {vcpu}): found {found:#x}, which none of the {passes} passes it had started writes there")]
    WrongData {
        /// The writer.
        vcpu: usize,
        /// The address.
        gpa: u64,
        /// What it holds.
        found: u64,
        /// Passes the writer had started.
        passes: u64,
    },
    /// The guest wrote an address while dirty logging was on, but no harvest reported its page.
    #[error("dirty page missed at {gpa:#x} (vCPU {vcpu}): it changed from {before:#x} to {after:#x} between two harvests while logging, but the second did not report it")]
    DirtyPageMissed {
        /// The writer.
        vcpu: usize,
        /// The address.
        gpa: u64,
        /// Its value after the first harvest.
        before: u64,
        /// Its value before the second.
        after: u64,
    },
    /// The first harvest after logging started missed a page, though KVM's logs start all set.
    #[error("the first harvest after dirty logging started did not report page {gpa:#x}, though KVM's logs start all set")]
    FirstHarvest {
        /// The page.
        gpa: u64,
    },
    /// A harvest of the test area did not come back as one region's pages.
    #[error("harvesting the test area returned {0} regions' pages instead of one")]
    Harvest(usize),
    /// Memory of the moving region holds something else after a move.
    #[error("after moving a region to {gpa:#x}, the host found {found:#x} at {at:#x} instead of its stamp {expected:#x}")]
    MovedData {
        /// The region's new base.
        gpa: u64,
        /// The address read.
        at: u64,
        /// What it holds.
        found: u64,
        /// What the host had written there before the move.
        expected: u64,
    },
    /// A writer completed no pass for too long.
    #[error("vCPU {vcpu} completed no write pass in {waited:?} (stuck at {passes} passes)")]
    Stalled {
        /// The writer.
        vcpu: usize,
        /// Its passes.
        passes: u64,
        /// How long the host waited.
        waited: Duration,
    },
    /// The eventfd that tells the job a vCPU stopped could not be made.
    #[error("creating an eventfd failed: {0}")]
    EventFd(std::io::Error),
    /// A vCPU stopped during the run without an error the host could collect.
    #[error("a vCPU stopped during the run")]
    VcpuStopped,
    /// Reading or writing guest memory from the host failed.
    #[error("host access at {gpa:#x} failed: {source}")]
    Access {
        /// The address.
        gpa: u64,
        /// vm-memory's error.
        source: vm_memory::GuestMemoryError,
    },
    /// The run was interrupted (a signal).
    #[error("interrupted")]
    Interrupted,
}

pub(super) fn change<T>(
    what: &'static str,
    result: Result<T, kvm_memslots::Error>,
) -> Result<T, StressError> {
    result.map_err(|source| StressError::Change { what, source })
}
