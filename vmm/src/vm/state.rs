//! A vCPU's architectural state, saved and restored with KVM's ioctls: general and special
//! registers, the XSAVE area (x87, SSE, AVX), XCR0, pending events (exceptions, interrupts,
//! NMIs), the architectural MSRs a 64-bit guest sets (`SAVED_MSRS`; EFER and the FS/GS bases
//! are in the special registers), and the local APIC where the VM has an in-kernel irqchip
//! (the test guest runs without one). Serialisable with serde (kvm-bindings' `serde` feature),
//! for snapshots.

use kvm_bindings::{
    kvm_lapic_state, kvm_msr_entry, kvm_regs, kvm_sregs, kvm_vcpu_events, kvm_xcrs, kvm_xsave, Msrs,
};
use kvm_ioctls::VcpuFd;
use serde::de::value::BytesDeserializer;
use serde::de::{DeserializeOwned, Error as _};
use serde::{Deserialize, Deserializer, Serialize};

/// One vCPU's state. Each register block is read back only if it has exactly its
/// structure's size (kvm-bindings' own reader would pad or cut it).
#[derive(Debug, Serialize, Deserialize)]
pub struct VcpuState {
    /// General registers.
    #[serde(deserialize_with = "exact")]
    pub regs: kvm_regs,
    /// Segment, control and descriptor-table registers, EFER.
    #[serde(deserialize_with = "exact")]
    pub sregs: kvm_sregs,
    /// The XSAVE area.
    #[serde(deserialize_with = "exact")]
    pub xsave: kvm_xsave,
    /// Extended control registers (XCR0).
    #[serde(deserialize_with = "exact")]
    pub xcrs: kvm_xcrs,
    /// Pending exceptions, interrupts and NMIs.
    #[serde(deserialize_with = "exact")]
    pub events: kvm_vcpu_events,
    /// The [`SAVED_MSRS`], as (index, value).
    pub msrs: Vec<(u32, u64)>,
    /// The local APIC, where the VM has an in-kernel irqchip.
    #[serde(default, deserialize_with = "exact_option")]
    pub lapic: Option<kvm_lapic_state>,
}

/// Reads a KVM structure that kvm-bindings writes as its raw bytes, refusing any other number
/// of bytes: kvm-bindings' own reader pads a short block with zeros and drops what a long one
/// has over, so a block 8 bytes short would restore a register as 0.
fn exact<'de, D: Deserializer<'de>, T: DeserializeOwned>(deserializer: D) -> Result<T, D::Error> {
    let bytes = Vec::<u8>::deserialize(deserializer)?;
    if bytes.len() != size_of::<T>() {
        let name = std::any::type_name::<T>();
        return Err(D::Error::custom(format!(
            "a {} block of {} bytes; this build's has {}",
            name.rsplit("::").next().unwrap_or(name),
            bytes.len(),
            size_of::<T>()
        )));
    }
    T::deserialize(BytesDeserializer::<D::Error>::new(&bytes))
}

