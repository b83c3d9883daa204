//! The one controller over a fake guest kind: what it answers itself, what it asks the kind,
//! and the one refusal of what a kind lacks.

use std::cell::Cell;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use kvm_memslots_persist::LazyLoader;

use super::guest::Memory;
use super::{Controller, Guest, GuestRequest, Moving};
use crate::control::vm::{
    FailureReason, RunState, VmAction, VmActionType, VmFailure, VmStatePatch, VmStateRequest,
};
use crate::control::{Apply, ControllerError, ErrorKind, Outcome, Reply, Request};
use crate::migration::sink::StateRecord;
use crate::migration::slot::MigrationSlot;
use crate::precopy::PreCopyVcpu;
use crate::snapshot::live::StateWriter;
use crate::vm::state::VcpuState;
use crate::vm::vcpu::PauseError;
use crate::vm::{Vm, VmOptions};

/// A vCPU that is never moved.
#[derive(Debug)]
struct Vcpu;

impl PreCopyVcpu for Vcpu {
    fn pause(&self) -> Result<(), PauseError> {
        Err(PauseError::Stopped)
    }

    fn save(&self) -> Result<VcpuState, PauseError> {
        Err(PauseError::Stopped)
    }

    fn resume(&self) {}

    fn hold(&self) {}

    fn release(&self) {}
}

/// A guest kind that answers hotplug reads only, and says what it was asked.
#[derive(Debug)]
struct Fake {
    memory: Arc<Memory>,
    pause_fails: bool,
    failure: Option<VmFailure>,
    answered: Cell<usize>,
    pauses: usize,
    resumes: usize,
    cut: bool,
}

impl Guest for Fake {
    type Vcpu = Vcpu;

    const LACKS: &'static str = "is not for the fake guest";

    fn memory(&self) -> &Arc<Memory> {
        &self.memory
    }

    fn loader(&self) -> Option<&LazyLoader> {
        None
    }

    fn vcpu_count(&self) -> usize {
        2
    }

    fn failure(&self) -> Option<&VmFailure> {
        self.failure.as_ref()
    }

    fn answer(&mut self, request: GuestRequest, _state: RunState) -> Option<Outcome> {
        self.answered.set(self.answered.get() + 1);
        match request {
            GuestRequest::GetHotplug => Some(Err(ControllerError::not_found("no hotplug"))),
            _ => None,
        }
    }

    fn pause(&mut self, _state: RunState) -> Result<Reply, ControllerError> {
        self.pauses += 1;
        if self.pause_fails {
            return Err(ControllerError::conflict("vCPU 0 could not be paused"));
        }
        Ok(Reply::Done)
    }

    fn resume(&mut self, _held: &mut MigrationSlot<Vcpu>) {
        self.resumes += 1;
    }

    fn moving_vcpus(&self, _what: Moving, _paused: bool) -> Result<Vec<Vcpu>, ControllerError> {
        Ok(Vec::new())
    }

    fn save_vcpus(&mut self) -> Result<Vec<VcpuState>, ControllerError> {
        Ok(Vec::new())
    }

    fn state_writer(&self) -> StateWriter {
        Box::new(|_, _| Ok(Box::new(|_| Vec::new())))
    }

    fn migration_record(&self, _paused: bool) -> Box<dyn StateRecord> {
        unreachable!("the fake guest never migrates")
    }

    fn notifier(&self) -> Option<RawFd> {
        None
    }

    fn cut_short(&mut self) {
        self.cut = true;
    }
}

/// A controller over a fake guest on a real VM's memory, or `None` without KVM.
fn controller(test: &str) -> Option<(Controller<Fake>, Arc<AtomicBool>)> {
    if !kvm_test_support::require_kvm(test) {
        return None;
    }
    let vm = Vm::new(VmOptions::default()).expect("a VM");
    let fake = Fake {
        memory: Arc::clone(vm.memory()),
        pause_fails: false,
        failure: None,
        answered: Cell::new(0),
        pauses: 0,
        resumes: 0,
        cut: false,
    };
    let stop = Arc::new(AtomicBool::new(false));
    Some((Controller::over(fake, false, Arc::clone(&stop)), stop))
}

fn patch(state: VmStateRequest) -> Request {
    Request::PatchVm(VmStatePatch { state })
}

fn run_state(controller: &mut Controller<Fake>) -> RunState {
    match controller.apply(Request::GetVm) {
        Ok(Reply::Vm(info)) => info.state,
        other => panic!("GET /vm: {other:?}"),
    }
}

