//! A minimal VMM on kvm-memslots: a VM with memory in several KVM slots, a real-mode guest
//! that writes two bytes into memory hotplugged after boot, and a dirty-page harvest that finds
//! exactly those pages.
//!
//! ```sh
//! cargo run --release -p kvm-memslots --example minimal_vmm
//! ```

use std::sync::Arc;

use kvm_ioctls::{Kvm, VcpuExit};
use kvm_memslots::{KvmVm, MemoryManager, RegionSpec, SlotFlags, Target};
use vm_memory::{Bytes, GuestAddress, GuestAddressSpace};

/// Real-mode code: point DS at the hotplugged region, write a byte in its first and second
/// pages, tell the VMM (`out 0x10`), halt.
const GUEST: &[u8] = &[
    0xb8, 0x00, 0x20, // mov ax, 0x2000
    0x8e, 0xd8, // mov ds, ax          ; DS base 0x20000
    0xc6, 0x06, 0x00, 0x00, 0x42, // mov byte [0x0000], 0x42
    0xc6, 0x06, 0x00, 0x10, 0x43, // mov byte [0x1000], 0x43
    0xe6, 0x10, // out 0x10, al
    0xf4, // hlt
];
const CODE: u64 = 0x1000;
const HOTPLUG: u64 = 0x2_0000;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let kvm = Kvm::new().map_err(|e| format!("cannot open /dev/kvm: {e}"))?;
    let vm = Arc::new(kvm.create_vm()?);
    // The manager owns guest memory and mirrors it to KVM's slots.
    let kvm_vm = KvmVm::new(&kvm, Arc::clone(&vm))?;
    let memory = MemoryManager::new(kvm_vm);

    // 64 KiB of RAM at 0, in four 16 KiB KVM slots, with the guest's code in it.
    memory.add_region(RegionSpec::new(GuestAddress(0), 64 << 10).with_slot_size(16 << 10))?;
    let guest = memory.handle();
    guest.memory().write_slice(GUEST, GuestAddress(CODE))?;

    // One vCPU in real mode at the code.
    let vcpu = memory.kvm().create_vcpu(0)?;
    let mut sregs = vcpu.get_sregs()?;
    sregs.cs.base = 0;
    sregs.cs.selector = 0;
    vcpu.set_sregs(&sregs)?;
    let mut regs = vcpu.get_regs()?;
    regs.rip = CODE;
    regs.rflags = 2;
    vcpu.set_regs(&regs)?;

    // Hotplug 64 KiB at 128 KiB (two 32 KiB slots) with dirty logging on, before the guest
    // runs; the first harvest takes its initially-dirty pages.
    let hotplugged = memory.add_region(
        RegionSpec::new(GuestAddress(HOTPLUG), 64 << 10)
            .with_slot_size(32 << 10)
            .with_flags(SlotFlags {
                log_dirty: true,
                read_only: false,
            }),
    )?;
    memory.harvest_dirty(Target::Region(hotplugged))?;
    let usage = memory.slot_usage();
    println!("{} KVM slots in use of {}", usage.used, usage.max);

    let mut vcpu = vcpu;
    loop {
        match vcpu.run()? {
            VcpuExit::IoOut(0x10, _) => println!("the guest says it is done"),
            VcpuExit::Hlt => break,
            other => return Err(format!("unexpected exit: {other:?}").into()),
        }
    }

    let dirty = memory.harvest_dirty(Target::Region(hotplugged))?;
    let pages: Vec<u64> = dirty[0].addresses().map(|a| a.0).collect();
    println!("dirty pages of the hotplugged region: {pages:#x?}");
    let written: [u8; 2] = [
        guest.memory().read_obj(GuestAddress(HOTPLUG))?,
        guest.memory().read_obj(GuestAddress(HOTPLUG + 0x1000))?,
    ];
    println!("the guest wrote {written:#x?}");
    if pages != [HOTPLUG, HOTPLUG + 0x1000] || written != [0x42, 0x43] {
        return Err("the harvest or the memory is not what the guest wrote".into());
    }
    println!("ok");
    Ok(())
}
