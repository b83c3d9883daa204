//! What one memory slot is: an id, a guest-physical range, a host-virtual base, flags and the
//! caller's payload.

use std::fmt;

use vm_memory::GuestAddress;

/// A slot's id. The map only requires ids to be unique; a KVM manager uses KVM's slot number.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SlotId(pub u32);

impl fmt::Display for SlotId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// A host virtual address (an address in the VMM's own address space).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct HostAddress(pub u64);

impl fmt::Display for HostAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#x}", self.0)
    }
}

/// How a slot is mapped into the guest.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct SlotFlags {
    /// Guest writes into the slot are recorded in a dirty log.
    pub log_dirty: bool,
    /// The guest can read the slot but its writes exit to the VMM instead of landing.
    pub read_only: bool,
}

impl fmt::Display for SlotFlags {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let rw = if self.read_only { "ro" } else { "rw" };
        let log = if self.log_dirty { ",log" } else { "" };
        write!(f, "{rw}{log}")
    }
}

/// A half-open range of addresses `[start, end)`, printed in hex.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct AddressRange {
    /// First address in the range.
    pub start: u64,
    /// First address after the range.
    pub end: u64,
}

impl fmt::Display for AddressRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "[{:#x}, {:#x})", self.start, self.end)
    }
}

/// One memory slot: `size` bytes of guest-physical memory at `gpa`, backed by the host's
/// memory at `hva`.
///
/// A slot is immutable once built; a map change that moves a slot or changes its flags puts a
/// new `Slot` (with a clone of the payload) in its place.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Slot<P> {
    id: SlotId,
    gpa: GuestAddress,
    size: u64,
    hva: HostAddress,
    flags: SlotFlags,
    payload: P,
}

impl<P> Slot<P> {
    /// Describes a slot. Nothing is checked here: a map checks a slot against its rules
    /// (alignment, no wrap-around, no overlap) when the slot is inserted.
    pub fn new(
        id: SlotId,
        gpa: GuestAddress,
        size: u64,
        hva: HostAddress,
        flags: SlotFlags,
        payload: P,
    ) -> Self {
        Slot {
            id,
            gpa,
            size,
            hva,
            flags,
            payload,
        }
    }

    /// The slot's id.
    pub fn id(&self) -> SlotId {
        self.id
    }

    /// First guest-physical address of the slot.
    pub fn gpa(&self) -> GuestAddress {
        self.gpa
    }

    /// Size in bytes.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// Host-virtual address that backs the slot's first byte.
    pub fn hva(&self) -> HostAddress {
        self.hva
    }

    /// The slot's flags.
    pub fn flags(&self) -> SlotFlags {
        self.flags
    }

    /// The caller's payload (for example an `Arc` of the backing mapping).
    pub fn payload(&self) -> &P {
        &self.payload
    }

    /// The guest-physical range `[gpa, gpa + size)`. Saturates for a slot that wraps around,
    /// which no map accepts.
    pub fn gpa_range(&self) -> AddressRange {
        AddressRange {
            start: self.gpa.0,
            end: self.gpa.0.saturating_add(self.size),
        }
    }

    /// The host-virtual range `[hva, hva + size)`. Saturates like [`Slot::gpa_range`].
    pub fn hva_range(&self) -> AddressRange {
        AddressRange {
            start: self.hva.0,
            end: self.hva.0.saturating_add(self.size),
        }
    }

    /// Whether the slot holds guest-physical address `addr`.
    pub fn contains_gpa(&self, addr: GuestAddress) -> bool {
        addr.0.wrapping_sub(self.gpa.0) < self.size
    }

    /// The host address that backs guest address `addr`, if the slot holds it.
    pub fn gpa_to_hva(&self, addr: GuestAddress) -> Option<HostAddress> {
        let offset = addr.0.checked_sub(self.gpa.0)?;
        (offset < self.size).then(|| HostAddress(self.hva.0 + offset))
    }

    /// The guest address that host address `hva` backs in this slot, if the slot maps it.
    pub fn hva_to_gpa(&self, hva: HostAddress) -> Option<GuestAddress> {
        let offset = hva.0.checked_sub(self.hva.0)?;
        (offset < self.size).then(|| GuestAddress(self.gpa.0 + offset))
    }

    pub(crate) fn with_gpa(&self, gpa: GuestAddress) -> Self
    where
        P: Clone,
    {
        Slot {
            gpa,
            ..self.clone()
        }
    }

    pub(crate) fn with_flags(&self, flags: SlotFlags) -> Self
    where
        P: Clone,
    {
        Slot {
            flags,
            ..self.clone()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn translations_stay_inside_the_slot() {
        let slot = Slot::new(
            SlotId(3),
            GuestAddress(0x10_000),
            0x2000,
            HostAddress(0x7f00_0000_0000),
            SlotFlags::default(),
            (),
        );
        assert!(!slot.contains_gpa(GuestAddress(0xffff)));
        assert!(slot.contains_gpa(GuestAddress(0x10_000)));
        assert!(slot.contains_gpa(GuestAddress(0x11_fff)));
        assert!(!slot.contains_gpa(GuestAddress(0x12_000)));
        assert_eq!(
            slot.gpa_to_hva(GuestAddress(0x10_010)),
            Some(HostAddress(0x7f00_0000_0010))
        );
        assert_eq!(slot.gpa_to_hva(GuestAddress(0x12_000)), None);
        assert_eq!(
            slot.hva_to_gpa(HostAddress(0x7f00_0000_1fff)),
            Some(GuestAddress(0x11_fff))
        );
        assert_eq!(slot.hva_to_gpa(HostAddress(0x7eff_ffff_ffff)), None);
        assert_eq!(slot.gpa_range().to_string(), "[0x10000, 0x12000)");
        assert_eq!(
            SlotFlags {
                log_dirty: true,
                read_only: true
            }
            .to_string(),
            "ro,log"
        );
    }
}
