//! What the suite runs and why it may not: the scenarios, the configuration, the errors and the
//! reasons a test is skipped.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use kvm_memslots::{MemoryLimits, PAGE_SIZE};
use serde::Serialize;

use tinyvmm::test_guest;
use tinyvmm::test_guest::area::{AreaError, AREA_GPA};
use tinyvmm::test_guest::vcpus::GuestError;

pub(super) const KIB: u64 = 1 << 10;
pub(super) const MIB: u64 = 1 << 20;
pub(super) const GIB: u64 = 1 << 30;

/// A size in the largest binary unit that divides it.
pub(super) fn size(bytes: u64) -> String {
    match bytes {
        b if b >= MIB && b % MIB == 0 => format!("{} MiB", b / MIB),
        b if b >= KIB && b % KIB == 0 => format!("{} KiB", b / KIB),
        b => format!("{b} bytes"),
    }
}

/// The map test's area (the kernel's `MEM_TEST_MAP_SIZE`): at most 8192 test slots of one page.
pub const MAP_AREA_SIZE: u64 = 32 * MIB;
/// The unmap tests' area (the kernel's `MEM_TEST_UNMAP_SIZE`), discarded in two halves.
pub const UNMAP_AREA_SIZE: u64 = 128 * MIB;
/// The chunk of the chunked unmap test (a typical huge page).
pub const UNMAP_CHUNK: u64 = 2 * MIB;
/// The window the guest writes in the move tests.
pub const MOVE_WINDOW: u64 = 192 * KIB;

/// One scenario of the suite.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Scenario {
    /// Guest writes fault in one half of a 32 MiB area while the host discards the other.
    Map,
    /// The host discards 64 MiB halves page by page.
    Unmap,
    /// The host discards 64 MiB halves in 2 MiB chunks.
    UnmapChunked,
    /// The host moves the last slot away and back while the guest writes into it.
    MoveActive,
    /// The host moves the last slot away and back while the guest writes just below it.
    MoveInactive,
    /// Guest and host write and check every page of the area in turn.
    Rw,
}

impl Scenario {
    /// Every scenario, in the kernel's order.
    pub const ALL: [Scenario; 6] = [
        Scenario::Map,
        Scenario::Unmap,
        Scenario::UnmapChunked,
        Scenario::MoveActive,
        Scenario::MoveInactive,
        Scenario::Rw,
    ];

    /// The name on the command line and in the JSON (`move-active`).
    pub fn name(self) -> &'static str {
        match self {
            Scenario::Map => "map",
            Scenario::Unmap => "unmap",
            Scenario::UnmapChunked => "unmap-chunked",
            Scenario::MoveActive => "move-active",
            Scenario::MoveInactive => "move-inactive",
            Scenario::Rw => "rw",
        }
    }

    /// The kernel test's name for it (`move active area`).
    pub fn title(self) -> &'static str {
        match self {
            Scenario::Map => "map",
            Scenario::Unmap => "unmap",
            Scenario::UnmapChunked => "unmap chunked",
            Scenario::MoveActive => "move active area",
            Scenario::MoveInactive => "move inactive area",
            Scenario::Rw => "RW",
        }
    }

    /// The size of the test area this scenario uses, given the suite's `area_size`: map and
    /// unmap have fixed areas, as in the kernel.
    pub fn area_size(self, area_size: u64) -> u64 {
        match self {
            Scenario::Map => MAP_AREA_SIZE,
            Scenario::Unmap | Scenario::UnmapChunked => UNMAP_AREA_SIZE,
            Scenario::MoveActive | Scenario::MoveInactive | Scenario::Rw => area_size,
        }
    }
}

impl fmt::Display for Scenario {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A test name that is none of the suite's.
#[derive(Debug, thiserror::Error)]
#[error("unknown test {name:?}; the tests are map, unmap, unmap-chunked, move-active, move-inactive, rw")]
pub struct UnknownScenario {
    /// The name given.
    pub name: String,
}

impl FromStr for Scenario {
    type Err = UnknownScenario;

    /// Accepts the name (`move-active`) or the kernel's title (`move active area`), in any case.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let s = s.trim();
        Scenario::ALL
            .into_iter()
            .find(|t| t.name().eq_ignore_ascii_case(s) || t.title().eq_ignore_ascii_case(s))
            .ok_or_else(|| UnknownScenario { name: s.into() })
    }
}

/// What the suite runs.
#[derive(Debug, Clone)]
pub struct PerfConfig {
    /// KVM slot counts (system slot included), each 2 to KVM's maximum; empty: KVM's maximum.
    pub slots: Vec<usize>,
    /// Bytes of test area for the move and RW tests (map and unmap use their own sizes).
    pub area_size: u64,
    /// Seconds each test runs its iterations (fractions allowed).
    pub seconds: f64,
    /// Runs of each test at each slot count.
    pub runs: usize,
    /// The scenarios, in the order given; empty: all of them.
    pub scenarios: Vec<Scenario>,
    /// What guest memory is admitted against; `None`: this host's defaults
    /// ([`MemoryLimits::for_this_host`]).
    pub limits: Option<MemoryLimits>,
    /// Keep KVM's zap-everything-on-slot-change quirk (`VmOptions::keep_slot_zap_all`).
    pub keep_slot_zap_all: bool,
}

