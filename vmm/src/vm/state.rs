//! A vCPU's architectural state, saved and restored with KVM's ioctls: general and special
//! registers, the XSAVE area (x87, SSE, AVX), XCR0, pending events (exceptions, interrupts,
//! NMIs), debug registers, the multiprocessing state, CPUID, a list of MSRs (the test guest's
//! fixed `SAVED_MSRS`; for a Linux guest every MSR KVM lists and the vCPU can read,
//! `readable_msrs`, kvmclock's among them), and the local APIC where the VM has an in-kernel
//! irqchip (the test guest runs without one). Beside it, the VM's own state ([`VmState`]): the
//! in-kernel PIC and IOAPIC, the PIT and the VM clock. Serialisable with serde (kvm-bindings'
//! `serde` feature), for snapshots and migration.

use kvm_bindings::{
    kvm_clock_data, kvm_cpuid_entry2, kvm_debugregs, kvm_irqchip, kvm_lapic_state, kvm_mp_state,
    kvm_msr_entry, kvm_pit_state2, kvm_regs, kvm_sregs, kvm_vcpu_events, kvm_xcrs, kvm_xsave,
    CpuId, Msrs, KVM_MAX_CPUID_ENTRIES,
};
use kvm_ioctls::{Kvm, VcpuFd, VmFd};
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
    /// The debug registers (absent in files of older builds).
    #[serde(default, deserialize_with = "exact_option")]
    pub debugregs: Option<kvm_debugregs>,
    /// Running, halted, or waiting for its start-up IPI (absent in files of older builds).
    #[serde(default, deserialize_with = "exact_option")]
    pub mp_state: Option<kvm_mp_state>,
    /// The CPUID the vCPU was given (empty where it was given none, as the test guest's).
    #[serde(default)]
    pub cpuid: Vec<kvm_cpuid_entry2>,
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
    what: &'static str,
    /// KVM's error.
    source: kvm_ioctls::Error,
}

fn failed(what: &'static str) -> impl Fn(kvm_ioctls::Error) -> StateError {
    move |source| StateError { what, source }
}

impl VcpuState {
    /// Reads `vcpu`'s state with the test guest's MSRs ([`SAVED_MSRS`]); see
    /// `save_with`.
    pub fn save(vcpu: &VcpuFd) -> Result<Self, StateError> {
        Self::save_with(vcpu, &SAVED_MSRS)
    }

    /// Reads `vcpu`'s state, with the MSRs `msrs`. The vCPU must not be running (call from
    /// its own thread between runs, or before it starts).
    pub(super) fn save_with(vcpu: &VcpuFd, msrs: &[u32]) -> Result<Self, StateError> {
        let cpuid = vcpu
            .get_cpuid2(KVM_MAX_CPUID_ENTRIES)
            .map_err(failed("KVM_GET_CPUID2"))?;
        // The multiprocessing state first: reading it makes KVM act on a pending INIT or SIPI
        // (kvm_apic_accept_events), which can change the registers read below. QEMU reads it
        // first for the same reason.
        let mp_state = vcpu.get_mp_state().map_err(failed("KVM_GET_MP_STATE"))?;
        Ok(VcpuState {
            regs: vcpu.get_regs().map_err(failed("KVM_GET_REGS"))?,
            sregs: vcpu.get_sregs().map_err(failed("KVM_GET_SREGS"))?,
            xsave: vcpu.get_xsave().map_err(failed("KVM_GET_XSAVE"))?,
            xcrs: vcpu.get_xcrs().map_err(failed("KVM_GET_XCRS"))?,
            events: vcpu
                .get_vcpu_events()
                .map_err(failed("KVM_GET_VCPU_EVENTS"))?,
            msrs: read_msrs(vcpu, msrs)?,
            // Without an in-kernel irqchip there is no local APIC to read (KVM says ENXIO).
            lapic: vcpu.get_lapic().ok(),
            debugregs: Some(vcpu.get_debug_regs().map_err(failed("KVM_GET_DEBUGREGS"))?),
            mp_state: Some(mp_state),
            cpuid: cpuid.as_slice().to_vec(),
        })
    }

