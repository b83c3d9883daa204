//! Guest-physical ranges with no memory slot that something other than memory answers: a
//! device's MMIO window (a virtio-mmio transport, say), or memory that is deliberately absent
//! (the unplugged blocks of a virtio-mem device). The exit handler looks an MMIO exit up here
//! after the memory map. Absent memory may also lie under a slot, unreachable (an unplugged
//! block inside a plugged virtio-mem piece, protected `PROT_NONE`): a guest access there faults
//! inside KVM instead of exiting, and the bus's [`Unreachable`] handler takes its slot away so
//! that the access, run again, exits as absent memory.

use std::fmt;
use std::ops::Range;
use std::sync::Arc;

/// What answers an address of an [`MmioBus`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum MmioTarget {
    /// The guest kind's device number `device`, at `offset` in its window.
    Device {
        /// The device, as the guest kind numbers them.
        device: usize,
        /// Offset in the device's window.
        offset: u64,
    },
    /// Memory that is not there on purpose: reads see all ones, writes are dropped, and each
    /// access is counted (a guest that touches unplugged memory is told nothing; the host
    /// can see it).
    Absent,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Device(usize),
    Absent,
}

/// Non-overlapping guest-physical ranges, each a device window or absent memory.
#[derive(Debug, Clone, Default)]
pub struct MmioBus {
    ranges: Vec<(Range<u64>, Kind)>,
    unreachable: Option<Arc<dyn Unreachable>>,
}

impl PartialEq for MmioBus {
    fn eq(&self, other: &Self) -> bool {
        self.ranges == other.ranges
            && match (&self.unreachable, &other.unreachable) {
                (None, None) => true,
                (Some(a), Some(b)) => Arc::ptr_eq(a, b),
                _ => false,
            }
    }
}

impl Eq for MmioBus {}

/// Memory of the bus's absent ranges that a slot covers but the guest cannot reach (an
/// unplugged virtio-mem block under its piece's slot): a guest access faults inside KVM
/// (`KVM_RUN` fails with `EFAULT`, or a `KVM_EXIT_MEMORY_FAULT` naming the address).
pub trait Unreachable: Send + Sync + fmt::Debug {
    /// Takes the slot away from the unreachable memory at `gpa` (all of it, if `None`: the
    /// fault did not say where), so that an access there, run again, exits as absent memory.
    /// Whether it changed anything: if not, the fault is not this memory's, and running the
    /// vCPU again would fault again.
    fn isolate(&self, gpa: Option<u64>) -> bool;
}

/// Why a range cannot join a bus.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("guest range [{start:#x}, {end:#x}) is empty, wraps, or overlaps another MMIO range")]
pub struct MmioBusError {
    /// Its start.
    start: u64,
    /// Its end.
    end: u64,
}

impl MmioBus {
    /// An empty bus.
    pub fn new() -> Self {
        MmioBus::default()
    }

    fn insert(&mut self, start: u64, len: u64, kind: Kind) -> Result<(), MmioBusError> {
        let end = start.checked_add(len).filter(|_| len > 0);
        let error = MmioBusError {
            start,
            end: end.unwrap_or(u64::MAX),
        };
        let end = end.ok_or(error.clone())?;
        if self
            .ranges
            .iter()
            .any(|(r, _)| r.start < end && start < r.end)
        {
            return Err(error);
        }
        let at = self.ranges.partition_point(|(r, _)| r.start < start);
        self.ranges.insert(at, (start..end, kind));
        Ok(())
    }

    /// Maps `len` bytes from `start` to device number `device`.
    pub(crate) fn insert_device(
        &mut self,
        start: u64,
        len: u64,
        device: usize,
    ) -> Result<(), MmioBusError> {
        self.insert(start, len, Kind::Device(device))
    }

    /// Marks `len` bytes from `start` as absent memory.
    pub fn insert_absent(&mut self, start: u64, len: u64) -> Result<(), MmioBusError> {
        self.insert(start, len, Kind::Absent)
    }

    /// Gives the bus the handler of its unreachable memory ([`Unreachable`]).
    pub fn set_unreachable(&mut self, handler: Arc<dyn Unreachable>) {
        self.unreachable = Some(handler);
    }