impl Default for PerfConfig {
    fn default() -> Self {
        PerfConfig {
            slots: Vec::new(),
            area_size: 512 * MIB,
            seconds: 5.0,
            runs: 1,
            scenarios: Scenario::ALL.to_vec(),
            limits: None,
            keep_slot_zap_all: false,
        }
    }
}

/// Why the suite could not run (or stopped).
#[derive(Debug, thiserror::Error)]
pub enum PerfError {
    /// The VM failed.
    #[error(transparent)]
    Vm(#[from] GuestError),
    /// The test area could not be made.
    #[error(transparent)]
    Area(#[from] AreaError),
    /// The memory manager refused a change or a discard.
    #[error(transparent)]
    Memory(#[from] kvm_memslots::Error),
    /// The test time is not a positive number of seconds.
    #[error("the time per test must be a positive number of seconds, not {0}")]
    Seconds(f64),
    /// No runs.
    #[error("the number of runs must be at least 1")]
    NoRuns,
    /// A test area the guest cannot reach, or no area at all.
    #[error("a test area of {size:#x} bytes at {gpa:#x} is empty or outside the guest's identity map (below {limit:#x})")]
    AreaSize {
        /// Its size.
        size: u64,
        /// Where it starts.
        gpa: u64,
        /// The end of the guest's identity map.
        limit: u64,
    },
    /// Reading or writing guest memory from the host failed.
    #[error("host access at {gpa:#x} failed: {source}")]
    Access {
        /// The address.
        gpa: u64,
        /// vm-memory's error.
        source: vm_memory::GuestMemoryError,
    },
    /// The guest's write loop made no progress once the host had stopped changing memory.
    #[error(
        "{scenario}: the guest's write loop made no progress within {timeout:?} (passes: {passes})"
    )]
    LoopStalled {
        /// The test.
        scenario: Scenario,
        /// Passes the guest had completed.
        passes: u64,
        /// How long the host waited.
        timeout: Duration,
    },
    /// A signal stopped the test.
    #[error("interrupted")]
    Interrupted,
}

/// Why a test does not run at a slot count (the kernel's test skips these too).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SkipReason {
    /// The area has fewer pages than test slots.
    TooManySlots {
        /// The area's size.
        area_size: u64,
        /// Test slots (slots - 1).
        test_slots: u64,
    },
    /// The last slot cannot hold the upper half of the move window.
    LastSlotTooSmall {
        /// Its size.
        last_slot: u64,
        /// The size needed.
        needed: u64,
    },
    /// The slots below the last cannot hold the window's part below it.
    BelowTooSmall {
        /// Bytes of area below the last slot.
        below: u64,
        /// The size needed.
        needed: u64,
    },
}

impl fmt::Display for SkipReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            SkipReason::TooManySlots {
                area_size,
                test_slots,
            } => write!(
                f,
                "the {} area has {} pages, fewer than its {test_slots} test slots (at most {} slots)",
                size(area_size),
                area_size / PAGE_SIZE,
                area_size / PAGE_SIZE + 1
            ),
            SkipReason::LastSlotTooSmall { last_slot, needed } => write!(
                f,
                "the last slot ({}) is smaller than the window's upper half ({})",
                size(last_slot),
                size(needed)
            ),
            SkipReason::BelowTooSmall { below, needed } => write!(
                f,
                "the slots below the last hold {}, less than the window's {} below it",
                size(below),
                size(needed)
            ),
        }
    }
}

impl PerfConfig {
    /// The time each test runs, or why the configuration is refused.
    pub(super) fn duration(&self) -> Result<Duration, PerfError> {
        if self.runs == 0 {
            return Err(PerfError::NoRuns);
        }
        let limit = test_guest::IDENTITY_MAPPED;
        if self.area_size < PAGE_SIZE || self.area_size > limit - AREA_GPA {
            return Err(PerfError::AreaSize {
                size: self.area_size,
                gpa: AREA_GPA,
                limit,
            });
        }
        match Duration::try_from_secs_f64(self.seconds) {
            Ok(d) if !d.is_zero() => Ok(d),
            _ => Err(PerfError::Seconds(self.seconds)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tests_are_named_as_on_the_command_line_or_as_in_the_kernel() {
        for test in Scenario::ALL {
            assert_eq!(test.name().parse::<Scenario>().unwrap(), test);
            assert_eq!(test.title().parse::<Scenario>().unwrap(), test);
        }
        assert_eq!(
            " Move Active Area".parse::<Scenario>().unwrap(),
            Scenario::MoveActive
        );
        assert_eq!(
            "unmap chunks".parse::<Scenario>().unwrap_err().to_string(),
            "unknown test \"unmap chunks\"; the tests are map, unmap, unmap-chunked, move-active, move-inactive, rw"
        );
        assert_eq!(
            serde_json::to_string(&Scenario::UnmapChunked).unwrap(),
            "\"unmap-chunked\""
        );
    }
}