/// [`exact`] for a block that may be absent.
fn exact_option<'de, D: Deserializer<'de>, T: DeserializeOwned>(
    deserializer: D,
) -> Result<Option<T>, D::Error> {
    #[derive(Deserialize)]
    #[serde(transparent)]
    struct Exact<T: DeserializeOwned>(#[serde(deserialize_with = "exact")] T);
    Ok(Option::<Exact<T>>::deserialize(deserializer)?.map(|Exact(t)| t))
}

/// MSRs saved with a vCPU: the time-stamp counter, SYSENTER, the SYSCALL targets and mask,
/// the swapped GS base, TSC_AUX, PAT and MISC_ENABLE. KVM supports each on every x86 host.
pub const SAVED_MSRS: [u32; 11] = [
    0x10,        // IA32_TIME_STAMP_COUNTER
    0x174,       // IA32_SYSENTER_CS
    0x175,       // IA32_SYSENTER_ESP
    0x176,       // IA32_SYSENTER_EIP
    0x1a0,       // IA32_MISC_ENABLE
    0x277,       // IA32_PAT
    0xc000_0081, // STAR
    0xc000_0082, // LSTAR
    0xc000_0083, // CSTAR
    0xc000_0084, // SFMASK
    0xc000_0102, // KERNEL_GS_BASE
];

/// Which ioctl failed.
#[derive(Debug, thiserror::Error)]
#[error("{what} failed: {source}")]
pub struct StateError {
    /// The ioctl.
    pub what: &'static str,
    /// KVM's error.
    pub source: kvm_ioctls::Error,
}

fn failed(what: &'static str) -> impl Fn(kvm_ioctls::Error) -> StateError {
    move |source| StateError { what, source }
}

impl VcpuState {
    /// Reads `vcpu`'s state. The vCPU must not be running (call from its own thread between
    /// runs, or before it starts).
    pub fn save(vcpu: &VcpuFd) -> Result<Self, StateError> {
        Ok(VcpuState {
            regs: vcpu.get_regs().map_err(failed("KVM_GET_REGS"))?,
            sregs: vcpu.get_sregs().map_err(failed("KVM_GET_SREGS"))?,
            xsave: vcpu.get_xsave().map_err(failed("KVM_GET_XSAVE"))?,
            xcrs: vcpu.get_xcrs().map_err(failed("KVM_GET_XCRS"))?,
            events: vcpu
                .get_vcpu_events()
                .map_err(failed("KVM_GET_VCPU_EVENTS"))?,
            msrs: read_msrs(vcpu)?,
            // Without an in-kernel irqchip there is no local APIC to read (KVM says ENXIO).
            lapic: vcpu.get_lapic().ok(),
        })
    }

    /// Gives `vcpu` (not running) this state: special registers first (paging and modes), then
    /// XCR0 before the XSAVE area it governs, then the rest.
    pub fn restore(&self, vcpu: &VcpuFd) -> Result<(), StateError> {
        vcpu.set_sregs(&self.sregs)
            .map_err(failed("KVM_SET_SREGS"))?;
        vcpu.set_xcrs(&self.xcrs).map_err(failed("KVM_SET_XCRS"))?;
        // SAFETY: `kvm_xsave` is the fixed 4096-byte area of KVM_GET_XSAVE; this VM never
        // enables the dynamic XSAVE features (AMX) that need a larger buffer, so KVM reads no
        // more than the struct holds.
        unsafe { vcpu.set_xsave(&self.xsave) }.map_err(failed("KVM_SET_XSAVE"))?;
        vcpu.set_regs(&self.regs).map_err(failed("KVM_SET_REGS"))?;
        write_msrs(vcpu, &self.msrs)?;
        if let Some(lapic) = &self.lapic {
            vcpu.set_lapic(lapic).map_err(failed("KVM_SET_LAPIC"))?;
        }
        // Events last: they may refer to the state above.
        vcpu.set_vcpu_events(&self.events)
            .map_err(failed("KVM_SET_VCPU_EVENTS"))?;
        Ok(())
    }
}

fn msr_list(entries: impl Iterator<Item = kvm_msr_entry>) -> Result<Msrs, StateError> {
    let entries: Vec<kvm_msr_entry> = entries.collect();
    Msrs::from_entries(&entries).map_err(|_| StateError {
        what: "building the MSR list",
        source: kvm_ioctls::Error::new(libc::E2BIG),
    })
}

fn read_msrs(vcpu: &VcpuFd) -> Result<Vec<(u32, u64)>, StateError> {
    let mut msrs = msr_list(SAVED_MSRS.iter().map(|&index| kvm_msr_entry {
        index,
        ..Default::default()
    }))?;
    let read = vcpu.get_msrs(&mut msrs).map_err(failed("KVM_GET_MSRS"))?;
    if read != SAVED_MSRS.len() {
        // KVM stops at the first MSR it cannot read.
        return Err(StateError {
            what: "KVM_GET_MSRS (it refused an MSR)",
            source: kvm_ioctls::Error::new(libc::EINVAL),
        });
    }
    Ok(msrs.as_slice().iter().map(|e| (e.index, e.data)).collect())
}

fn write_msrs(vcpu: &VcpuFd, saved: &[(u32, u64)]) -> Result<(), StateError> {
    let msrs = msr_list(saved.iter().map(|&(index, data)| kvm_msr_entry {
        index,
        data,
        ..Default::default()
    }))?;
    let written = vcpu.set_msrs(&msrs).map_err(failed("KVM_SET_MSRS"))?;
    if written != saved.len() {
        return Err(StateError {
            what: "KVM_SET_MSRS (it refused an MSR)",
            source: kvm_ioctls::Error::new(libc::EINVAL),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn saved() -> serde_json::Value {
        let state = VcpuState {
            regs: kvm_regs {
                rip: 0x10000,
                rflags: 2,
                ..Default::default()
            },
            sregs: Default::default(),
            xsave: Default::default(),
            xcrs: Default::default(),
            events: Default::default(),
            msrs: vec![(0x10, 1)],
            lapic: Some(Default::default()),
        };
        serde_json::to_value(&state).expect("serialises")
    }

    #[test]
    fn register_blocks_of_another_size_are_refused_naming_both_sizes() {
        let back: VcpuState = serde_json::from_value(saved()).expect("round trip");
        assert_eq!((back.regs.rip, back.regs.rflags), (0x10000, 2));
        assert!(back.lapic.is_some());
        let mut no_lapic = saved();
        no_lapic.as_object_mut().expect("an object").remove("lapic");
        let back: VcpuState = serde_json::from_value(no_lapic).expect("no local APIC");
        assert!(back.lapic.is_none());
        for (block, change) in [
            ("regs", -8i64),
            ("sregs", 8),
            ("xsave", -4096),
            ("lapic", -1),
        ] {
            let mut state = saved();
            let bytes = state[block].as_array_mut().expect("bytes");
            let size = bytes.len();
            bytes.resize((size as i64 + change) as usize, 0.into());
            let e = serde_json::from_value::<VcpuState>(state)
                .expect_err(block)
                .to_string();
            let expected = format!(
                "block of {} bytes; this build's has {size}",
                size as i64 + change
            );
            assert!(e.contains(&expected), "{block}: {e}");
        }
    }
}
