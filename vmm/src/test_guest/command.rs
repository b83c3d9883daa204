//! The command protocol: what the host posts in a vCPU's command block, what the guest reports
//! back, and what its exception stubs record.

use std::sync::atomic::Ordering;

use vm_memory::{Bytes, GuestAddress, GuestMemory};

use super::layout::{command_block, FAULT_GPA};

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
    /// As [`Op::Write`], 32 bytes at each address (a multiple of 32) with one VEX store
    /// (`vmovdqu ymm`): the u64 at `a + 8i` holds `(a + 8i) ^ seed`. Needs AVX
    /// ([`super::layout::avx_available`]).
    VexWrite,
    /// As [`Op::Verify`], reading 32 bytes at each address with one VEX load.
    VexVerify,
    /// Store an 8-byte stub at each address (a plain `mov`) and call it: the guest runs code
    /// from every address. The stub returns its own address; one that returns another is a
    /// mismatch (`Outcome::mismatch`).
    Exec,
    /// As [`Op::Exec`] without the store: call the stubs already there.
    Call,
}

impl Op {
    fn from_code(code: u64) -> Option<Op> {
        [
            Op::Write,
            Op::Verify,
            Op::WriteLoop,
            Op::Exit,
            Op::VexWrite,
            Op::VexVerify,
            Op::Exec,
            Op::Call,
        ]
        .into_iter()
        .find(|op| op.code() == code)
    }

    fn code(self) -> u64 {
        match self {
            Op::Write => 1,
            Op::Verify => 2,
            Op::WriteLoop => 3,
            Op::Exit => 4,
            Op::VexWrite => 5,
            Op::VexVerify => 6,
            Op::Exec => 7,
            Op::Call => 8,
        }
    }

    /// Whether the guest checks what it finds and reports a mismatch.
    fn checks(self) -> bool {
        matches!(self, Op::Verify | Op::VexVerify | Op::Exec | Op::Call)
    }
}

/// The stub [`Op::Exec`] stores at each address, as the u64 it writes: `lea rax, [rip - 7];
/// ret`, which returns its own address.
pub const STUB: u64 = 0xc3ff_ffff_f905_8d48;

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

    /// Whether the guest writes memory for this command (a write, a write loop, a VEX write,
    /// an exec).
    pub(super) fn writes(&self) -> bool {
        matches!(self.op, Op::Write | Op::WriteLoop | Op::VexWrite | Op::Exec)
    }

    /// Whether one of the addresses the command touches (every `stride`-th from `start`, below
    /// `end`) lies in `range`.
    pub(super) fn touches(&self, range: std::ops::Range<u64>) -> bool {
        let from = range.start.max(self.start);
        let to = range.end.min(self.end);
        if from >= to || self.stride == 0 {
            return false;
        }
        // The command's first address at or above `from`.
        (from - self.start)
            .div_ceil(self.stride)
            .checked_mul(self.stride)
            .and_then(|offset| self.start.checked_add(offset))
            .is_some_and(|first| first < to)
    }
}

/// The value the guest writes at `addr` with `seed`.
pub fn pattern(addr: u64, seed: u64) -> u64 {
    addr ^ seed
}

mod field {
    pub(crate) const CMD_SEQ: u64 = 0x00;
    pub(crate) const DONE_SEQ: u64 = 0x08;
    pub(crate) const OP: u64 = 0x10;
    pub(crate) const START: u64 = 0x18;
    pub(crate) const END: u64 = 0x20;
    pub(crate) const STRIDE: u64 = 0x28;
    pub(crate) const SEED: u64 = 0x30;
    pub(crate) const STOP: u64 = 0x38;
    pub(crate) const RESULT: u64 = 0x40;
    pub(crate) const FOUND: u64 = 0x48;
    pub(crate) const PASSES: u64 = 0x50;
    pub(crate) const CUT_AT: u64 = 0x58;
}