    /// Gives `vcpu` (not running) this state: CPUID first (it decides what the rest may
    /// hold), then the multiprocessing state, the special registers (paging and modes, the
    /// APIC base), XCR0 before the XSAVE area it governs, the registers, the local APIC before
    /// the MSRs (the TSC deadline needs its timer mode), and the pending events last.
    pub fn restore(&self, vcpu: &VcpuFd) -> Result<(), StateError> {
        if !self.cpuid.is_empty() {
            let cpuid = CpuId::from_entries(&self.cpuid).map_err(|_| StateError {
                what: "building the CPUID list",
                source: kvm_ioctls::Error::new(libc::E2BIG),
            })?;
            vcpu.set_cpuid2(&cpuid).map_err(failed("KVM_SET_CPUID2"))?;
        }
        if let Some(mp_state) = self.mp_state {
            vcpu.set_mp_state(mp_state)
                .map_err(failed("KVM_SET_MP_STATE"))?;
        }
        vcpu.set_sregs(&self.sregs)
            .map_err(failed("KVM_SET_SREGS"))?;
        vcpu.set_xcrs(&self.xcrs).map_err(failed("KVM_SET_XCRS"))?;
        // SAFETY: `kvm_xsave` is the fixed 4096-byte area of KVM_GET_XSAVE; this VM never
        // enables the dynamic XSAVE features (AMX) that need a larger buffer, so KVM reads no
        // more than the struct holds.
        unsafe { vcpu.set_xsave(&self.xsave) }.map_err(failed("KVM_SET_XSAVE"))?;
        vcpu.set_regs(&self.regs).map_err(failed("KVM_SET_REGS"))?;
        if let Some(debugregs) = &self.debugregs {
            vcpu.set_debug_regs(debugregs)
                .map_err(failed("KVM_SET_DEBUGREGS"))?;
        }
        if let Some(lapic) = &self.lapic {
            vcpu.set_lapic(lapic).map_err(failed("KVM_SET_LAPIC"))?;
        }
        write_msrs(vcpu, &self.msrs)?;
        // Events last: they may refer to the state above.
        vcpu.set_vcpu_events(&self.events)
            .map_err(failed("KVM_SET_VCPU_EVENTS"))?;
        Ok(())
    }
}

/// The MSRs of KVM's list (`KVM_GET_MSR_INDEX_LIST`) that `vcpu` lets the VMM read: what a
/// Linux guest's vCPU saves (kvmclock's, the TSC and its deadline, SYSCALL's, PAT, MTRRs, …).
/// KVM lists MSRs the host's CPU or this vCPU's CPUID lacks, and stops a read at the first it
/// refuses, so each is tried.
pub(crate) fn readable_msrs(kvm: &Kvm, vcpu: &VcpuFd) -> Result<Vec<u32>, StateError> {
    let listed = kvm
        .get_msr_index_list()
        .map_err(failed("KVM_GET_MSR_INDEX_LIST"))?;
    let mut readable = Vec::new();
    for &index in listed.as_slice() {
        let mut one = msr_list(std::iter::once(kvm_msr_entry {
            index,
            ..Default::default()
        }))?;
        if vcpu.get_msrs(&mut one).is_ok_and(|read| read == 1) {
            readable.push(index);
        }
    }
    Ok(readable)
}

/// The VM's own state beside its vCPUs', where it has the in-kernel irqchip: the two PICs and
/// the IOAPIC, the PIT, and the VM clock (kvmclock's base: restored, guest time goes on from
/// where it was saved rather than jumping by the time the VM was away).
#[derive(Debug, Serialize, Deserialize)]
pub struct VmState {
    /// The master PIC.
    #[serde(deserialize_with = "exact")]
    pub(crate) pic_master: kvm_irqchip,
    /// The slave PIC.
    #[serde(deserialize_with = "exact")]
    pub(crate) pic_slave: kvm_irqchip,
    /// The IOAPIC.
    #[serde(deserialize_with = "exact")]
    pub(crate) ioapic: kvm_irqchip,
    /// The PIT.
    #[serde(deserialize_with = "exact")]
    pub(crate) pit: kvm_pit_state2,
    /// The VM clock.
    #[serde(deserialize_with = "exact")]
    pub clock: kvm_clock_data,
}

/// `KVM_GET_IRQCHIP`'s chip ids.
const PIC_MASTER: u32 = 0;
const PIC_SLAVE: u32 = 1;
const IOAPIC: u32 = 2;

fn irqchip(vm: &VmFd, chip_id: u32) -> Result<kvm_irqchip, StateError> {
    let mut chip = kvm_irqchip {
        chip_id,
        ..Default::default()
    };
    vm.get_irqchip(&mut chip)
        .map_err(failed("KVM_GET_IRQCHIP"))?;
    Ok(chip)
}

impl VmState {
    /// Reads `vm`'s state; its vCPUs must be paused. The clock is `clock`'s, held since a
    /// client paused the VM, or else read as of now.
    pub fn save(vm: &VmFd, clock: &FrozenClock) -> Result<Self, StateError> {
        let mut state = VmState {
            pic_master: irqchip(vm, PIC_MASTER)?,
            pic_slave: irqchip(vm, PIC_SLAVE)?,
            ioapic: irqchip(vm, IOAPIC)?,
            pit: vm.get_pit2().map_err(failed("KVM_GET_PIT2"))?,
            clock: vm.get_clock().map_err(failed("KVM_GET_CLOCK"))?,
        };
        if let Some(at) = clock.frozen() {
            state.clock.clock = at;
        }
        Ok(state)
    }

