//! A Linux guest as a guest kind of the one controller (`controller::Controller`): what its
//! API socket (`tinyvmm boot --api-sock`, `restore` and `receive` of a Linux guest) answers
//! of its own. Its virtio-mem device's requested size, how its vCPUs pause (with the clock and
//! the console) and move, and its state file and State record; the controller answers the
//! rest (memory, dirty log, snapshots, migration, the working-set recording, a stop) and
//! refuses the test guest's own requests.

use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use kvm_memslots_persist::LazyLoader;

use super::hotplug::{hotplug_info, lock, VirtioMemDevice};
use super::state::{LinuxMachine, LinuxRecord};
use super::vcpus::LinuxVcpu;
use crate::control::vm::RunState;
use crate::control::{ControllerError, Outcome, Reply};
use crate::controller::guest::Memory;
use crate::controller::{Controller, Guest, GuestRequest, Moving};
use crate::migration::sink::StateRecord;
use crate::migration::slot::MigrationSlot;
use crate::precopy::PreCopyVcpu;
use crate::snapshot::live::StateWriter;
use crate::vm::state::VcpuState;

const MIB: u64 = 1 << 20;

/// What a Linux guest's API socket offers: the one controller over a [`LinuxGuest`].
pub type LinuxController = Controller<LinuxGuest>;

/// A Linux guest, as the controller asks it.
#[derive(Debug)]
pub struct LinuxGuest {
    memory: Arc<Memory>,
    machine: Arc<LinuxMachine>,
    vcpus: Vec<LinuxVcpu>,
    /// The fault handler of a guest restored with userfaultfd (its working-set recording).
    loader: Option<Arc<LazyLoader>>,
}

impl LinuxController {
    /// A controller over the guest `machine` with `memory`, running on `vcpus` (paused if
    /// `paused`: a restored or received guest); a client's stop sets `stop`.
    pub fn new(
        memory: Arc<Memory>,
        machine: Arc<LinuxMachine>,
        vcpus: Vec<LinuxVcpu>,
        paused: bool,
        stop: Arc<AtomicBool>,
    ) -> Self {
        if paused {
            // A restored or received guest waits for a client: its clock (set to the saved
            // point) is held until then.
            if let Err(e) = machine.clock.freeze(&machine.vm_fd) {
                crate::lifecycle::log(
                    crate::lifecycle::LogLevel::Warn,
                    format_args!("the guest's clock runs on while it waits: {e}"),
                );
            }
        }
        let guest = LinuxGuest {
            memory,
            machine,
            vcpus,
            loader: None,
        };
        Controller::over(guest, paused, stop)
    }

    /// The controller of a guest restored with userfaultfd by `loader`, whose working-set
    /// recording `PUT /working-set/stop` ends.
    pub(crate) fn with_loader(mut self, loader: Option<Arc<LazyLoader>>) -> Self {
        self.guest_mut().loader = loader;
        self
    }

    /// Cancels a migration or a live snapshot under way and waits for it (the VMM is
    /// stopping).
    pub(crate) fn shut_down(&mut self) {
        self.end_copies();
    }
}

impl LinuxGuest {
    fn device(&self) -> Result<&VirtioMemDevice, ControllerError> {
        self.machine.hotplug.as_ref().ok_or_else(|| {
            ControllerError::not_found(
                "no hotplug device: boot with --hotplug-mib to give the guest a virtio-mem device",
            )
        })
    }

    /// The guest's virtio-mem device is still plugging or unplugging (which changes the
    /// memory layout a migration or a live snapshot copies), said as the refusal.
    fn plugging(&self, what: &str) -> Result<(), ControllerError> {
        let Some(device) = &self.machine.hotplug else {
            return Ok(());
        };
        let transport = lock(device);
        let mem = transport.device();
        if mem.plugged_size() == mem.requested_size() {
            return Ok(());
        }
        Err(ControllerError::conflict(format!(
            "the guest is still plugging or unplugging memory ({} MiB plugged of {} MiB \
             requested), which changes the memory layout: {what} once GET /hotplug/memory \
             shows them equal",
            mem.plugged_size() / MIB,
            mem.requested_size() / MIB
        )))
    }

    /// The vCPUs as a migration or a live snapshot pauses and resumes them: those of a VM a
    /// client paused stay paused.
    fn moving(&self, paused: bool) -> Vec<LinuxVcpu> {
        self.vcpus
            .iter()
            .map(|v| LinuxVcpu {
                keep_paused: paused,
                ..v.clone()
            })
            .collect()
    }
}

impl Guest for LinuxGuest {
    type Vcpu = LinuxVcpu;

    const LACKS: &'static str = "is for the test guest (tinyvmm serve); a Linux guest's memory \
                                 changes through /hotplug/memory, and it runs no guest commands";

    fn memory(&self) -> &Arc<Memory> {
        &self.memory
    }

