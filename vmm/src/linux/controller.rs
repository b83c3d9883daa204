//! A Linux guest's controller: what its API socket (`tinyvmm boot --api-sock`, `restore` and
//! `receive` of a Linux guest) answers. Pausing and resuming, Full and Diff snapshots of a
//! paused VM and live ones of a running VM (the snapshot chain every guest kind shares),
//! dirty logging, live migration (the generic migration with this guest's vCPUs and State
//! record), its memory, its virtio-mem device's requested size, ending a lazy restore's
//! working-set recording, and a stop; the table in `control::support` refuses the test
//! guest's own requests before they get here.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use kvm_memslots::{KvmVm, MemoryManager};

use super::hotplug::{hotplug_info, lock, VirtioMemDevice};
use super::state::{LinuxMachine, LinuxRecord};
use super::vcpus::LinuxVcpu;
use crate::control::dirty_log::DirtyLogClient;
use crate::control::memory::{memory_info, region_info};
use crate::control::snapshot::no_recording;
use crate::control::support::LinuxRequest;
use crate::control::vm::{RunState, VmInfo, VmStateRequest};
use crate::control::{Apply, ControllerError, Outcome, Reply, Request};
use crate::migration::slot::MigrationSlot;
use crate::precopy::{PreCopyVcpu, SourceVm};
use crate::snapshot::live::StateWriter;
use crate::snapshot::SnapshotChain;

const MIB: u64 = 1 << 20;

/// What a Linux guest's API socket offers.
#[derive(Debug)]
pub struct LinuxController {
    memory: Arc<MemoryManager<KvmVm>>,
    machine: Arc<LinuxMachine>,
    vcpus: Vec<LinuxVcpu>,
    state: RunState,
    stop: Arc<AtomicBool>,
    chain: SnapshotChain,
    dirty_log: DirtyLogClient,
    migration: MigrationSlot<LinuxVcpu>,
    /// The fault handler of a guest restored with userfaultfd (its working-set recording).
    loader: Option<Arc<kvm_memslots_persist::LazyLoader>>,
    /// The process's stop flag (SIGINT/SIGTERM), for a migration's waits.
    interrupt: &'static AtomicBool,
}

impl LinuxController {
    /// A controller over the guest `machine` with `memory`, running on `vcpus` (paused if
    /// `paused`: a restored or received guest); a client's stop sets `stop`.
    pub fn new(
        memory: Arc<MemoryManager<KvmVm>>,
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
        LinuxController {
            memory,
            machine,
            vcpus,
            state: if paused {
                RunState::Paused
            } else {
                RunState::Running
            },
            stop,
            chain: SnapshotChain::new(),
            dirty_log: DirtyLogClient::default(),
            migration: MigrationSlot::default(),
            loader: None,
            interrupt: crate::lifecycle::termination_signal(),
        }
    }

    /// The controller of a guest restored with userfaultfd by `loader`, whose working-set
    /// recording `PUT /working-set/stop` ends.
    pub fn with_loader(self, loader: Option<Arc<kvm_memslots_persist::LazyLoader>>) -> Self {
        LinuxController { loader, ..self }
    }

    /// Whether the VM runs on a migration's destination now (the VMM should stop).
    pub fn migrated(&self) -> bool {
        self.migration.completed()
    }

    /// The last migration's progress, if one was started.
    pub fn migration_info(&self) -> Option<crate::control::migration::MigrationInfo> {
        self.migration.info()
    }

    /// Cancels a migration or a live snapshot under way and waits for it (the VMM is
    /// stopping).
    pub fn shut_down(&mut self) {
        self.migration.shut_down();
        self.chain.shut_down(&self.memory);
    }

    fn device(&self) -> Result<&VirtioMemDevice, ControllerError> {
        self.machine.hotplug.as_ref().ok_or_else(|| {
            ControllerError::not_found(
                "no hotplug device: boot with --hotplug-mib to give the guest a virtio-mem device",
            )
        })
    }

    /// Pauses every vCPU; if one cannot pause, those paused go on again.
    fn pause(&mut self) -> Result<(), ControllerError> {
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
        self.state = RunState::Paused;
        Ok(())
    }