    /// Gives `vm` (made with the irqchip and PIT, no vCPU running) this state. The clock is
    /// set as saved, without `KVM_CLOCK_REALTIME`: the guest's time goes on from the point of
    /// the save.
    pub fn restore(&self, vm: &VmFd) -> Result<(), StateError> {
        for (chip, id) in [
            (&self.pic_master, PIC_MASTER),
            (&self.pic_slave, PIC_SLAVE),
            (&self.ioapic, IOAPIC),
        ] {
            if chip.chip_id != id {
                return Err(StateError {
                    what: "KVM_SET_IRQCHIP (a saved chip has another chip's id)",
                    source: kvm_ioctls::Error::new(libc::EINVAL),
                });
            }
            vm.set_irqchip(chip).map_err(failed("KVM_SET_IRQCHIP"))?;
        }
        vm.set_pit2(&self.pit).map_err(failed("KVM_SET_PIT2"))?;
        let clock = kvm_clock_data {
            clock: self.clock.clock,
            ..Default::default()
        };
        vm.set_clock(&clock).map_err(failed("KVM_SET_CLOCK"))?;
        Ok(())
    }
}

/// The VM clock (kvmclock) held still while a client has the VM paused, as QEMU holds it
/// between a stop and a cont: the guest sees no time pass while it is paused, or while a
/// restored VM waits to be resumed, and its clock goes on from the pause (or the saved point)
/// when it resumes. A live snapshot's or a migration's short pause is not held.
#[derive(Debug, Default)]
pub struct FrozenClock(std::sync::Mutex<Option<u64>>);

impl FrozenClock {
    fn held(&self) -> std::sync::MutexGuard<'_, Option<u64>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Holds `vm`'s clock where it is now (once: a second freeze keeps the first point).
    pub(crate) fn freeze(&self, vm: &VmFd) -> Result<(), StateError> {
        let mut held = self.held();
        if held.is_none() {
            *held = Some(vm.get_clock().map_err(failed("KVM_GET_CLOCK"))?.clock);
        }
        Ok(())
    }

    /// Sets `vm`'s clock back to where it was held, and holds it no more; the vCPUs must not
    /// run yet.
    pub(crate) fn thaw(&self, vm: &VmFd) -> Result<(), StateError> {
        let mut held = self.held();
        if let Some(clock) = *held {
            let data = kvm_clock_data {
                clock,
                ..Default::default()
            };
            vm.set_clock(&data).map_err(failed("KVM_SET_CLOCK"))?;
            *held = None;
        }
        Ok(())
    }

    /// Where the clock is held, if it is.
    fn frozen(&self) -> Option<u64> {
        *self.held()
    }
}

fn msr_list(entries: impl Iterator<Item = kvm_msr_entry>) -> Result<Msrs, StateError> {
    let entries: Vec<kvm_msr_entry> = entries.collect();
    Msrs::from_entries(&entries).map_err(|_| StateError {
        what: "building the MSR list",
        source: kvm_ioctls::Error::new(libc::E2BIG),
    })
}

fn read_msrs(vcpu: &VcpuFd, indices: &[u32]) -> Result<Vec<(u32, u64)>, StateError> {
    let mut msrs = msr_list(indices.iter().map(|&index| kvm_msr_entry {
        index,
        ..Default::default()
    }))?;
    let read = vcpu.get_msrs(&mut msrs).map_err(failed("KVM_GET_MSRS"))?;
    if read != indices.len() {
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

    /// A clock held across a pause goes on from where it was held: after a second away it is
    /// less than a second past that point (unheld, it would be more).
    #[test]
    fn kvm_a_held_clock_goes_on_from_the_pause() {
        if !kvm_test_support::require_kvm(
            "tinyvmm::vm::state::kvm_a_held_clock_goes_on_from_the_pause",
        ) {
            return;
        }
        let kvm = Kvm::new().expect("/dev/kvm");
        let vm = kvm.create_vm().expect("a VM");
        let clock = FrozenClock::default();
        clock.freeze(&vm).expect("frozen");
        let at = clock.frozen().expect("held");
        std::thread::sleep(std::time::Duration::from_secs(1));
        clock
            .freeze(&vm)
            .expect("a second freeze keeps the first point");
        assert_eq!(clock.frozen(), Some(at));
        let saved = VmState::save(&vm, &clock);
        // Without an irqchip there is nothing to save; the clock alone is what is checked.
        assert!(saved.is_err() || saved.is_ok_and(|s| s.clock.clock == at));
        clock.thaw(&vm).expect("thawed");
        assert_eq!(clock.frozen(), None);
        let now = vm.get_clock().expect("the clock").clock;
        assert!(now >= at, "{now} < {at}");
        assert!(
            now - at < 1_000_000_000,
            "the clock ran on while held: {} ns past the pause after a second away",
            now - at
        );
    }

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
            debugregs: None,
            mp_state: None,
            cpuid: Vec::new(),
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