    /// After a guest access faulted inside KVM (at `gpa`, if KVM said): whether the bus's
    /// [`Unreachable`] handler took a slot away from unreachable absent memory there, so that
    /// the vCPU may run the access again (it then exits as absent memory). False without a
    /// handler, for an address outside the bus's absent ranges, or if nothing changed.
    pub fn isolate(&self, gpa: Option<u64>) -> bool {
        let Some(handler) = &self.unreachable else {
            return false;
        };
        if gpa.is_some_and(|gpa| self.find(gpa) != Some(MmioTarget::Absent)) {
            return false;
        }
        handler.isolate(gpa)
    }

    /// What answers `gpa`, if anything.
    pub(super) fn find(&self, gpa: u64) -> Option<MmioTarget> {
        let at = self.ranges.partition_point(|(r, _)| r.start <= gpa);
        let (range, kind) = self.ranges.get(at.checked_sub(1)?)?;
        if !range.contains(&gpa) {
            return None;
        }
        Some(match *kind {
            Kind::Device(device) => MmioTarget::Device {
                device,
                offset: gpa - range.start,
            },
            Kind::Absent => MmioTarget::Absent,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lookups_find_the_range_and_the_offset() {
        let mut bus = MmioBus::new();
        bus.insert_absent(0x1_0000_0000, 0x4000_0000).expect("free");
        bus.insert_device(0xd000_0000, 0x200, 3).expect("free");
        assert_eq!(bus.find(0xcfff_ffff), None);
        assert_eq!(
            bus.find(0xd000_0000),
            Some(MmioTarget::Device {
                device: 3,
                offset: 0
            })
        );
        assert_eq!(
            bus.find(0xd000_01ff),
            Some(MmioTarget::Device {
                device: 3,
                offset: 0x1ff
            })
        );
        assert_eq!(bus.find(0xd000_0200), None);
        assert_eq!(bus.find(0x1_0000_0000), Some(MmioTarget::Absent));
        assert_eq!(bus.find(0x1_3fff_ffff), Some(MmioTarget::Absent));
        assert_eq!(bus.find(0x1_4000_0000), None);
        assert_eq!(bus.find(0), None);
    }

    /// Counts the isolations it is asked for, and says whether it changed anything.
    #[derive(Debug)]
    struct Counting(std::sync::atomic::AtomicU64, bool);

    impl Unreachable for Counting {
        fn isolate(&self, _: Option<u64>) -> bool {
            self.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            self.1
        }
    }

    #[test]
    fn only_absent_memory_is_isolated_and_only_with_a_handler() {
        let mut bus = MmioBus::new();
        bus.insert_absent(0x1_0000_0000, 0x4000_0000).expect("free");
        bus.insert_device(0xd000_0000, 0x200, 3).expect("free");
        assert!(!bus.isolate(Some(0x1_0000_0000)), "no handler");
        let handler = Arc::new(Counting(Default::default(), true));
        bus.set_unreachable(Arc::clone(&handler) as Arc<dyn Unreachable>);
        assert!(bus.isolate(Some(0x1_0000_1000)));
        assert!(bus.isolate(None), "a fault that names no address");
        assert!(!bus.isolate(Some(0xd000_0000)), "a device window");
        assert!(!bus.isolate(Some(0x2000)), "outside the bus");
        assert_eq!(handler.0.load(std::sync::atomic::Ordering::Relaxed), 2);
        // A handler that changed nothing: the fault is not its memory's.
        let mut other = bus.clone();
        other.set_unreachable(Arc::new(Counting(Default::default(), false)));
        assert!(!other.isolate(Some(0x1_0000_1000)));
        assert_ne!(bus, other, "different handlers");
    }

    #[test]
    fn overlapping_empty_or_wrapping_ranges_are_refused() {
        let mut bus = MmioBus::new();
        bus.insert_device(0x1000, 0x1000, 0).expect("free");
        assert!(bus.insert_device(0x1800, 0x100, 1).is_err());
        assert!(bus.insert_absent(0x0, 0x1001).is_err());
        assert!(bus.insert_absent(0x2000, 0).is_err());
        assert!(bus.insert_absent(u64::MAX - 10, 100).is_err());
        bus.insert_absent(0x2000, 0x1000).expect("adjacent is fine");
        assert_eq!(
            bus.find(0x1fff),
            Some(MmioTarget::Device {
                device: 0,
                offset: 0xfff
            })
        );
    }
}
