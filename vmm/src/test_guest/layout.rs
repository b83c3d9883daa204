//! The test guest's memory layout, the code and tables in its system region, and the state its
//! vCPUs start in (see `resources/guest/test_guest.S`).

use kvm_bindings::{
    kvm_cpuid_entry2, kvm_regs, kvm_segment, kvm_sregs, kvm_xcrs, KVM_MAX_CPUID_ENTRIES,
};
use kvm_ioctls::{Kvm, VcpuFd};
use vm_memory::{Bytes, GuestAddress, GuestMemory};

/// The guest's code, assembled from `resources/guest/test_guest.S` by the build.
const CODE: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/test_guest.bin"));

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

/// Size of the system region at guest address 0 (one slot): tables, code, stacks, commands.
pub(super) const SYSTEM_SIZE: u64 = 2 * MIB;
/// The command blocks, one of `COMMAND_BLOCK_SIZE` bytes per vCPU.
const COMMANDS_GPA: u64 = 0x1000;
/// Bytes per command block.
const COMMAND_BLOCK_SIZE: u64 = 0x100;
/// Where the exception stubs store the vector and the top of the exception stack.
pub(super) const FAULT_GPA: u64 = 0x1f00;
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
/// Where the hotplug area starts (above the test area and regions placed for it).
pub(super) const HOTPLUG_GPA: u64 = 32 << 30;
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
pub(super) mod port {
    /// A command finished (or the guest is ready for its first one).
    pub(crate) const DONE: u16 = 0x510;
    /// The guest ran the exit command.
    pub(crate) const EXIT: u16 = 0x511;
    /// An exception reached the guest's ring 0: the fault block says which.
    pub(crate) const FAULT: u16 = 0x512;
}

const SEL_KERNEL_CODE: u16 = 0x08;
const SEL_USER_DATA: u16 = 0x18 | 3;
const SEL_USER_CODE: u16 = 0x20 | 3;
const SEL_TSS: u16 = 0x28;

/// Writes the page tables, descriptor tables, TSS and code into the system region.
pub(super) fn write_system_memory(
    mem: &impl GuestMemory,
) -> Result<(), vm_memory::GuestMemoryError> {
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
fn boot_sregs(mut sregs: kvm_sregs) -> kvm_sregs {
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

/// CR4's bits that let the guest use SSE and AVX: OSFXSR, OSXMMEXCPT and OSXSAVE.
const CR4_AVX: u64 = (1 << 9) | (1 << 10) | (1 << 18);
/// XCR0 with the x87, SSE and AVX state.
const XCR0_AVX: u64 = 0b111;

/// Leaf 1's ECX bits for XSAVE and AVX.
const CPUID1_XSAVE_AVX: u32 = (1 << 26) | (1 << 28);

/// Whether the guest can have AVX: the host's CPU has AVX and XSAVE, and `cpuid` (KVM's
/// supported CPUID) lets XCR0 hold the x87, SSE and AVX state (leaf 0xd). KVM's leaf 1 may
/// still hide XSAVE and AVX (kvm_pvm does), so [`set_up_vcpu`] sets them in the guest's.
fn cpuid_has_avx(cpuid: &[kvm_cpuid_entry2]) -> bool {
    let host =
        std::arch::is_x86_feature_detected!("avx") && std::arch::is_x86_feature_detected!("xsave");
    let xstate = cpuid
        .iter()
        .find(|e| e.function == 0xd && e.index == 0)
        .is_some_and(|e| u64::from(e.eax) & XCR0_AVX == XCR0_AVX);
    host && xstate
}

/// Whether the test guest's vCPUs get AVX on this host (KVM offers it): the VEX commands
/// ([`super::Op::VexWrite`], [`super::Op::VexVerify`]) need it. False without `/dev/kvm`.
pub fn avx_available() -> bool {
    static AVX: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *AVX.get_or_init(|| {
        Kvm::new()
            .and_then(|kvm| kvm.get_supported_cpuid(KVM_MAX_CPUID_ENTRIES))
            .is_ok_and(|cpuid| cpuid_has_avx(cpuid.as_slice()))
    })
}

/// Sets up vCPU `index` to enter the guest: KVM's supported CPUID, the boot registers, and
/// where KVM offers AVX, CR4.OSFXSR|OSXMMEXCPT|OSXSAVE and XCR0 = x87|SSE|AVX (nothing in the
/// guest sets them up: its ring 0, emulated on some hosts, stays minimal). Returns whether AVX
/// is on.
pub(super) fn set_up_vcpu(
    kvm: &Kvm,
    fd: &VcpuFd,
    index: usize,
) -> Result<bool, (&'static str, kvm_ioctls::Error)> {
    let mut cpuid = kvm
        .get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)
        .map_err(|e| ("KVM_GET_SUPPORTED_CPUID", e))?;
    let avx = cpuid_has_avx(cpuid.as_slice());
    if avx {
        for entry in cpuid.as_mut_slice() {
            if entry.function == 1 {
                entry.ecx |= CPUID1_XSAVE_AVX;
            }
        }
    }
    fd.set_cpuid2(&cpuid).map_err(|e| ("KVM_SET_CPUID2", e))?;
    let mut sregs = boot_sregs(fd.get_sregs().map_err(|e| ("KVM_GET_SREGS", e))?);
    if avx {
        sregs.cr4 |= CR4_AVX;
    }
    fd.set_sregs(&sregs).map_err(|e| ("KVM_SET_SREGS", e))?;
    if avx {
        let mut xcrs = kvm_xcrs {
            nr_xcrs: 1,
            ..Default::default()
        };
        xcrs.xcrs[0].xcr = 0;
        xcrs.xcrs[0].value = XCR0_AVX;
        fd.set_xcrs(&xcrs).map_err(|e| ("KVM_SET_XCRS", e))?;
    }
    fd.set_regs(&boot_regs(index))
        .map_err(|e| ("KVM_SET_REGS", e))?;
    Ok(avx)
}

/// The general registers of vCPU `index` entering the guest.
fn boot_regs(index: usize) -> kvm_regs {
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
pub(super) fn command_block(index: usize) -> GuestAddress {
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
