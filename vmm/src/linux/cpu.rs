//! A vCPU's state for entering Linux: CPUID, MSRs, FPU, local APIC, and the registers, GDT and
//! page tables the boot protocol asks for.

use kvm_bindings::{
    kvm_fpu, kvm_msr_entry, kvm_regs, kvm_segment, kvm_sregs, CpuId, Msrs, KVM_MAX_CPUID_ENTRIES,
};
use kvm_ioctls::{Kvm, VcpuFd};
use vm_memory::{Bytes, GuestMemoryBackend};

use crate::linux::layout;
use crate::linux::loader::Entry;

/// Why a vCPU could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum CpuError {
    /// An ioctl failed.
    #[error("vCPU {vcpu}: {what} failed: {source}")]
    Kvm {
        /// The vCPU.
        vcpu: u8,
        /// The ioctl.
        what: &'static str,
        /// The kernel's error.
        source: kvm_ioctls::Error,
    },
    /// KVM took only some of the MSRs.
    #[error("vCPU {vcpu}: KVM refused MSR {msr:#x} (set {set} of {total})")]
    Msr {
        /// The vCPU.
        vcpu: u8,
        /// The first MSR it refused.
        msr: u32,
        /// MSRs it took.
        set: usize,
        /// MSRs asked.
        total: usize,
    },
    /// The MSR list could not be built.
    #[error("building the MSR list failed: {0:?}")]
    MsrList(vmm_sys_util::fam::Error),
    /// Writing the GDT or page tables failed.
    #[error("writing the boot {what} failed: {source}")]
    Write {
        /// What.
        what: &'static str,
        /// vm-memory's error.
        source: vm_memory::GuestMemoryError,
    },
}

/// The boot GDT's selectors (the 64-bit boot protocol's `__BOOT_CS` and `__BOOT_DS`).
const SEL_CODE: u16 = 0x10;
const SEL_DATA: u16 = 0x18;
const SEL_TSS: u16 = 0x20;

/// A flat segment as a GDT entry: base 0, limit 4 GiB (granularity 4 KiB).
fn gdt_entry(flags: u16) -> u64 {
    // limit 0xfffff, base 0; flags in bits 40-47 (access) and 52-55 (G, D/B, L, AVL).
    let access = u64::from(flags & 0xff) << 40;
    let high = u64::from((flags >> 12) & 0xf) << 52;
    0x000f_0000_0000_ffff | access | high
}

/// Code, long mode (access 0x9b: present, ring 0, execute/read, accessed; G and L).
const CODE64: u16 = 0xa09b;
/// Code, 32-bit protected mode (G and D/B), for PVH.
const CODE32: u16 = 0xc09b;
/// Data (access 0x93: present, ring 0, read/write, accessed; G and D/B).
const DATA: u16 = 0xc093;
/// A busy TSS (access 0x8b), with byte granularity.
const TSS: u16 = 0x008b;

fn kvm_segment_of(entry: u64, selector: u16) -> kvm_segment {
    let base = ((entry >> 16) & 0xff_ffff) | (((entry >> 56) & 0xff) << 24);
    let mut limit = ((entry & 0xffff) | (((entry >> 48) & 0xf) << 16)) as u32;
    let g = ((entry >> 55) & 1) as u8;
    if g == 1 {
        limit = (limit << 12) | 0xfff;
    }
    kvm_segment {
        base,
        limit,
        selector,
        type_: ((entry >> 40) & 0xf) as u8,
        present: ((entry >> 47) & 1) as u8,
        dpl: ((entry >> 45) & 3) as u8,
        db: ((entry >> 54) & 1) as u8,
        s: ((entry >> 44) & 1) as u8,
        l: ((entry >> 53) & 1) as u8,
        g,
        avl: ((entry >> 52) & 1) as u8,
        unusable: 0,
        padding: 0,
    }
}

/// The boot GDT: null, null, code (64-bit, or 32-bit for PVH), data, TSS.
fn gdt(entry: Entry) -> [u64; 5] {
    let code = match entry {
        Entry::Linux64 { .. } => CODE64,
        Entry::Pvh { .. } => CODE32,
    };
    // The TSS: limit 0x67 at base 0; the kernel loads its own before it needs one.
    let tss = (gdt_entry(TSS) & !0x000f_0000_0000_ffff) | 0x67;
    [0, 0, gdt_entry(code), gdt_entry(DATA), tss]
}