#[test]
fn kvm_a_request_the_kind_lacks_is_refused_once_with_its_route() {
    let Some((mut controller, _)) =
        controller("tinyvmm::controller::kvm_a_request_the_kind_lacks_is_refused_once")
    else {
        return;
    };
    let refused = controller
        .apply(Request::RemoveRegion(1))
        .expect_err("the fake lacks it");
    assert_eq!(refused.kind, ErrorKind::NotFound);
    assert_eq!(
        refused.message,
        "DELETE /memory/regions/{id} is not for the fake guest"
    );
    // What the kind answers is its own answer, not the refusal.
    let own = controller
        .apply(Request::GetHotplug)
        .expect_err("the fake's own");
    assert_eq!(own.message, "no hotplug");
    assert_eq!(controller.guest().answered.get(), 2);
}

#[test]
fn kvm_shared_requests_are_answered_without_the_kind() {
    let Some((mut controller, _)) =
        controller("tinyvmm::controller::kvm_shared_requests_are_answered_without_the_kind")
    else {
        return;
    };
    assert!(matches!(
        controller.apply(Request::GetMemory),
        Ok(Reply::Memory(_))
    ));
    assert!(matches!(
        controller.apply(Request::GetDirtyLog),
        Ok(Reply::DirtyLog(_))
    ));
    let no_recording = controller
        .apply(Request::StopRecording)
        .expect_err("no loader");
    assert_eq!(no_recording.kind, ErrorKind::Conflict);
    match controller.apply(Request::GetVm) {
        Ok(Reply::Vm(info)) => {
            assert_eq!(info.state, RunState::Running);
            assert_eq!(info.vcpus, 2);
            assert_eq!(info.failure, None);
        }
        other => panic!("GET /vm: {other:?}"),
    }
    assert_eq!(controller.guest().answered.get(), 0);
}

#[test]
fn kvm_the_run_state_follows_the_kinds_pause_and_resume() {
    let Some((mut controller, _)) =
        controller("tinyvmm::controller::kvm_the_run_state_follows_the_kinds_pause_and_resume")
    else {
        return;
    };
    controller.guest_mut().pause_fails = true;
    let refused = controller
        .apply(patch(VmStateRequest::Paused))
        .expect_err("the pause fails");
    assert_eq!(refused.kind, ErrorKind::Conflict);
    assert_eq!(run_state(&mut controller), RunState::Running);
    controller.guest_mut().pause_fails = false;
    assert_eq!(
        controller.apply(patch(VmStateRequest::Paused)),
        Ok(Reply::Done)
    );
    assert_eq!(run_state(&mut controller), RunState::Paused);
    assert_eq!(
        controller.apply(patch(VmStateRequest::Resumed)),
        Ok(Reply::Done)
    );
    assert_eq!(run_state(&mut controller), RunState::Running);
    assert_eq!(
        (controller.guest().pauses, controller.guest().resumes),
        (2, 1)
    );
}

#[test]
fn kvm_a_failed_guest_is_failed_and_refuses_pause_and_resume() {
    let Some((mut controller, _)) =
        controller("tinyvmm::controller::kvm_a_failed_guest_is_failed_and_refuses_pause")
    else {
        return;
    };
    controller.guest_mut().failure = Some(VmFailure {
        vcpu: 1,
        reason: FailureReason::TripleFault,
        rip: None,
        message: "vCPU 1 shut down".to_owned(),
    });
    assert_eq!(run_state(&mut controller), RunState::Failed);
    for state in [VmStateRequest::Paused, VmStateRequest::Resumed] {
        let refused = controller.apply(patch(state)).expect_err("failed");
        assert_eq!(refused.kind, ErrorKind::Conflict);
        assert!(
            refused
                .message
                .ends_with(". It runs nothing more: stop the VMM (PUT /actions Stop)"),
            "{}",
            refused.message
        );
    }
    assert_eq!(
        (controller.guest().pauses, controller.guest().resumes),
        (0, 0)
    );
}

#[test]
fn kvm_a_stop_sets_the_flag_and_cuts_the_kinds_waits_short() {
    let Some((mut controller, stop)) =
        controller("tinyvmm::controller::kvm_a_stop_sets_the_flag_and_cuts_the_kinds_waits")
    else {
        return;
    };
    assert!(!controller.stop_requested());
    let stopped = controller.apply(Request::Act(VmAction {
        action_type: VmActionType::Stop,
    }));
    assert_eq!(stopped, Ok(Reply::Done));
    assert!(stop.load(Ordering::Acquire));
    assert!(controller.stop_requested());
    assert!(controller.guest().cut);
}
