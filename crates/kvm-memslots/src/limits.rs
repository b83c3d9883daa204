//! Admission limits: what a manager agrees to give the guest, checked before anything is
//! allocated, so that no request (a 2^56-byte region, say) can make the VMM abort on a failed
//! allocation or have the kernel's OOM killer end it later.
//!
//! Guest memory itself is mapped with `MAP_NORESERVE` and costs the host nothing until the guest
//! touches it, but each region has host-side *metadata* that is paid at once, in proportion to
//! its size ([`metadata_bytes`]):
//!
//! | who | what | bytes per 4 KiB page |
//! |---|---|---|
//! | the manager | vm-memory's bitmap of the VMM's own writes, and the pending dirty bits | 1/8 + 1/8 |
//! | KVM (x86) | the reverse map of 4 KiB mappings (`rmap`, allocated where KVM shadows the guest's page tables, as kvm_pvm does) | 8 |
//! | KVM | large-page rmaps and `lpage_info` for 2 MiB and 1 GiB pages | 8·2/512 ≈ 0.03 |
//! | KVM | the slot's dirty bitmap and its copy, while logging | 2/8 |
//!
//! so about `size / 490` bytes in all: 2 MiB for 1 GiB of guest memory, 32 GiB for 16 TiB.

use crate::PAGE_SIZE;

const GIB: u64 = 1 << 30;

/// Host memory the manager and KVM spend on a region of `size` bytes before the guest touches
/// any of it (an estimate that errs high; see the module documentation).
pub fn metadata_bytes(size: u64) -> u64 {
    let pages = size.div_ceil(PAGE_SIZE);
    // The manager's two bitmaps and KVM's two dirty bitmaps: one bit per page each.
    let bitmaps = 4 * pages.div_ceil(8);
    // KVM's rmap for 4 KiB pages, and its rmap and lpage_info (8 + 4 bytes) per 2 MiB and 1 GiB.
    let kvm = pages.saturating_mul(8) + pages.div_ceil(512) * 12 + pages.div_ceil(1 << 18) * 12;
    bitmaps.saturating_add(kvm)
}

/// What a manager admits. Every region added is checked against these before anything is
/// allocated; a request over a limit is refused with an error naming the limit and the figures.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryLimits {
    /// Most guest memory in all regions together, in bytes.
    pub max_guest_memory: u64,
    /// Largest single region, in bytes.
    pub max_region_size: u64,
    /// Most host memory the regions' metadata may take in all ([`metadata_bytes`]), in bytes.
    pub max_metadata: u64,
    /// Most KVM slots the manager's regions may use together: a budget below KVM's number for
    /// a VMM whose memory table also goes to vhost-user backends (rust-vmm's vhost and
    /// libvhost-user take 509 regions) or the kernel's vhost (64 by default). `u64::MAX` (the
    /// default): KVM's number is the only bound.
    pub max_slots: u64,
}

impl MemoryLimits {
    /// No limit but what the address space and KVM's slot count allow.
    pub const fn unlimited() -> Self {
        MemoryLimits {
            max_guest_memory: u64::MAX,
            max_region_size: u64::MAX,
            max_metadata: u64::MAX,
            max_slots: u64::MAX,
        }
    }

    /// Limits for a host with `host_memory` bytes of RAM: guest memory up to four times the
    /// host's (guest memory costs nothing until touched, and VMMs overcommit), but at least
    /// 64 GiB; any one region up to that; metadata up to an eighth of the host's memory.
    pub fn for_host_memory(host_memory: u64) -> Self {
        let guest = host_memory.saturating_mul(4).max(64 * GIB);
        MemoryLimits {
            max_guest_memory: guest,
            max_region_size: guest,
            max_metadata: host_memory / 8,
            max_slots: u64::MAX,
        }
    }

    /// [`for_host_memory`](Self::for_host_memory) with this host's RAM, or 64 GiB of guest
    /// memory and 1 GiB of metadata where the RAM cannot be read.
    pub fn for_this_host() -> Self {
        match host_memory() {
            Some(bytes) => Self::for_host_memory(bytes),
            None => MemoryLimits {
                max_guest_memory: 64 * GIB,
                max_region_size: 64 * GIB,
                max_metadata: GIB,
                max_slots: u64::MAX,
            },
        }
    }
}

impl Default for MemoryLimits {
    /// [`MemoryLimits::for_this_host`].
    fn default() -> Self {
        Self::for_this_host()
    }
}

/// This host's RAM in bytes (`_SC_PHYS_PAGES` × page size).
fn host_memory() -> Option<u64> {
    // SAFETY: sysconf only reads system configuration; it has no memory arguments.
    let pages = unsafe { libc::sysconf(libc::_SC_PHYS_PAGES) };
    // SAFETY: as above.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    let pages = u64::try_from(pages).ok().filter(|p| *p > 0)?;
    let page = u64::try_from(page).ok().filter(|p| *p > 0)?;
    pages.checked_mul(page)
}