/// Writes the GDT and, for the 64-bit entry, identity page tables for the first GiB.
pub(super) fn write_tables<M: GuestMemoryBackend>(
    memory: &M,
    entry: Entry,
) -> Result<(), CpuError> {
    let write = |what| move |source| CpuError::Write { what, source };
    let table: Vec<u8> = gdt(entry).iter().flat_map(|e| e.to_le_bytes()).collect();
    memory
        .write_slice(&table, layout::GDT)
        .map_err(write("GDT"))?;
    if let Entry::Linux64 { .. } = entry {
        // PML4[0] -> PDPT, PDPT[0] -> PD, PD[i] = 2 MiB page i (present, writable, large).
        memory
            .write_obj(layout::PDPT.0 | 0x3, layout::PML4)
            .map_err(write("page tables"))?;
        memory
            .write_obj(layout::PD.0 | 0x3, layout::PDPT)
            .map_err(write("page tables"))?;
        let pd: Vec<u8> = (0..512u64)
            .flat_map(|i| ((i << 21) | 0x83).to_le_bytes())
            .collect();
        memory
            .write_slice(&pd, layout::PD)
            .map_err(write("page tables"))?;
    }
    Ok(())
}

/// The special registers for `entry`.
fn sregs(mut sregs: kvm_sregs, entry: Entry) -> kvm_sregs {
    let table = gdt(entry);
    sregs.gdt.base = layout::GDT.0;
    sregs.gdt.limit = (table.len() * 8 - 1) as u16;
    sregs.idt.base = 0;
    sregs.idt.limit = 0;
    sregs.cs = kvm_segment_of(table[usize::from(SEL_CODE / 8)], SEL_CODE);
    let data = kvm_segment_of(table[usize::from(SEL_DATA / 8)], SEL_DATA);
    sregs.ds = data;
    sregs.es = data;
    sregs.fs = data;
    sregs.gs = data;
    sregs.ss = data;
    sregs.tr = kvm_segment_of(table[usize::from(SEL_TSS / 8)], SEL_TSS);
    match entry {
        Entry::Linux64 { .. } => {
            sregs.cr0 = 0x8000_0033; // PE MP ET NE PG
            sregs.cr3 = layout::PML4.0;
            sregs.cr4 = 0x20; // PAE
            sregs.efer = 0x500; // LME LMA
        }
        Entry::Pvh { .. } => {
            sregs.cr0 = 0x11; // PE ET
            sregs.cr3 = 0;
            sregs.cr4 = 0;
            sregs.efer = 0;
        }
    }
    sregs
}

/// The general registers for `entry` (the boot vCPU).
fn regs(entry: Entry) -> kvm_regs {
    let mut regs = kvm_regs {
        rflags: 0x2,
        rsp: layout::BOOT_STACK_TOP,
        rbp: layout::BOOT_STACK_TOP,
        ..Default::default()
    };
    match entry {
        Entry::Linux64 { rip } => {
            regs.rip = rip;
            regs.rsi = layout::ZERO_PAGE.0;
        }
        Entry::Pvh { rip } => {
            regs.rip = rip;
            regs.rbx = layout::PVH_START_INFO.0;
        }
    }
    regs
}

pub use crate::vm::host_emulates_ring0;

/// CPUID.1:ECX bit 13: `cmpxchg16b`.
const CPUID_1_ECX_CX16: u32 = 1 << 13;
/// CPUID.1:ECX bit 5: VMX (Intel's virtualisation).
const CPUID_1_ECX_VMX: u32 = 1 << 5;
/// CPUID.80000001h:ECX bit 2: SVM (AMD's virtualisation).
const CPUID_8000_0001_ECX_SVM: u32 = 1 << 2;

/// KVM's supported CPUID, completed for vCPU `index` of `count` (see [`complete_cpuid`]).
fn cpuid(
    kvm: &Kvm,
    index: u8,
    count: u8,
    emulated_ring0: bool,
) -> Result<CpuId, kvm_ioctls::Error> {
    let mut cpuid = kvm.get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)?;
    let has_signature = complete_cpuid(cpuid.as_mut_slice(), index, count, emulated_ring0);
    if !has_signature {
        let mut entry = kvm_bindings::kvm_cpuid_entry2 {
            function: 0x4000_0000,
            ..Default::default()
        };
        set_signature(&mut entry);
        // A full list keeps KVM's own leaves; the signature then stays missing.
        let _ = cpuid.push(entry);
    }
    Ok(cpuid)
}