    fn loader(&self) -> Option<&LazyLoader> {
        self.loader.as_deref()
    }

    fn vcpu_count(&self) -> usize {
        self.vcpus.len()
    }

    fn answer(&mut self, request: GuestRequest, _state: RunState) -> Option<Outcome> {
        Some(match request {
            GuestRequest::GetHotplug => self.device().map(|d| Reply::Hotplug(hotplug_info(d))),
            GuestRequest::RequestHotplug(request) => self
                .device()
                .and_then(|device| {
                    let bytes = request.requested_size_mib.checked_mul(MIB).ok_or_else(|| {
                        ControllerError::bad(format!(
                            "requested_size_mib {} is too large",
                            request.requested_size_mib
                        ))
                    })?;
                    // The guest plugs or unplugs on its own time; GET shows how far it got.
                    lock(device)
                        .set_requested_size(bytes)
                        .map_err(ControllerError::bad)
                })
                .map(|()| Reply::Done),
            GuestRequest::ConfigureHotplug(_) => Err(ControllerError::conflict(
                "a Linux guest's hotplug device is configured at boot (--hotplug-mib, --hotplug-block-mib)",
            )),
            GuestRequest::AddRegion(_)
            | GuestRequest::RemoveRegion(_)
            | GuestRequest::PatchRegion(..)
            | GuestRequest::Command(_) => return None,
        })
    }

    /// Pauses every vCPU (unless paused already); if one cannot pause, those paused go on
    /// again.
    fn pause(&mut self, state: RunState) -> Result<Reply, ControllerError> {
        if state == RunState::Paused {
            return Ok(Reply::Done);
        }
        for (index, vcpu) in self.vcpus.iter().enumerate() {
            if let Err(e) = vcpu.shared.pause(super::vcpus::PAUSE_TIMEOUT) {
                for paused in &self.vcpus[..=index] {
                    paused.shared.resume();
                }
                return Err(ControllerError::conflict(format!(
                    "vCPU {index} could not be paused: {e}"
                )));
            }
        }
        // What the guest wrote to the console before the pause is out.
        self.machine.devices.flush();
        // The guest sees no time pass while it is paused.
        if let Err(e) = self.machine.clock.freeze(&self.machine.vm_fd) {
            crate::lifecycle::log(
                crate::lifecycle::LogLevel::Warn,
                format_args!("the guest's clock runs on while it is paused: {e}"),
            );
        }
        Ok(Reply::Done)
    }

    /// Resumes every vCPU, those an unconfirmed migration held too (their hold ends only
    /// here).
    fn resume(&mut self, held: &mut MigrationSlot<LinuxVcpu>) {
        if let Err(e) = self.machine.clock.thaw(&self.machine.vm_fd) {
            crate::lifecycle::log(
                crate::lifecycle::LogLevel::Warn,
                format_args!("the guest's clock jumps by the time it was paused: {e}"),
            );
        }
        held.resume_held();
        for vcpu in &self.vcpus {
            vcpu.shared.resume();
        }
    }
    fn refuse_moving(&self, what: Moving) -> Result<(), ControllerError> {
        self.plugging(match what {
            Moving::Migration => "migrate",
            Moving::LiveSnapshot => "take a live snapshot",
        })
    }

    fn moving_vcpus(&self, _what: Moving, paused: bool) -> Result<Vec<LinuxVcpu>, ControllerError> {
        Ok(self.moving(paused))
    }

    fn save_vcpus(&mut self) -> Result<Vec<VcpuState>, ControllerError> {
        self.vcpus
            .iter()
            .enumerate()
            .map(|(index, vcpu)| {
                vcpu.save().map_err(|e| {
                    ControllerError::internal(format!("the snapshot failed: vCPU {index}: {e}"))
                })
            })
            .collect()
    }

    /// Makes a snapshot's state file (the vCPUs paused).
    fn state_writer(&self) -> StateWriter {
        let machine = Arc::clone(&self.machine);
        Box::new(move |layout, states| {
            let mut state = machine
                .save(None, layout, states, true)
                .map_err(|e| e.to_string())?;
            Ok(Box::new(move |info| {
                state.snapshot = Some(info);
                state.to_bytes()
            }))
        })
    }
    fn migration_record(&self, paused: bool) -> Box<dyn StateRecord> {
        Box::new(LinuxRecord {
            machine: Arc::clone(&self.machine),
            paused,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What the controller says when a Linux guest is asked what only the test guest answers
    /// (it was `LinuxRequest::try_from`'s refusal, word for word).
    #[test]
    fn a_linux_guest_names_hotplug_memory_for_the_test_guests_requests() {
        assert_eq!(
            format!("PUT /guest/command {}", LinuxGuest::LACKS),
            "PUT /guest/command is for the test guest (tinyvmm serve); a Linux guest's memory \
             changes through /hotplug/memory, and it runs no guest commands"
        );
    }
}
