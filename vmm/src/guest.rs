//! The built-in test guest: its memory layout, the state its vCPUs start in, and the command
//! blocks through which the host drives it (see `resources/guest/test_guest.S`).

use std::sync::atomic::Ordering;

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

/// What the guest does with a range.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// Write `a ^ seed` at every `stride`-th address `a` of the range, once.
    Write,
    /// Check that every `stride`-th address `a` holds `a ^ seed`; report the first that does not.
    Verify,
    /// Write passes (pass `k` with seed `seed + k`) until the host sets `stop`.
    WriteLoop,
    /// Leave: report on the exit port and stop.
    Exit,
}

impl Op {
    fn code(self) -> u64 {
        match self {
            Op::Write => 1,
            Op::Verify => 2,
            Op::WriteLoop => 3,
            Op::Exit => 4,
        }
    }
}

/// One command for the guest.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Command {
    /// What to do.
    pub op: Op,
    /// First address of the range.
    pub start: u64,
    /// First address after the range.
    pub end: u64,
    /// Distance between the addresses touched (a multiple of 8).
    pub stride: u64,
    /// Pattern seed.
    pub seed: u64,
}

impl Command {
    /// A command with no range (for [`Op::Exit`]).
    pub fn exit() -> Self {
        Command {
            op: Op::Exit,
            start: 0,
            end: 0,
            stride: 8,
            seed: 0,
        }
    }
}

/// The value the guest writes at `addr` with `seed`.
pub fn pattern(addr: u64, seed: u64) -> u64 {
    addr ^ seed
}

mod field {
    pub const CMD_SEQ: u64 = 0x00;
    pub const DONE_SEQ: u64 = 0x08;
    pub const OP: u64 = 0x10;
    pub const START: u64 = 0x18;
    pub const END: u64 = 0x20;
    pub const STRIDE: u64 = 0x28;
    pub const SEED: u64 = 0x30;
    pub const STOP: u64 = 0x38;
    pub const RESULT: u64 = 0x40;
    pub const FOUND: u64 = 0x48;
    pub const PASSES: u64 = 0x50;
}

/// The host's side of one vCPU's command block.
#[derive(Debug, Clone, Copy)]
pub struct CommandBlock {
    base: GuestAddress,
}

/// What the guest reported for a finished command.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Outcome {
    /// For a verify: the first address that did not hold its pattern, and what it held.
    pub mismatch: Option<(u64, u64)>,
    /// For a write loop: the passes completed.
    pub passes: u64,
}

impl CommandBlock {
    /// The block of vCPU `index`.
    pub fn new(index: usize) -> Self {
        CommandBlock {
            base: command_block(index),
        }
    }

    fn at(&self, field: u64) -> GuestAddress {
        GuestAddress(self.base.0 + field)
    }

    fn load(&self, mem: &impl GuestMemory, field: u64) -> u64 {
        mem.load(self.at(field), Ordering::Acquire)
            .expect("the command block is in the system region")
    }

    fn store(&self, mem: &impl GuestMemory, field: u64, value: u64) {
        mem.store(value, self.at(field), Ordering::Release)
            .expect("the command block is in the system region");
    }

    /// Posts `command`; returns its sequence number. The vCPU must be between commands.
    pub fn post(&self, mem: &impl GuestMemory, command: &Command) -> u64 {
        self.store(mem, field::OP, command.op.code());
        self.store(mem, field::START, command.start);
        self.store(mem, field::END, command.end);
        self.store(mem, field::STRIDE, command.stride);
        self.store(mem, field::SEED, command.seed);
        self.store(mem, field::STOP, 0);
        let seq = self.load(mem, field::CMD_SEQ) + 1;
        self.store(mem, field::CMD_SEQ, seq);
        seq
    }

    /// Asks a write loop to end after its current pass.
    pub fn stop(&self, mem: &impl GuestMemory) {
        self.store(mem, field::STOP, 1);
    }

    /// Passes a write loop has completed so far.
    pub fn passes(&self, mem: &impl GuestMemory) -> u64 {
        self.load(mem, field::PASSES)
    }

    /// The sequence number of the last command the guest finished.
    pub fn done_seq(&self, mem: &impl GuestMemory) -> u64 {
        self.load(mem, field::DONE_SEQ)
    }

    /// What the guest reported for its last finished command.
    pub fn outcome(&self, mem: &impl GuestMemory, op: Op) -> Outcome {
        let result = self.load(mem, field::RESULT);
        Outcome {
            mismatch: (op == Op::Verify && result != 0)
                .then(|| (result, self.load(mem, field::FOUND))),
            passes: self.load(mem, field::PASSES),
        }
    }
}

/// What the guest's exception stub recorded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fault {
    /// The exception vector.
    pub vector: u64,
    /// The top of the exception stack: [error code,] rip, cs, rflags, rsp, ss.
    pub frame: [u64; 5],
}

impl Fault {
    /// Reads the fault block.
    pub fn read(mem: &impl GuestMemory) -> Self {
        let word = |i: u64| {
            mem.read_obj::<u64>(GuestAddress(FAULT_GPA + 8 * i))
                .unwrap_or(0)
        };
        Fault {
            vector: word(0),
            frame: [word(1), word(2), word(3), word(4), word(5)],
        }
    }

    /// The guest's instruction pointer at the fault.
    pub fn rip(&self) -> u64 {
        // Vectors 8, 10-14, 17, 21, 29 and 30 push an error code before the return frame.
        if matches!(self.vector, 8 | 10..=14 | 17 | 21 | 29 | 30) {
            self.frame[1]
        } else {
            self.frame[0]
        }
    }
}

impl std::fmt::Display for Fault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "exception {} at rip {:#x} (frame {:x?})",
            self.vector,
            self.rip(),
            self.frame
        )
    }
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

    #[test]
    fn a_fault_with_an_error_code_finds_its_rip_behind_it() {
        let page_fault = Fault {
            vector: 14,
            frame: [2, 0x10_123, 0x23, 0x3002, 0x9000],
        };
        assert_eq!(page_fault.rip(), 0x10_123);
        let divide = Fault {
            vector: 0,
            frame: [0x10_456, 0x23, 0x3002, 0x9000, 0x1b],
        };
        assert_eq!(divide.rip(), 0x10_456);
    }
}