/// Completes KVM's supported CPUID `entries` for vCPU `index` of `count`: the APIC ID, the
/// hypervisor bit and KVM's signature leaf (0x40000000, "KVMKVMKVM"), so the kernel finds
/// kvmclock. Returns whether the signature leaf was there (else the caller adds it).
///
/// With `emulated_ring0` (see [`host_emulates_ring0`]), `cmpxchg16b` is hidden: KVM offers it,
/// but its instruction emulator, where the guest's ring 0 runs on such a host, does not have it,
/// and Linux's slab allocator uses it as soon as the CPU says it has it (the kernel then stops
/// right after printing `Memory: …`; without it, it runs on through the console, IRQ and clock
/// set-up to its `int3` self-test, another instruction the emulator lacks).
///
/// VMX and SVM are always hidden: a guest that ran its own guests would hold nested state
/// (VMCS or VMCB, the L2 guest's registers) that tinyvmm neither saves nor migrates
/// (`KVM_GET_NESTED_STATE`), so a snapshot or a migration of it would lose them. A guest
/// hypervisor needs nested state saved first (DESIGN section 4).
fn complete_cpuid(
    entries: &mut [kvm_bindings::kvm_cpuid_entry2],
    index: u8,
    count: u8,
    emulated_ring0: bool,
) -> bool {
    let mut has_signature = false;
    for entry in entries {
        match entry.function {
            1 => {
                // EBX: APIC ID (31-24), logical processors (23-16), CLFLUSH size in 8 bytes (15-8).
                entry.ebx = (u32::from(index) << 24) | (u32::from(count) << 16) | (8 << 8);
                entry.ecx |= 1 << 31; // running on a hypervisor
                entry.ecx &= !CPUID_1_ECX_VMX;
                if emulated_ring0 {
                    entry.ecx &= !CPUID_1_ECX_CX16;
                }
                if count > 1 {
                    entry.edx |= 1 << 28; // HTT: the logical-processor count is valid
                }
            }
            0xb | 0x1f => entry.edx = u32::from(index), // x2APIC ID
            0x8000_0001 => entry.ecx &= !CPUID_8000_0001_ECX_SVM,
            0x4000_0000 => {
                has_signature = true;
                set_signature(entry);
            }
            _ => {}
        }
    }
    has_signature
}

fn set_signature(entry: &mut kvm_bindings::kvm_cpuid_entry2) {
    let word = |s: &[u8; 4]| u32::from_le_bytes(*s);
    entry.eax = entry.eax.max(0x4000_0001);
    entry.ebx = word(b"KVMK");
    entry.ecx = word(b"VMKV");
    entry.edx = word(b"M\0\0\0");
}

/// The MSRs the boot protocol leaves to the loader: SYSENTER and SYSCALL cleared, the TSC at 0,
/// fast strings on, and MTRRs enabled with write-back as the default type.
fn boot_msrs() -> Vec<kvm_msr_entry> {
    [
        (0x174, 0),             // IA32_SYSENTER_CS
        (0x175, 0),             // IA32_SYSENTER_ESP
        (0x176, 0),             // IA32_SYSENTER_EIP
        (0xc000_0081, 0),       // STAR
        (0xc000_0082, 0),       // LSTAR
        (0xc000_0083, 0),       // CSTAR
        (0xc000_0084, 0),       // SYSCALL_MASK
        (0xc000_0102, 0),       // KERNEL_GS_BASE
        (0x10, 0),              // IA32_TSC
        (0x1a0, 1),             // IA32_MISC_ENABLE: fast strings
        (0x2ff, (1 << 11) | 6), // MTRRdefType: enabled, write-back
    ]
    .into_iter()
    .map(|(index, data)| kvm_msr_entry {
        index,
        data,
        ..Default::default()
    })
    .collect()
}

/// Sets up vCPU `index` of `count`; the boot vCPU (index 0) also gets the entry registers (the
/// others wait for the kernel's INIT/SIPI in the in-kernel local APIC).
pub(super) fn setup_vcpu(
    kvm: &Kvm,
    fd: &VcpuFd,
    index: u8,
    count: u8,
    entry: Entry,
) -> Result<(), CpuError> {
    let kvm_error = |what| {
        move |source| CpuError::Kvm {
            vcpu: index,
            what,
            source,
        }
    };
    let cpuid = cpuid(kvm, index, count, host_emulates_ring0())
        .map_err(kvm_error("KVM_GET_SUPPORTED_CPUID"))?;
    fd.set_cpuid2(&cpuid).map_err(kvm_error("KVM_SET_CPUID2"))?;

    let entries = boot_msrs();
    let msrs = Msrs::from_entries(&entries).map_err(CpuError::MsrList)?;
    let set = fd.set_msrs(&msrs).map_err(kvm_error("KVM_SET_MSRS"))?;
    if set != entries.len() {
        return Err(CpuError::Msr {
            vcpu: index,
            msr: entries[set].index,
            set,
            total: entries.len(),
        });
    }

    let fpu = kvm_fpu {
        fcw: 0x37f,
        mxcsr: 0x1f80,
        ..Default::default()
    };
    fd.set_fpu(&fpu).map_err(kvm_error("KVM_SET_FPU"))?;

    // LINT0 takes the 8259's interrupts (ExtINT), LINT1 NMIs: the virtual-wire mode the MP
    // specification describes.
    let mut lapic = fd.get_lapic().map_err(kvm_error("KVM_GET_LAPIC"))?;
    set_lvt(&mut lapic.regs, 0x350, 7);
    set_lvt(&mut lapic.regs, 0x360, 4);
    fd.set_lapic(&lapic).map_err(kvm_error("KVM_SET_LAPIC"))?;

    if index == 0 {
        let current = fd.get_sregs().map_err(kvm_error("KVM_GET_SREGS"))?;
        fd.set_sregs(&sregs(current, entry))
            .map_err(kvm_error("KVM_SET_SREGS"))?;
        fd.set_regs(&regs(entry))
            .map_err(kvm_error("KVM_SET_REGS"))?;
    }
    Ok(())
}