/// Which limit a request went over.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Limit {
    /// [`MemoryLimits::max_region_size`].
    RegionSize,
    /// [`MemoryLimits::max_guest_memory`].
    GuestMemory,
    /// [`MemoryLimits::max_metadata`].
    Metadata,
    /// [`MemoryLimits::max_slots`].
    Slots,
}

impl Limit {
    /// The limit's name, as the API and the command line spell it.
    pub fn name(self) -> &'static str {
        match self {
            Limit::RegionSize => "max_region_size",
            Limit::GuestMemory => "max_guest_memory",
            Limit::Metadata => "max_metadata",
            Limit::Slots => "max_slots",
        }
    }
}

/// What the regions in place use of the limited resources.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MemoryUse {
    /// Guest memory in all regions, in bytes.
    pub guest_memory: u64,
    /// Their metadata ([`metadata_bytes`]), in bytes.
    pub metadata: u64,
}

impl MemoryUse {
    /// Checks a new region of `size` bytes against `limits`: the first limit it would go over,
    /// with the figure it would reach (or the region's size, for the per-region limit).
    pub fn admit(&self, size: u64, limits: &MemoryLimits) -> Result<MemoryUse, (Limit, u64)> {
        if size > limits.max_region_size {
            return Err((Limit::RegionSize, size));
        }
        let guest_memory = self.guest_memory.saturating_add(size);
        if guest_memory > limits.max_guest_memory {
            return Err((Limit::GuestMemory, guest_memory));
        }
        let metadata = self.metadata.saturating_add(metadata_bytes(size));
        if metadata > limits.max_metadata {
            return Err((Limit::Metadata, metadata));
        }
        Ok(MemoryUse {
            guest_memory,
            metadata,
        })
    }

    /// The use once a region of `size` bytes is gone.
    pub fn without(&self, size: u64) -> MemoryUse {
        MemoryUse {
            guest_memory: self.guest_memory.saturating_sub(size),
            metadata: self.metadata.saturating_sub(metadata_bytes(size)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metadata_grows_with_the_size_and_never_overflows() {
        // 1 GiB: 256 Ki pages; 8 bytes each for KVM's rmap, 4 bits for the bitmaps.
        let gib = metadata_bytes(GIB);
        assert!((2 * (1 << 20)..3 * (1 << 20)).contains(&gib), "{gib}");
        assert_eq!(metadata_bytes(16 * GIB * 1024), 1024 * 16 * gib);
        assert_eq!(metadata_bytes(0), 0);
        assert!(metadata_bytes(u64::MAX) > u64::MAX / 1000);
    }

    #[test]
    fn each_limit_is_named_with_the_figure_it_would_reach() {
        let limits = MemoryLimits {
            max_guest_memory: 10 * GIB,
            max_region_size: 4 * GIB,
            max_metadata: 64 << 20,
            max_slots: u64::MAX,
        };
        let mut used = MemoryUse::default();
        used = used.admit(4 * GIB, &limits).expect("fits");
        assert_eq!(used.guest_memory, 4 * GIB);
        assert_eq!(
            used.admit(4 * GIB + 4096, &limits),
            Err((Limit::RegionSize, 4 * GIB + 4096))
        );
        used = used.admit(4 * GIB, &limits).expect("fits");
        assert_eq!(
            used.admit(3 * GIB, &limits),
            Err((Limit::GuestMemory, 11 * GIB))
        );
        let tight = MemoryLimits {
            max_metadata: used.metadata + 1,
            ..limits
        };
        assert!(matches!(
            used.admit(GIB, &tight),
            Err((Limit::Metadata, m)) if m == used.metadata + metadata_bytes(GIB)
        ));
        assert_eq!(used.without(4 * GIB).without(4 * GIB), MemoryUse::default());
        for huge in [1 << 40, 1 << 52, 1 << 56, u64::MAX - 4095] {
            assert!(MemoryUse::default()
                .admit(huge, &MemoryLimits::for_host_memory(24 * GIB))
                .is_err());
        }
        let unlimited = MemoryLimits::unlimited();
        assert!(used.admit(u64::MAX / 2, &unlimited).is_ok());
    }

    #[test]
    fn host_limits_scale_with_its_memory_and_have_a_floor() {
        let small = MemoryLimits::for_host_memory(GIB);
        assert_eq!(small.max_guest_memory, 64 * GIB);
        assert_eq!(small.max_metadata, GIB / 8);
        let big = MemoryLimits::for_host_memory(24 * GIB);
        assert_eq!(big.max_guest_memory, 96 * GIB);
        assert_eq!(big.max_region_size, 96 * GIB);
        assert_eq!(big.max_metadata, 3 * GIB);
        assert!(host_memory().is_some_and(|m| m > 0));
    }
}
