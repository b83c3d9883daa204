//! The test guest's commands: write, verify and write loops on a vCPU, and ending them.
//!
//! A command runs on its vCPU while the controller goes on applying other requests: it answers
//! [`Reply::Deferred`], and the answer comes from the controller's `settle` (the [`Guest`]
//! trait's, [`TestGuest::collect_commands`]) once the guest reported (the vCPUs' notifier wakes
//! the event loop). What ends a command early (`cancel`,
//! a pause, the VMM stopping) sets the command block's `stop` to "now": the guest looks every
//! 64 addresses and reports how far it got.

use super::TestGuest;
use crate::control::guest::{GuestCommand, GuestCommandResult, GuestOp};
use crate::control::{ControllerError, Outcome, Reply, Ticket};
#[cfg(doc)]
use crate::controller::Guest;
use crate::test_guest::vcpus::{GuestError, Vcpus};
use crate::test_guest::{self, Command, Op};

/// A deferred request, waiting for commands to end.
#[derive(Debug)]
pub(super) struct Waiter {
    ticket: Ticket,
    /// The vCPUs whose commands it still waits for.
    vcpus: Vec<usize>,
    /// What it answers.
    answer: Answer,
}

/// What a [`Waiter`] answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Answer {
    /// What its (one) vCPU's command answers: the command itself, `stop_loop`, `cancel`.
    Command,
    /// 204 once all its vCPUs' commands ended (a pause that cut them short).
    Done,
}

impl TestGuest {
    pub(super) fn guest_command(&mut self, command: GuestCommand) -> Outcome {
        let op = match command.op {
            GuestOp::Write => Op::Write,
            GuestOp::Verify => Op::Verify,
            GuestOp::WriteLoop => Op::WriteLoop,
            GuestOp::VexWrite => Op::VexWrite,
            GuestOp::VexVerify => Op::VexVerify,
            GuestOp::Exec => Op::Exec,
            GuestOp::Call => Op::Call,
            GuestOp::StopLoop => return self.end_command(command.vcpu, true),
            GuestOp::Cancel => return self.end_command(command.vcpu, false),
        };
        if !command.start.is_multiple_of(8)
            || command.stride == 0
            || !command.stride.is_multiple_of(8)
        {
            return Err(ControllerError::bad(
                "start and stride must be multiples of 8, and stride not 0",
            ));
        }
        if command.end <= command.start {
            return Err(ControllerError::bad("end must be above start"));
        }
        if matches!(op, Op::VexWrite | Op::VexVerify) {
            if [command.start, command.end, command.stride]
                .iter()
                .any(|v| !v.is_multiple_of(32))
            {
                return Err(ControllerError::bad(
                    "vex_write and vex_verify touch 32 bytes at each address: start, end and \
                     stride must be multiples of 32",
                ));
            }
            if !test_guest::layout::avx_available() {
                return Err(ControllerError::conflict(
                    "this host's KVM offers no AVX: the guest cannot run vex_write or vex_verify",
                ));
            }
        }
        self.reachable(command.start, command.end)?;
        let posted = Command {
            op,
            start: command.start,
            end: command.end,
            stride: command.stride,
            seed: command.seed,
        };
        self.refuse_read_only_writes(&posted)?;
        let vcpus = self.vcpus()?;
        check_vcpu(vcpus, command.vcpu)?;
        if let Some(running) = vcpus.running(command.vcpu) {
            return Err(ControllerError::conflict(format!(
                "vCPU {} runs a {:?} command: wait for its answer or end it first (op cancel; \
                 stop_loop for a loop)",
                command.vcpu, running.op
            )));
        }
        vcpus.start(command.vcpu, posted);
        if op == Op::WriteLoop {
            return Ok(Reply::Guest(GuestCommandResult::Started));
        }
        Ok(self.defer(vec![command.vcpu], Answer::Command))
    }

    /// Refuses a command that would write into a read-only region: KVM makes each such write
    /// an MMIO exit, which the exit loop drops as ROM does, so the command would answer `ok`
    /// and leave nothing written.
    fn refuse_read_only_writes(&self, command: &Command) -> Result<(), ControllerError> {
        if !command.writes() {
            return Ok(());
        }
        let read_only = self.vm.memory().regions().into_iter().find(|r| {
            r.flags.read_only && command.touches(r.gpa.0..r.gpa.0.saturating_add(r.size))
        });
        match read_only {
            Some(region) => Err(ControllerError::conflict(format!(
                "region {id} [{:#x}, {:#x}) is read-only: the guest's writes there would be \
                 dropped. Make it writable first (PATCH /memory/regions/{id} \
                 {{\"read_only\": false}}), or only verify it",
                region.gpa.0,
                region.gpa.0.saturating_add(region.size),
                id = region.id,
            ))),
            None => Ok(()),
        }
    }

