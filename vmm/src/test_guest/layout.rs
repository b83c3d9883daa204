//! The test guest's memory layout, the code and tables in its system region, and the state its
//! vCPUs start in (see `resources/guest/test_guest.S`).

use kvm_bindings::{kvm_regs, kvm_segment, kvm_sregs};
use vm_memory::{Bytes, GuestAddress, GuestMemory};

/// The guest's code, assembled from `resources/guest/test_guest.S` by the build.
pub const CODE: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/test_guest.bin"));

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

/// Size of the system region at guest address 0 (one slot): tables, code, stacks, commands.
pub const SYSTEM_SIZE: u64 = 2 * MIB;
/// The command blocks, one of `COMMAND_BLOCK_SIZE` bytes per vCPU.
pub const COMMANDS_GPA: u64 = 0x1000;
/// Bytes per command block.
pub const COMMAND_BLOCK_SIZE: u64 = 0x100;
/// Where the exception stubs store the vector and the top of the exception stack.
pub const FAULT_GPA: u64 = 0x1f00;
const GDT_GPA: u64 = 0x2000;
const IDT_GPA: u64 = 0x3000;
const EXCEPTION_STACK_TOP: u64 = 0x8000;
const USER_STACKS_TOP: u64 = 0x10000;
const USER_STACK_SIZE: u64 = 0x800;
/// Where the guest's code is loaded.
pub const CODE_GPA: u64 = 0x10000;
const PML4_GPA: u64 = 0x20000;
const PDPT_GPA: u64 = 0x21000;
const PD_GPA: u64 = 0x22000;
/// The TSS, followed by its I/O permission bitmap (one bit per port, set: refused).
const TSS_GPA: u64 = 0x70000;
const IO_BITMAP_OFFSET: u64 = 0x68;
/// The TSS with its bitmap and the terminating all-ones byte the architecture requires.
const TSS_LIMIT: u64 = IO_BITMAP_OFFSET + 0x2000;
/// Guest-physical memory the identity page tables map (2 MiB pages, user-accessible).
pub const IDENTITY_MAPPED: u64 = 64 * GIB;
/// Most vCPUs the layout has command blocks and stacks for.
pub const MAX_VCPUS: usize = 15;
/// Offset of exception stub `n` in the code.
const STUBS_OFFSET: u64 = 0x100;
const VECTORS: u64 = 32;

// The layout's pieces do not overlap, checked when compiling.
const _: () = {
    assert!(COMMANDS_GPA + MAX_VCPUS as u64 * COMMAND_BLOCK_SIZE <= FAULT_GPA);
    assert!(USER_STACKS_TOP - MAX_VCPUS as u64 * USER_STACK_SIZE >= EXCEPTION_STACK_TOP);
    assert!(PD_GPA + IDENTITY_MAPPED / GIB * 0x1000 <= TSS_GPA);
    assert!(TSS_GPA + TSS_LIMIT < SYSTEM_SIZE);
};

/// Ports the guest writes to.
pub mod port {
    /// A command finished (or the guest is ready for its first one).
    pub const DONE: u16 = 0x510;
    /// The guest ran the exit command.
    pub const EXIT: u16 = 0x511;
    /// An exception reached the guest's ring 0: the fault block says which.
    pub const FAULT: u16 = 0x512;
}

const SEL_KERNEL_CODE: u16 = 0x08;
const SEL_USER_DATA: u16 = 0x18 | 3;
const SEL_USER_CODE: u16 = 0x20 | 3;
const SEL_TSS: u16 = 0x28;