/// Sets the delivery mode (bits 8-10) of the LVT register at `offset` in the APIC page.
fn set_lvt(regs: &mut [libc::c_char; 1024], offset: usize, mode: u32) {
    let mut bytes = [0u8; 4];
    for (b, r) in bytes.iter_mut().zip(&regs[offset..offset + 4]) {
        *b = *r as u8;
    }
    let value = (u32::from_le_bytes(bytes) & !0x700) | (mode << 8);
    for (r, b) in regs[offset..offset + 4].iter_mut().zip(value.to_le_bytes()) {
        *r = b as libc::c_char;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gdt_entries_decode_to_the_segments_the_protocol_asks_for() {
        let table = gdt(Entry::Linux64 { rip: 0 });
        assert_eq!(table[2], 0x00af_9b00_0000_ffff);
        assert_eq!(table[3], 0x00cf_9300_0000_ffff);
        let cs = kvm_segment_of(table[2], SEL_CODE);
        assert_eq!((cs.l, cs.db, cs.type_, cs.s, cs.present), (1, 0, 0xb, 1, 1));
        assert_eq!(cs.limit, 0xffff_ffff);
        let ds = kvm_segment_of(table[3], SEL_DATA);
        assert_eq!((ds.l, ds.db, ds.type_), (0, 1, 3));
        let tr = kvm_segment_of(table[4], SEL_TSS);
        assert_eq!((tr.type_, tr.s, tr.limit, tr.g), (0xb, 0, 0x67, 0));
        let pvh = kvm_segment_of(gdt(Entry::Pvh { rip: 0 })[2], SEL_CODE);
        assert_eq!((pvh.l, pvh.db), (0, 1));
    }

    #[test]
    fn cpuid_is_completed_and_cmpxchg16b_hidden_only_for_an_emulated_ring0() {
        let leaf = |function, ecx| kvm_bindings::kvm_cpuid_entry2 {
            function,
            ecx,
            ..Default::default()
        };
        let supported = [
            leaf(0, 0),
            leaf(1, CPUID_1_ECX_CX16 | CPUID_1_ECX_VMX | 1),
            leaf(0xb, 0),
            leaf(0x8000_0001, CPUID_8000_0001_ECX_SVM | 1),
        ];
        for emulated in [false, true] {
            let mut entries = supported;
            let has_signature = complete_cpuid(&mut entries, 2, 4, emulated);
            assert!(!has_signature);
            let one = entries[1];
            assert_eq!(one.ebx >> 24, 2, "APIC ID");
            assert_eq!((one.ebx >> 16) & 0xff, 4, "logical processors");
            assert_ne!(one.ecx & (1 << 31), 0, "hypervisor bit");
            assert_eq!(one.ecx & 1, 1, "other features kept");
            assert_eq!(one.ecx & CPUID_1_ECX_CX16 == 0, emulated, "cmpxchg16b");
            assert_ne!(one.edx & (1 << 28), 0, "HTT");
            assert_eq!(entries[2].edx, 2, "x2APIC ID");
            assert_eq!(
                one.ecx & CPUID_1_ECX_VMX,
                0,
                "VMX hidden: nested state is not saved"
            );
            assert_eq!(entries[3].ecx, 1, "SVM hidden, the rest kept");
        }
        let mut with_signature = [leaf(0x4000_0000, 0)];
        assert!(complete_cpuid(&mut with_signature, 0, 1, false));
        assert_eq!(with_signature[0].ebx.to_le_bytes(), *b"KVMK");
    }

    #[test]
    fn lvt_delivery_mode_is_set_and_the_rest_kept() {
        let mut regs = [0 as libc::c_char; 1024];
        regs[0x350] = 0x34;
        regs[0x352] = 0x01; // masked
        set_lvt(&mut regs, 0x350, 7);
        assert_eq!(regs[0x350] as u8, 0x34);
        assert_eq!(regs[0x351] as u8, 0x07);
        assert_eq!(regs[0x352] as u8, 0x01);
    }
}
