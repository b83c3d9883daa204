//! The test guest's commands: write, verify and write loops on a vCPU.

use super::Controller;
use crate::control::guest::{GuestCommand, GuestCommandResult, GuestOp};
use crate::control::{ControllerError, ErrorKind};
use crate::test_guest::vcpus::{GuestError, Vcpus};
use crate::test_guest::{self, Command, Op};

impl Controller {
    pub(super) fn guest_command(
        &mut self,
        command: GuestCommand,
    ) -> Result<GuestCommandResult, ControllerError> {
        if command.op == GuestOp::StopLoop {
            return self.stop_loop(command.vcpu);
        }
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
        self.reachable(command.start, command.end)?;
        let vcpus = self.vcpus()?;
        check_vcpu(vcpus, command.vcpu)?;
        if let Some(running) = vcpus.running(command.vcpu) {
            return Err(ControllerError::conflict(format!(
                "vCPU {} runs a {:?} command: stop it first (op stop_loop)",
                command.vcpu, running.op
            )));
        }
        let op = match command.op {
            GuestOp::Write => Op::Write,
            GuestOp::Verify => Op::Verify,
            GuestOp::WriteLoop => Op::WriteLoop,
            GuestOp::StopLoop => unreachable!("handled above"),
        };
        let guest_command = Command {
            op,
            start: command.start,
            end: command.end,
            stride: command.stride,
            seed: command.seed,
        };
        if op == Op::WriteLoop {
            vcpus.start(command.vcpu, guest_command);
            return Ok(GuestCommandResult::Started);
        }
        guest_outcome(vcpus.run(command.vcpu, guest_command))
    }

    /// Ends vCPU `vcpu`'s write loop and reports its passes.
    fn stop_loop(&mut self, vcpu: usize) -> Result<GuestCommandResult, ControllerError> {
        let vcpus = self.vcpus()?;
        check_vcpu(vcpus, vcpu)?;
        let seed = match vcpus.running(vcpu) {
            Some(command) if command.op == Op::WriteLoop => command.seed,
            _ => {
                return Err(ControllerError::conflict(format!(
                    "vCPU {vcpu} runs no write loop"
                )))
            }
        };
        vcpus.stop_loop(vcpu);
        let outcome = vcpus.wait(vcpu);
        match outcome {
            Ok(outcome) => Ok(GuestCommandResult::Stopped {
                passes: outcome.passes,
                last_seed: outcome.passes.checked_sub(1).map(|k| seed.wrapping_add(k)),
            }),
            Err(e) => guest_outcome(Err(e)),
        }
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

/// What a guest command's run means to a client.
fn guest_outcome(
    run: Result<test_guest::Outcome, GuestError>,
) -> Result<GuestCommandResult, ControllerError> {
    match run {
        Ok(_) => Ok(GuestCommandResult::Ok),
        Err(GuestError::GuestSawWrongData {
            gpa,
            found,
            expected,
        }) => Ok(GuestCommandResult::Mismatch {
            address: gpa,
            found,
            expected,
        }),
        Err(GuestError::Interrupted) => Err(ControllerError::new(
            ErrorKind::Unavailable,
            "the VMM is stopping (a signal came) while the guest ran the command",
        )),
        Err(e) => Err(ControllerError::internal(e)),
    }
}
