//! A vCPU's state survives a save, JSON and a restore into another VM's vCPU: registers, MSRs,
//! and the local APIC where there is an in-kernel irqchip.

use kvm_bindings::{kvm_msr_entry, Msrs};
use tinyvmm::vm::state::{VcpuState, SAVED_MSRS};
use tinyvmm::vm::{Vm, VmOptions};

fn msr(vcpu: &kvm_ioctls::VcpuFd, index: u32) -> u64 {
    let mut msrs = Msrs::from_entries(&[kvm_msr_entry {
        index,
        ..Default::default()
    }])
    .expect("one entry");
    assert_eq!(vcpu.get_msrs(&mut msrs).expect("KVM_GET_MSRS"), 1);
    msrs.as_slice()[0].data
}

#[test]
fn kvm_a_vcpu_state_moves_to_another_vm_through_json() {
    if !kvm_test_support::require_kvm("tinyvmm::kvm_a_vcpu_state_moves_to_another_vm_through_json")
    {
        return;
    }
    for irqchip in [false, true] {
        let options = VmOptions {
            irqchip,
            ..VmOptions::default()
        };
        let source = Vm::new(options).expect("a VM");
        let vcpu = source.create_vcpu(0).expect("a vCPU");
        let (lstar, gs) = (0xffff_ffff_8100_0000u64, 0xffff_8880_1234_5000u64);
        let set = Msrs::from_entries(&[
            kvm_msr_entry {
                index: 0xc000_0082,
                data: lstar,
                ..Default::default()
            },
            kvm_msr_entry {
                index: 0xc000_0102,
                data: gs,
                ..Default::default()
            },
        ])
        .expect("two entries");
        assert_eq!(vcpu.set_msrs(&set).expect("KVM_SET_MSRS"), 2);
        let mut regs = vcpu.get_regs().expect("regs");
        regs.rax = 0x1234_5678;
        regs.rip = 0xfff0;
        vcpu.set_regs(&regs).expect("regs");

        let saved = VcpuState::save(&vcpu).expect("saved");
        assert_eq!(saved.msrs.len(), SAVED_MSRS.len());
        assert_eq!(
            saved.lapic.is_some(),
            irqchip,
            "a local APIC only with the irqchip"
        );
        let json = serde_json::to_string(&saved).expect("JSON");
        let back: VcpuState = serde_json::from_str(&json).expect("from JSON");

        let target = Vm::new(options).expect("another VM");
        let fresh = target.create_vcpu(0).expect("a vCPU");
        back.restore(&fresh).expect("restored");
        assert_eq!(msr(&fresh, 0xc000_0082), lstar);
        assert_eq!(msr(&fresh, 0xc000_0102), gs);
        let regs = fresh.get_regs().expect("regs");
        assert_eq!((regs.rax, regs.rip), (0x1234_5678, 0xfff0));
        if irqchip {
            let lapic = fresh.get_lapic().expect("the local APIC");
            assert_eq!(
                lapic.regs[..],
                saved.lapic.as_ref().expect("saved").regs[..],
                "the local APIC's registers"
            );
        }
    }
}

/// The VM's irqchip, PIT and clock move to another VM through JSON, and the clock goes on from
/// where it was saved rather than by the time the VM was away.
#[test]
fn kvm_a_vm_state_moves_to_another_vm_and_its_clock_does_not_jump() {
    if !kvm_test_support::require_kvm(
        "tinyvmm::kvm_a_vm_state_moves_to_another_vm_and_its_clock_does_not_jump",
    ) {
        return;
    }
    use tinyvmm::vm::state::VmState;
    let options = VmOptions {
        irqchip: true,
        ..VmOptions::default()
    };
    let source = Vm::new(options).expect("a VM");
    let mut ioapic = kvm_bindings::kvm_irqchip {
        chip_id: 2,
        ..Default::default()
    };
    source.fd().get_irqchip(&mut ioapic).expect("the IOAPIC");
    // SAFETY: chip_id 2 is the IOAPIC, whose member of the union KVM filled.
    ioapic.chip.ioapic.id = 3;
    source.fd().set_irqchip(&ioapic).expect("an IOAPIC id");
    let saved = VmState::save(source.fd(), &Default::default()).expect("saved");
    let json = serde_json::to_string(&saved).expect("JSON");
    std::thread::sleep(std::time::Duration::from_millis(1500));
    let back: VmState = serde_json::from_str(&json).expect("from JSON");
    let target = Vm::new(options).expect("another VM");
    back.restore(target.fd()).expect("restored");
    let clock = target.fd().get_clock().expect("the clock").clock;
    let ahead = clock.saturating_sub(saved.clock.clock);
    assert!(
        ahead < 500_000_000,
        "the clock jumped {ahead} ns ahead of the saved {} (the VM was away 1.5 s)",
        saved.clock.clock
    );
    let mut restored = kvm_bindings::kvm_irqchip {
        chip_id: 2,
        ..Default::default()
    };
    target.fd().get_irqchip(&mut restored).expect("the IOAPIC");
    // SAFETY: as above.
    assert_eq!(unsafe { restored.chip.ioapic.id }, 3, "the IOAPIC's id");
}