    /// Refuses `change` of region `id` while a vCPU's command touches one of `ranges` (where
    /// the region is, and for a move where it goes): a region made read-only would drop a
    /// write command's writes from then on, unseen; a region removed or moved would leave any
    /// command's next access with no memory, which kills the guest. Read-only changes refuse
    /// writing commands only (a `verify` reads a read-only region as any other).
    pub(super) fn refuse_under_commands(
        &self,
        id: u64,
        ranges: &[std::ops::Range<u64>],
        change: RegionChange,
    ) -> Result<(), ControllerError> {
        let Some(vcpus) = &self.vcpus else {
            return Ok(());
        };
        let busy = (0..vcpus.count()).find_map(|v| {
            vcpus
                .running(v)
                .filter(|c| change != RegionChange::ReadOnly || c.writes())
                .filter(|c| ranges.iter().any(|r| c.touches(r.clone())))
                .map(|c| (v, c))
        });
        let Some((vcpu, command)) = busy else {
            return Ok(());
        };
        let what = match change {
            RegionChange::ReadOnly => format!(
                "writes into region {id}, whose writes would be dropped once it is read-only"
            ),
            RegionChange::Remove => format!(
                "reaches into region {id}, whose memory would be gone under it (the guest would \
                 fail)"
            ),
            RegionChange::Move => format!(
                "reaches into region {id} or where it would go, whose memory would move under \
                 it (the guest would fail)"
            ),
            RegionChange::Unplug => "reaches into the hotplug area's blocks this would unplug, \
                                     whose memory would be gone under it (the guest would fail)"
                .to_owned(),
        };
        Err(ControllerError::conflict(format!(
            "vCPU {vcpu} runs a {:?} command that {what}: wait for its answer or end it first \
             (PUT /guest/command op cancel, or op stop_loop for a loop, with \"vcpu\": {vcpu})",
            command.op
        )))
    }

    /// Ends vCPU `vcpu`'s command: its write loop after the current pass (`after_pass`), or
    /// any command where it is (`cancel`). Answers what the command answers, when it does.
    fn end_command(&mut self, vcpu: usize, after_pass: bool) -> Outcome {
        let vcpus = self.vcpus()?;
        check_vcpu(vcpus, vcpu)?;
        let running = vcpus.running(vcpu);
        if after_pass && !running.is_some_and(|c| c.op == Op::WriteLoop) {
            return Err(ControllerError::conflict(format!(
                "vCPU {vcpu} runs no write loop"
            )));
        }
        if running.is_none() {
            return Err(ControllerError::conflict(format!(
                "vCPU {vcpu} runs no command"
            )));
        }
        if after_pass {
            vcpus.stop_loop(vcpu);
        } else {
            vcpus.cancel(vcpu);
        }
        Ok(self.defer(vec![vcpu], Answer::Command))
    }

    /// Cuts short every command but write loops (a pause) and every command someone waits for
    /// (`waited`: the VMM is stopping); returns the vCPUs cut.
    pub(super) fn cut_commands(&mut self, waited: bool) -> Vec<usize> {
        let Some(vcpus) = &self.vcpus else {
            return Vec::new();
        };
        let cut: Vec<usize> = (0..vcpus.count())
            .filter(|&v| {
                let waited_for = waited && self.waiters.iter().any(|w| w.vcpus.contains(&v));
                vcpus
                    .running(v)
                    .is_some_and(|c| c.op != Op::WriteLoop || waited_for)
            })
            .collect();
        for &v in &cut {
            vcpus.cancel(v);
        }
        cut
    }

    /// Defers the answer until the commands of `vcpus` have ended.
    pub(super) fn defer(&mut self, vcpus: Vec<usize>, answer: Answer) -> Reply {
        let ticket = Ticket(self.next_ticket);
        self.next_ticket += 1;
        self.waiters.push(Waiter {
            ticket,
            vcpus,
            answer,
        });
        Reply::Deferred(ticket)
    }

