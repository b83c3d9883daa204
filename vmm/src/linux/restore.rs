//! A Linux guest restored from a snapshot or received in a migration: memory from the saved
//! layout, then the VM's irqchip, PIT and clock, the devices as saved, and vCPUs that start
//! paused in their saved state. Nothing runs until a client resumes it.

use std::sync::Arc;

use kvm_memslots::MemoryLimits;
use kvm_memslots_persist::LazyOptions;

use super::state::{DeviceState, LinuxMachine, LinuxState};
use super::{hotplug, legacy_devices, BootError, LinuxVcpus, LinuxVm};
use crate::devices::legacy::{ConsoleOutput, LegacyDevices};
use crate::vm::restore::{restore_memory_with, MemBackend};
use crate::vm::vcpu::{Vcpu, VcpuShared};
use crate::vm::{Vm, VmOptions};

fn failed<E: std::fmt::Display>(what: &str) -> impl Fn(E) -> BootError + '_ {
    move |e| BootError::Restore(format!("{what}: {e}"))
}

impl LinuxVm {
    /// The guest `state` saved, with memory laid out as its layout from the snapshot's
    /// `memory_file` (loaded as `backend` says, with `lazy`'s working-set prefetch and
    /// recording), its console writing to `output`, within `limits`. Its vCPUs come from
    /// [`restored_vcpus`](Self::restored_vcpus).
    pub(crate) fn restore(
        state: &LinuxState,
        (memory_file, backend, lazy): (&std::fs::File, MemBackend, LazyOptions),
        output: ConsoleOutput,
        limits: Option<MemoryLimits>,
    ) -> Result<Self, BootError> {
        let vm = Vm::new(VmOptions {
            irqchip: true,
            limits,
            ..VmOptions::default()
        })?;
        let loader = restore_memory_with(vm.memory(), &state.layout, memory_file, backend, lazy)
            .map_err(failed("the guest's memory"))?
            .loader;
        Self::restore_on(vm, state, output, loader)
    }

    /// The guest `state` saved, on `vm`, which has the irqchip and holds the guest's memory
    /// as the state's layout lays it out (`loader`: its lazy loader, if any).
    pub(crate) fn restore_on(
        vm: Vm,
        state: &LinuxState,
        output: ConsoleOutput,
        loader: Option<kvm_memslots_persist::LazyLoader>,
    ) -> Result<Self, BootError> {
        state
            .vm
            .as_ref()
            .ok_or_else(|| BootError::Restore("no irqchip, PIT and clock saved".into()))?
            .restore(vm.fd())
            .map_err(failed("the irqchip, PIT and clock"))?;
        let mut serial = None;
        let mut hotplug = None;
        for device in &state.guest.devices {
            match device {
                DeviceState::Serial { state } => serial = Some(state),
                DeviceState::I8042 => {}
                DeviceState::VirtioMem {
                    addr,
                    device,
                    transport,
                } => {
                    let area = state.guest.machine.hotplug().ok_or_else(|| {
                        BootError::Restore("a virtio-mem device saved without hotplug_mib".into())
                    })?;
                    hotplug = Some(hotplug::restore(&vm, *addr, &area, device, transport)?);
                }
            }
        }
        let serial = serial.ok_or_else(|| BootError::Restore("no serial console saved".into()))?;
        let (devices, reset) = legacy_devices(&vm, output, Some(serial))?;
        let msrs: Vec<u32> = state.vcpus[0]
            .msrs
            .iter()
            .map(|&(index, _)| index)
            .collect();
        let machine = LinuxMachine {
            vm_fd: Arc::clone(vm.fd()),
            devices,
            bus: Arc::new(LegacyDevices::bus()),
            hotplug: hotplug.as_ref().map(|h| Arc::clone(&h.device)),
            machine: state.guest.machine.clone(),
            msrs: Arc::from(msrs),
            clock: Default::default(),
        };
        Ok(LinuxVm {
            vm,
            machine: Arc::new(machine),
            reset,
            hotplug_mmio: hotplug.map(|h| h.mmio),
            entry: None,
            loader: loader.map(Arc::new),
        })
    }

    /// The vCPUs of `state`, each given its saved state and made paused: they park before
    /// they first enter the guest, until a client resumes the VM.
    pub(crate) fn restored_vcpus(&self, state: &LinuxState) -> Result<LinuxVcpus, BootError> {
        let ports = self.ports();
        let mut vcpus = Vec::new();
        for (index, saved) in state.vcpus.iter().enumerate() {
            let fd = self.vm.create_vcpu(index)?;
            saved
                .restore(&fd)
                .map_err(failed(&format!("vCPU {index}")))?;
            vcpus.push(Vcpu {
                index,
                fd,
                memory: Arc::clone(self.memory()),
                shared: Arc::new(VcpuShared::starting_paused()),
                ports: ports.clone(),
            });
        }
        Ok(LinuxVcpus::new(vcpus, Arc::clone(&self.machine.msrs)))
    }
}
