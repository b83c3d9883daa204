//! The test guest's commands: `PUT /guest/command`.

use serde::{Deserialize, Serialize};

/// The test guest's operations, as the API names them (and `tinyvmm client guest`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum GuestOp {
    /// Write the pattern.
    Write,
    /// Check the pattern.
    Verify,
    /// Start writing passes over the range (pass `k` with seed `seed + k`) and answer at once;
    /// the guest keeps writing until `stop_loop`.
    WriteLoop,
    /// End the vCPU's write loop after its current pass; answers the passes completed.
    StopLoop,
    /// As `write`, 32 bytes at each address with one AVX store (`vmovdqu ymm`): the u64 at
    /// `a + 8i` holds `(a + 8i) ^ seed`. `start`, `end` and `stride` multiples of 32; only
    /// where the host's KVM offers AVX.
    VexWrite,
    /// As `verify`, reading 32 bytes at each address with one AVX load.
    VexVerify,
    /// Store an 8-byte stub at each address and call it, so that the guest runs code from
    /// every address; a stub that does not return its own address is a mismatch.
    Exec,
    /// As `exec` without the store: call the stubs an `exec` left.
    Call,
    /// End the vCPU's command where it is (within 64 addresses): a write or verify answers
    /// `GuestCommandResult::Cancelled`, and so does this request; a write loop ends in the
    /// middle of its pass.
    Cancel,
}

/// `PUT /guest/command`: run one command of the test guest.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GuestCommand {
    /// What to do.
    pub(crate) op: GuestOp,
    /// First guest address (a multiple of 8); not for `stop_loop` and `cancel`.
    #[serde(default)]
    pub(crate) start: u64,
    /// First address after the range; not for `stop_loop` and `cancel`.
    #[serde(default)]
    pub(crate) end: u64,
    /// Distance between touched addresses (a non-zero multiple of 8); not for `stop_loop` and
    /// `cancel`.
    #[serde(default)]
    pub(crate) stride: u64,
    /// Pattern seed: the value at address `a` is `a ^ seed`.
    #[serde(default)]
    pub(crate) seed: u64,
    /// The vCPU to run it on (0 by default).
    #[serde(default)]
    pub(crate) vcpu: usize,
}

/// `PUT /guest/command`: what the guest found.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "result", rename_all = "snake_case")]
pub enum GuestCommandResult {
    /// The command ran; a verify found every address as expected.
    Ok,
    /// A verify found an address that does not hold its pattern.
    Mismatch {
        /// The address.
        address: u64,
        /// What it held.
        found: u64,
        /// What it should have held.
        expected: u64,
    },
    /// A write loop started.
    Started,
    /// A write loop ended.
    Stopped {
        /// Passes completed over the whole range.
        passes: u64,
        /// The seed of the last complete pass (`seed + passes - 1`): what the range holds.
        last_seed: Option<u64>,
    },
    /// The command was cut short (`cancel`, a pause, the VMM stopping) before its end.
    Cancelled {
        /// The first address of the range it did not reach: every stride-th address below it
        /// was written (or, for a verify, held its pattern).
        address: u64,
        /// Bytes of the range below `address`.
        done_bytes: u64,
        /// For a write loop: the passes completed before the one cut short.
        #[serde(skip_serializing_if = "Option::is_none")]
        passes: Option<u64>,
    },
}