    /// Resumes every vCPU, those an unconfirmed migration held too (their hold ends only
    /// here).
    fn resume(&mut self) {
        if let Err(e) = self.machine.clock.thaw(&self.machine.vm_fd) {
            crate::lifecycle::log(
                crate::lifecycle::LogLevel::Warn,
                format_args!("the guest's clock jumps by the time it was paused: {e}"),
            );
        }
        self.migration.resume_held();
        for vcpu in &self.vcpus {
            vcpu.shared.resume();
        }
        self.state = RunState::Running;
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
    fn moving_vcpus(&self) -> Vec<LinuxVcpu> {
        let paused = self.state == RunState::Paused;
        self.vcpus
            .iter()
            .map(|v| LinuxVcpu {
                keep_paused: paused,
                ..v.clone()
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

    fn create_snapshot(
        &mut self,
        create: crate::control::snapshot::SnapshotCreate,
    ) -> Result<(), ControllerError> {
        if create.live {
            self.plugging("take a live snapshot")?;
            return self.chain.start_live(
                &self.memory,
                &create,
                self.moving_vcpus(),
                self.state_writer(),
                self.interrupt,
            );
        }
        create.check_paused(self.state == RunState::Paused)?;
        let vcpus = &self.vcpus;
        let save_states = || {
            vcpus
                .iter()
                .enumerate()
                .map(|(index, vcpu)| {
                    vcpu.save().map_err(|e| {
                        ControllerError::internal(format!("the snapshot failed: vCPU {index}: {e}"))
                    })
                })
                .collect()
        };
        let write_state = self.state_writer();
        self.chain
            .create(&self.memory, &create, save_states, write_state)
            .map(|_| ())
    }

    fn migrate(
        &mut self,
        request: crate::control::migration::MigrateRequest,
    ) -> Result<(), ControllerError> {
        self.plugging("migrate")?;
        let vm = SourceVm {
            memory: Arc::clone(&self.memory),
            vcpus: self.moving_vcpus(),
        };
        let state = Box::new(LinuxRecord {
            machine: Arc::clone(&self.machine),
            paused: self.state == RunState::Paused,
        });
        self.migration.start(&request, vm, state, self.interrupt)
    }
}

impl Apply for LinuxController {
    fn apply(&mut self, request: Request) -> Outcome {
        if self.migration.settle() {
            // The destination may run the VM: it stays paused here until a client says.
            self.state = RunState::Paused;
        }
        self.chain.settle(&self.memory);
        if let Some(refused) = self
            .migration
            .refusal(&request)
            .or_else(|| self.chain.refusal(&request))
        {
            return Err(refused);
        }
        match LinuxRequest::try_from(request)? {
            LinuxRequest::GetMemory => Ok(Reply::Memory(memory_info(&self.memory))),
            LinuxRequest::GetRegion(id) => Ok(Reply::Region(region_info(&self.memory, id)?)),
            LinuxRequest::GetHotplug => Ok(Reply::Hotplug(hotplug_info(self.device()?))),
            LinuxRequest::RequestHotplug(request) => {
                let device = self.device()?;
                let bytes = request.requested_size_mib.checked_mul(MIB).ok_or_else(|| {
                    ControllerError::bad(format!(
                        "requested_size_mib {} is too large",
                        request.requested_size_mib
                    ))
                })?;
                // The guest plugs or unplugs on its own time; GET shows how far it got.
                lock(device)
                    .set_requested_size(bytes)
                    .map_err(ControllerError::bad)?;
                Ok(Reply::Done)
            }
            LinuxRequest::ConfigureHotplug(_) => Err(ControllerError::conflict(
                "a Linux guest's hotplug device is configured at boot (--hotplug-mib, --hotplug-block-mib)",
            )),
            LinuxRequest::Act(_) => {
                self.stop.store(true, Ordering::Release);
                Ok(Reply::Done)
            }
            LinuxRequest::GetVm => Ok(Reply::Vm(VmInfo {
                state: self.state,
                vcpus: self.vcpus.len(),
                failure: None,
            })),
            LinuxRequest::PatchVm(patch) => {
                match patch.state {
                    VmStateRequest::Paused if self.state == RunState::Paused => {}
                    VmStateRequest::Paused => self.pause()?,
                    VmStateRequest::Resumed => self.resume(),
                }
                Ok(Reply::Done)
            }
            LinuxRequest::CreateSnapshot(create) => {
                self.create_snapshot(create).map(|()| Reply::Done)
            }
            LinuxRequest::GetSnapshot => self.chain.live_info().map(Reply::Snapshot),
            LinuxRequest::CancelSnapshot => self.chain.cancel_live().map(|()| Reply::Done),
            LinuxRequest::StopRecording => match &self.loader {
                Some(loader) if loader.stop_recording() => Ok(Reply::Done),
                _ => Err(no_recording()),
            },
            LinuxRequest::SwitchDirtyLog(switch) => {
                self.dirty_log.switch(&self.memory, switch)?;
                Ok(Reply::Done)
            }
            LinuxRequest::Harvest(harvest) => Ok(Reply::Harvest(
                self.dirty_log.harvest(&self.memory, harvest)?,
            )),
            LinuxRequest::GetDirtyLog => Ok(Reply::DirtyLog(
                self.dirty_log.info(&self.memory, self.chain.consumer()),
            )),
            LinuxRequest::Migrate(request) => self.migrate(request).map(|()| Reply::Done),
            LinuxRequest::GetMigration => self.migration.get().map(Reply::Migration),
            LinuxRequest::CancelMigration => self.migration.cancel().map(|()| Reply::Done),
        }
    }
}