    /// Collects the commands that ended and answers those who wait for them.
    pub(super) fn collect_commands(&mut self) -> Vec<(Ticket, Outcome)> {
        let mut ready = Vec::new();
        let Some(vcpus) = &mut self.vcpus else {
            return ready;
        };
        // Read first: news that comes after the polls below makes it readable again.
        let _ = vcpus.notifier().read();
        for v in 0..vcpus.count() {
            let Some((command, run)) = vcpus.poll(v) else {
                continue;
            };
            let result = command_result(command, run);
            self.waiters.retain_mut(|waiter| {
                if !waiter.vcpus.contains(&v) {
                    return true;
                }
                waiter.vcpus.retain(|&w| w != v);
                match waiter.answer {
                    Answer::Command => {
                        ready.push((waiter.ticket, result.clone().map(Reply::Guest)));
                        false
                    }
                    Answer::Done if waiter.vcpus.is_empty() => {
                        ready.push((waiter.ticket, Ok(Reply::Done)));
                        false
                    }
                    Answer::Done => true,
                }
            });
        }
        ready
    }
}

fn check_vcpu(vcpus: &Vcpus, vcpu: usize) -> Result<(), ControllerError> {
    if vcpu >= vcpus.count() {
        return Err(ControllerError::bad(format!(
            "vcpu {vcpu} does not exist (the VM has {})",
            vcpus.count()
        )));
    }
    Ok(())
}

/// What `command`'s run means to a client.
fn command_result(
    command: Command,
    run: Result<test_guest::Outcome, GuestError>,
) -> Result<GuestCommandResult, ControllerError> {
    match run {
        Ok(outcome) => Ok(match (outcome.cut_at, command.op) {
            (Some(address), op) => GuestCommandResult::Cancelled {
                address,
                done_bytes: address.saturating_sub(command.start),
                passes: (op == Op::WriteLoop).then_some(outcome.passes),
            },
            (None, Op::WriteLoop) => GuestCommandResult::Stopped {
                passes: outcome.passes,
                last_seed: outcome
                    .passes
                    .checked_sub(1)
                    .map(|k| command.seed.wrapping_add(k)),
            },
            (None, _) => GuestCommandResult::Ok,
        }),
        Err(GuestError::GuestSawWrongData {
            gpa,
            found,
            expected,
        }) => Ok(GuestCommandResult::Mismatch {
            address: gpa,
            found,
            expected,
        }),
        Err(e) => Err(ControllerError::internal(e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn outcome(cut_at: Option<u64>, passes: u64) -> test_guest::Outcome {
        test_guest::Outcome {
            mismatch: None,
            passes,
            cut_at,
        }
    }

    fn command(op: Op) -> Command {
        Command {
            op,
            start: 0x1000_0000,
            end: 0x2000_0000,
            stride: 4096,
            seed: 40,
        }
    }

    #[test]
    fn a_command_cut_short_says_how_far_it_got() {
        let write = command(Op::Write);
        assert_eq!(
            command_result(write, Ok(outcome(Some(0x1000_3000), 0))),
            Ok(GuestCommandResult::Cancelled {
                address: 0x1000_3000,
                done_bytes: 0x3000,
                passes: None,
            })
        );
        assert_eq!(
            command_result(write, Ok(outcome(None, 0))),
            Ok(GuestCommandResult::Ok)
        );
        let write_loop = command(Op::WriteLoop);
        assert_eq!(
            command_result(write_loop, Ok(outcome(Some(0x1800_0000), 2))),
            Ok(GuestCommandResult::Cancelled {
                address: 0x1800_0000,
                done_bytes: 0x800_0000,
                passes: Some(2),
            })
        );
        // A cancel that came between two passes ends the loop as a stop does.
        assert_eq!(
            command_result(write_loop, Ok(outcome(None, 3))),
            Ok(GuestCommandResult::Stopped {
                passes: 3,
                last_seed: Some(42),
            })
        );
        let failed = command_result(write, Err(GuestError::Stopped(0))).expect_err("failed");
        assert_eq!(failed.kind, crate::control::ErrorKind::Internal);
    }
}

/// A change of a region that a running guest command can be in the way of
/// ([`TestGuest::refuse_under_commands`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum RegionChange {
    /// Made read-only.
    ReadOnly,
    /// Removed.
    Remove,
    /// Moved.
    Move,
    /// Unplugged (blocks of the hotplug area; the id is not used).
    Unplug,
}