/// `stop` values: end a write loop after its pass, or end any command where it is.
mod stop {
    pub(crate) const AFTER_PASS: u64 = 1;
    pub(crate) const NOW: u64 = 2;
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
    /// For a command cancelled before its end: the first address of the range it did not
    /// reach (every stride-th address below it was done).
    pub(crate) cut_at: Option<u64>,
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
    pub(super) fn post(&self, mem: &impl GuestMemory, command: &Command) -> u64 {
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

    /// The command the guest is on, with its sequence number, if it has not finished it (a
    /// VM that arrived by migration or snapshot mid-command); `None` between commands.
    pub(super) fn unfinished(&self, mem: &impl GuestMemory) -> Option<(Command, u64)> {
        let seq = self.load(mem, field::CMD_SEQ);
        if seq == self.load(mem, field::DONE_SEQ) {
            return None;
        }
        let command = Command {
            op: Op::from_code(self.load(mem, field::OP))?,
            start: self.load(mem, field::START),
            end: self.load(mem, field::END),
            stride: self.load(mem, field::STRIDE),
            seed: self.load(mem, field::SEED),
        };
        Some((command, seq))
    }

    /// Asks a write loop to end after its current pass.
    pub(super) fn stop(&self, mem: &impl GuestMemory) {
        self.store(mem, field::STOP, stop::AFTER_PASS);
    }

    /// Asks the command under way to end where it is: the guest looks every 64 addresses, and
    /// reports how far it got ([`Outcome::cut_at`]). A write loop ends in the middle of its
    /// pass, which does not count.
    pub(super) fn cancel(&self, mem: &impl GuestMemory) {
        self.store(mem, field::STOP, stop::NOW);
    }

    /// Passes a write loop has completed so far.
    pub fn passes(&self, mem: &impl GuestMemory) -> u64 {
        self.load(mem, field::PASSES)
    }

    /// The sequence number of the last command the guest finished.
    pub(super) fn done_seq(&self, mem: &impl GuestMemory) -> u64 {
        self.load(mem, field::DONE_SEQ)
    }

    /// What the guest reported for its last finished command.
    pub(super) fn outcome(&self, mem: &impl GuestMemory, op: Op) -> Outcome {
        let result = self.load(mem, field::RESULT);
        Outcome {
            mismatch: (op.checks() && result != 0).then(|| (result, self.load(mem, field::FOUND))),
            passes: self.load(mem, field::PASSES),
            // Ranges start above the system region, so 0 is never an address reached.
            cut_at: Some(self.load(mem, field::CUT_AT)).filter(|&at| at != 0),
        }
    }
}

/// What the guest's exception stub recorded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fault {
    /// The exception vector.
    pub vector: u64,
    /// The top of the exception stack: [error code,] rip, cs, rflags, rsp, ss.
    frame: [u64; 5],
}

impl Fault {
    /// Reads the fault block.
    pub(super) fn read(mem: &impl GuestMemory) -> Self {
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
    fn a_command_touches_a_range_only_where_its_stride_lands() {
        let write = Command {
            op: Op::Write,
            start: 0x1000,
            end: 0x5000,
            stride: 0x1000,
            seed: 0,
        };
        assert!(write.writes());
        // It touches 0x1000, 0x2000, 0x3000 and 0x4000.
        assert!(write.touches(0x4000..0x4008));
        assert!(write.touches(0..0x1008));
        assert!(!write.touches(0x2008..0x3000), "between two addresses");
        assert!(!write.touches(0x5000..0x6000), "past the end");
        assert!(!write.touches(0..0x1000), "below the start");
        assert!(!write.touches(0x3000..0x3000), "an empty range");
        let verify = Command {
            op: Op::Verify,
            ..write
        };
        assert!(!verify.writes());
        let near_top = Command {
            start: u64::MAX - 0xfff,
            end: u64::MAX,
            ..write
        };
        assert!(!near_top.touches(u64::MAX - 8..u64::MAX));
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