/// Writes the page tables, descriptor tables, TSS and code into the system region.
pub fn write_system_memory(mem: &impl GuestMemory) -> Result<(), vm_memory::GuestMemoryError> {
    assert!(
        CODE.len() as u64 <= PML4_GPA - CODE_GPA,
        "the test guest outgrew its space"
    );
    mem.write_slice(CODE, GuestAddress(CODE_GPA))?;
    // Identity map with 2 MiB user-accessible, writable pages.
    let pds = IDENTITY_MAPPED / GIB;
    mem.write_obj(PDPT_GPA | 0x7, GuestAddress(PML4_GPA))?;
    for i in 0..pds {
        mem.write_obj((PD_GPA + i * 0x1000) | 0x7, GuestAddress(PDPT_GPA + i * 8))?;
    }
    for i in 0..pds * 512 {
        mem.write_obj((i * 2 * MIB) | 0x87, GuestAddress(PD_GPA + i * 8))?;
    }
    let tss_base = TSS_GPA;
    let tss_low = TSS_LIMIT
        | ((tss_base & 0xff_ffff) << 16)
        | (0x89 << 40)
        | ((TSS_LIMIT >> 16) << 48)
        | ((tss_base >> 24) << 56);
    let gdt: [u64; 7] = [
        0,
        0x00af_9a00_0000_ffff, // kernel code, 64-bit
        0x00cf_9200_0000_ffff, // kernel data
        0x00cf_f200_0000_ffff, // user data, DPL 3
        0x00af_fa00_0000_ffff, // user code, 64-bit, DPL 3
        tss_low,               // TSS, available
        tss_base >> 32,
    ];
    for (i, entry) in gdt.iter().enumerate() {
        mem.write_obj(*entry, GuestAddress(GDT_GPA + i as u64 * 8))?;
    }
    // TSS: the stack for exceptions taken from ring 3, and an I/O bitmap that lets ring 3 use
    // exactly the guest's ports. (IOPL 3 in RFLAGS would do, but not every host keeps the IOPL
    // the VMM sets: this one clears it.)
    mem.write_obj(EXCEPTION_STACK_TOP, GuestAddress(TSS_GPA + 4))?;
    mem.write_obj(IO_BITMAP_OFFSET as u16, GuestAddress(TSS_GPA + 0x66))?;
    let bitmap = TSS_GPA + IO_BITMAP_OFFSET;
    mem.write_slice(&[0xff; 0x2001], GuestAddress(bitmap))?;
    for p in [port::DONE, port::EXIT, port::FAULT] {
        let byte = GuestAddress(bitmap + u64::from(p / 8));
        let bits: u8 = mem.read_obj(byte)?;
        mem.write_obj(bits & !(1 << (p % 8)), byte)?;
    }
    for vector in 0..VECTORS {
        let handler = CODE_GPA + STUBS_OFFSET + 16 * vector;
        let low = (handler & 0xffff)
            | (u64::from(SEL_KERNEL_CODE) << 16)
            | (0x8e << 40)
            | ((handler >> 16) & 0xffff) << 48;
        mem.write_obj(low, GuestAddress(IDT_GPA + 16 * vector))?;
        mem.write_obj(handler >> 32, GuestAddress(IDT_GPA + 16 * vector + 8))?;
    }
    Ok(())
}

fn segment(selector: u16, code: bool) -> kvm_segment {
    kvm_segment {
        base: 0,
        limit: 0xffff_ffff,
        selector,
        type_: if code { 0xb } else { 0x3 },
        present: 1,
        dpl: (selector & 3) as u8,
        db: u8::from(!code),
        s: 1,
        l: u8::from(code),
        g: 1,
        ..Default::default()
    }
}

/// The special registers of a vCPU entering the guest: long mode, paging on, ring 3.
pub fn boot_sregs(mut sregs: kvm_sregs) -> kvm_sregs {
    sregs.cr0 = 0x8005_0033; // PE MP ET NE WP AM PG
    sregs.cr3 = PML4_GPA;
    sregs.cr4 = 0x20; // PAE
    sregs.efer = 0x500; // LME LMA
    sregs.gdt.base = GDT_GPA;
    sregs.gdt.limit = 7 * 8 - 1;
    sregs.idt.base = IDT_GPA;
    sregs.idt.limit = (VECTORS * 16 - 1) as u16;
    sregs.cs = segment(SEL_USER_CODE, true);
    let data = segment(SEL_USER_DATA, false);
    sregs.ds = data;
    sregs.es = data;
    sregs.fs = data;
    sregs.gs = data;
    sregs.ss = data;
    sregs.tr = kvm_segment {
        base: TSS_GPA,
        limit: TSS_LIMIT as u32,
        selector: SEL_TSS,
        type_: 0xb, // busy 64-bit TSS
        present: 1,
        ..Default::default()
    };
    sregs
}

/// The general registers of vCPU `index` entering the guest.
pub fn boot_regs(index: usize) -> kvm_regs {
    assert!(index < MAX_VCPUS);
    kvm_regs {
        rip: CODE_GPA,
        rsp: USER_STACKS_TOP - index as u64 * USER_STACK_SIZE,
        rsi: command_block(index).0,
        rdi: index as u64,
        rflags: 0x3002, // IOPL 3, reserved bit 1
        ..Default::default()
    }
}

/// The command block of vCPU `index`.
pub fn command_block(index: usize) -> GuestAddress {
    GuestAddress(COMMANDS_GPA + index as u64 * COMMAND_BLOCK_SIZE)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_layout_fits_and_the_code_has_its_stubs_where_the_idt_says() {
        assert!(
            CODE.len() as u64 > STUBS_OFFSET + VECTORS * 16,
            "code too short for its stubs"
        );
        // Each stub starts with `push imm8` (0x6a) of its own vector.
        for vector in 0..VECTORS {
            let at = (STUBS_OFFSET + 16 * vector) as usize;
            assert_eq!(&CODE[at..at + 2], &[0x6a, vector as u8], "stub {vector}");
        }
    }
}
