//! Port I/O routing: port ranges mapped to a guest kind's devices, and what answers the ports in
//! no range. The bus is generic over the device type, so each guest kind names its own devices
//! (the test guest its protocol ports, a Linux guest its legacy devices) and the exit handler
//! knows none of them.

/// What answers a port that is in no range.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unmapped {
    /// Nothing may be there: an access stops the vCPU (the test guest uses exactly its ports).
    Fatal,
    /// An empty ISA bus: reads see all ones, writes are dropped (Linux probes legacy ports that
    /// are not there).
    Absent,
}

/// A port range and the device behind it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PortRange<D> {
    /// First port.
    base: u16,
    /// Number of ports.
    len: u16,
    /// The device; it sees offsets from `base`.
    pub(crate) device: D,
}

impl<D> PortRange<D> {
    fn end(&self) -> u32 {
        u32::from(self.base) + u32::from(self.len)
    }
}

/// Where a port access goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PortTarget<D> {
    /// A device, at this offset in its range.
    Device(D, u16),
    /// No device, on a bus whose unmapped ports are [`Unmapped::Absent`].
    Absent,
    /// No device, on a bus whose unmapped ports are [`Unmapped::Fatal`].
    Nothing,
}

/// Port ranges mapped to devices of type `D`, sorted and never overlapping.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PortBus<D> {
    ranges: Vec<PortRange<D>>,
    unmapped: Unmapped,
}

/// Why a port range cannot join a bus.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("ports {base:#x}+{len} are empty, wrap past 0xffff or overlap the range at {other:#x?}")]
pub(crate) struct PortBusError {
    /// First port.
    base: u16,
    /// Number of ports.
    len: u16,
    /// The base of the range it overlaps, if any.
    other: Option<u16>,
}

impl<D: Copy> PortBus<D> {
    /// An empty bus; `unmapped` says what answers ports in no range.
    pub fn new(unmapped: Unmapped) -> Self {
        PortBus {
            ranges: Vec::new(),
            unmapped,
        }
    }

    /// Maps `len` ports from `base` to `device`.
    pub(crate) fn insert(&mut self, base: u16, len: u16, device: D) -> Result<(), PortBusError> {
        let range = PortRange { base, len, device };
        let error = |other| PortBusError { base, len, other };
        if len == 0 || range.end() > 0x1_0000 {
            return Err(error(None));
        }
        let at = self.ranges.partition_point(|r| r.base < base);
        let overlaps =
            |r: &PortRange<D>| u32::from(r.base) < range.end() && u32::from(base) < r.end();
        for neighbour in [at.checked_sub(1), Some(at)].into_iter().flatten() {
            if let Some(r) = self.ranges.get(neighbour).filter(|r| overlaps(r)) {
                return Err(error(Some(r.base)));
            }
        }
        self.ranges.insert(at, range);
        Ok(())
    }

    /// Where an access to `port` goes.
    pub(crate) fn find(&self, port: u16) -> PortTarget<D> {
        let at = self.ranges.partition_point(|r| r.base <= port);
        match at.checked_sub(1).map(|i| &self.ranges[i]) {
            Some(r) if u32::from(port) < r.end() => PortTarget::Device(r.device, port - r.base),
            _ => match self.unmapped {
                Unmapped::Absent => PortTarget::Absent,
                Unmapped::Fatal => PortTarget::Nothing,
            },
        }
    }

    /// The ranges, by base.
    pub(crate) fn ranges(&self) -> &[PortRange<D>] {
        &self.ranges
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bus_routes_ranges_refuses_overlaps_and_answers_the_rest_by_its_policy() {
        let mut bus = PortBus::new(Unmapped::Absent);
        bus.insert(0x3f8, 8, 'S').unwrap();
        bus.insert(0x60, 5, 'K').unwrap();
        assert_eq!(bus.insert(0x3fc, 2, 'x').unwrap_err().other, Some(0x3f8));
        assert!(bus.insert(0x3f0, 9, 'x').is_err(), "its last port is 0x3f8");
        assert!(bus.insert(0xffff, 2, 'x').is_err(), "wraps");
        assert!(bus.insert(0x10, 0, 'x').is_err(), "empty");
        bus.insert(0x3f0, 8, 'A').unwrap();
        bus.insert(0xffff, 1, 'E').unwrap();
        assert_eq!(bus.ranges().len(), 4);
        assert_eq!(bus.find(0x3ff), PortTarget::Device('S', 7));
        assert_eq!(bus.find(0x3f7), PortTarget::Device('A', 7));
        assert_eq!(bus.find(0x64), PortTarget::Device('K', 4));
        assert_eq!(bus.find(0xffff), PortTarget::Device('E', 0));
        assert_eq!(bus.find(0x400), PortTarget::Absent);
        assert_eq!(bus.find(0), PortTarget::Absent);

        let mut strict = PortBus::new(Unmapped::Fatal);
        strict.insert(0x510, 1, 'D').unwrap();
        assert_eq!(strict.find(0x510), PortTarget::Device('D', 0));
        assert_eq!(strict.find(0x511), PortTarget::Nothing);
    }
}
