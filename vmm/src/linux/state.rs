//! A Linux guest's part of its saved state ([`LinuxPart`]: every device, each with its own
//! state type, and the machine it was booted as) and its checks, in the one envelope every
//! guest kind's state file and State record are (`snapshot::state`, which frames, versions and
//! checks the rest: what snapshot it is, the memory layout, every vCPU, the VM's irqchip, PIT
//! and clock). The device list is checked against the machine: a state file whose devices are
//! not the ones its configuration has is refused, and a VM with a device that cannot be saved
//! refuses to snapshot, naming it (`LinuxMachine::save`).
//!
//! A restore needs no kernel: the kernel is in guest memory. The state names the kernel it
//! was booted from (path, size and CRC-32) for the record only.

use std::path::Path;
use std::sync::Arc;

use kvm_ioctls::VmFd;
use kvm_memslots_persist::MemoryLayout;
use kvm_virtio_mem::{TransportState, VirtioMemState};
use serde::{Deserialize, Serialize};

use super::config::{BootConfig, MAX_VCPUS};
use super::hotplug::{self, VirtioMemDevice};
use crate::control::hotplug::HotplugConfig;
use crate::control::memory::RegionPageSize;
use crate::devices::legacy::{LegacyDevice, LegacyDevices, SerialSnapshot};
use crate::migration::StateRecord;
use crate::snapshot::state::{GuestKind, GuestPart, SavedState};
use crate::snapshot::{SnapshotInfo, StateFileError};
use crate::vm::ports::PortBus;
use crate::vm::state::{StateError, VcpuState, VmState};

/// The machine a Linux guest was booted as: what a restore rebuilds besides memory.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Machine {
    /// vCPUs.
    pub vcpus: u8,
    /// Whether the guest has ACPI tables (in its memory).
    pub acpi: bool,
    /// MiB of hotpluggable memory behind the virtio-mem device (0: none).
    pub hotplug_mib: u64,
    /// The device's block size in MiB.
    pub hotplug_block_mib: u64,
    /// The host pages behind its plugged blocks (4 KiB in states saved before it was
    /// recorded), which the pieces a restored device plugs get.
    #[serde(default, skip_serializing_if = "RegionPageSize::is_base")]
    pub hotplug_page_size: RegionPageSize,
    /// The kernel it was booted from, for the record (a restore does not load it).
    pub kernel: KernelRecord,
    /// The command line it was booted with.
    pub cmdline: String,
}

/// The kernel a guest was booted from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KernelRecord {
    /// Its path when booted.
    pub path: std::path::PathBuf,
    /// Its size in bytes.
    pub size: u64,
    /// The CRC-32 of its bytes.
    pub crc32: u32,
}

impl KernelRecord {
    /// The record of the kernel at `path`.
    pub(super) fn of(path: &Path) -> std::io::Result<Self> {
        let bytes = std::fs::read(path)?;
        Ok(KernelRecord {
            path: path.to_path_buf(),
            size: bytes.len() as u64,
            crc32: crc32fast::hash(&bytes),
        })
    }
}

impl Machine {
    /// The machine `config` boots, booted from `kernel`.
    pub(super) fn of(config: &BootConfig, kernel: KernelRecord) -> Self {
        Machine {
            vcpus: config.vcpus,
            acpi: config.acpi,
            hotplug_mib: config.hotplug_mib,
            hotplug_block_mib: config.hotplug_block_mib,
            hotplug_page_size: config.hotplug_page_size,
            kernel,
            cmdline: config.cmdline.clone(),
        }
    }

    /// The virtio-mem device's area, if the machine has one, without a slot size: the
    /// device's saved state records its own.
    pub(crate) fn hotplug(&self) -> Option<HotplugConfig> {
        (self.hotplug_mib > 0).then_some(HotplugConfig {
            total_size_mib: self.hotplug_mib,
            block_size_mib: self.hotplug_block_mib,
            slot_size_mib: None,
            page_size: self.hotplug_page_size,
        })
    }

    /// The devices this machine has, in the order a state lists them.
    fn devices(&self) -> Vec<DeviceName> {
        let mut names = vec![DeviceName::Serial, DeviceName::I8042];
        if self.hotplug_mib > 0 {
            names.push(DeviceName::VirtioMem);
        }
        names
    }
}

/// A device of a Linux guest, by kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum DeviceName {
    /// The 16550 serial console.
    Serial,
    /// The i8042.
    I8042,
    /// The virtio-mem device on virtio-mmio.
    VirtioMem,
}

impl std::fmt::Display for DeviceName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            DeviceName::Serial => "serial (ports 0x3f8-0x3ff)",
            DeviceName::I8042 => "i8042 (ports 0x60-0x64)",
            DeviceName::VirtioMem => "virtio-mem (virtio-mmio at 0xd0000000)",
        })
    }
}

/// One device's saved state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub(crate) enum DeviceState {
    /// The serial console's registers and input FIFO.
    Serial {
        /// vm-superio's state.
        state: SerialSnapshot,
    },
    /// The i8042: no state beyond being there.
    I8042,
    /// The virtio-mem device and its transport.
    VirtioMem {
        /// The device's guest address.
        addr: u64,
        /// The device's sizes and plugged blocks.
        device: VirtioMemState,
        /// The transport's registers and queue.
        transport: TransportState,
    },
}

impl DeviceState {
    /// Its device.
    fn name(&self) -> DeviceName {
        match self {
            DeviceState::Serial { .. } => DeviceName::Serial,
            DeviceState::I8042 => DeviceName::I8042,
            DeviceState::VirtioMem { .. } => DeviceName::VirtioMem,
        }
    }
}

/// A Linux guest's saved state: the one envelope with a Linux guest's part.
pub type LinuxState = SavedState<LinuxPart>;

/// What a Linux guest saves besides what every kind does: its devices and its machine.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LinuxPart {
    /// Every device, in the machine's order ([`Machine::devices`]).
    pub(crate) devices: Vec<DeviceState>,
    /// The machine booted.
    pub(crate) machine: Machine,
}

/// Why a Linux state could not be read or taken.
#[derive(Debug, thiserror::Error)]
pub(crate) enum LinuxStateError {
    /// The file or record is not a valid Linux state.
    #[error(transparent)]
    File(#[from] StateFileError),
    /// KVM refused to read a part of the state.
    #[error(transparent)]
    Kvm(#[from] StateError),
    /// A device cannot be saved.
    #[error("the VM cannot be saved: its device {0} has no saved state")]
    NotSaveable(String),
}

impl GuestPart for LinuxPart {
    const KIND: GuestKind = GuestKind::Linux;

    /// Its vCPUs against its machine's, its VM state there, and its devices against its
    /// machine's.
    fn validate(state: &LinuxState) -> Result<(), String> {
        let machine = &state.guest.machine;
        let vcpus = usize::from(machine.vcpus);
        if vcpus == 0 || vcpus > usize::from(MAX_VCPUS) || state.vcpus.len() != vcpus {
            return Err(format!(
                "{} vCPUs saved for a machine of {} (1 to {MAX_VCPUS})",
                state.vcpus.len(),
                machine.vcpus
            ));
        }
        if state.vm.is_none() {
            return Err("it has no `vm`: a Linux guest's irqchip, PIT and clock".into());
        }
        let saved: Vec<DeviceName> = state.guest.devices.iter().map(DeviceState::name).collect();
        let wanted = machine.devices();
        if saved != wanted {
            let list = |names: &[DeviceName]| {
                names
                    .iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
                    .join(", ")
            };
            return Err(format!(
                "its devices ({}) do not match its machine's ({})",
                list(&saved),
                list(&wanted)
            ));
        }
        Ok(())
    }
}

/// What a Linux guest's state is saved from besides its vCPUs and memory: the VM, its
/// devices and the machine it was booted as. Shared by the guest and its controller.
#[derive(Debug)]
pub struct LinuxMachine {
    /// KVM's VM (the irqchip, PIT and clock).
    pub vm_fd: Arc<VmFd>,
    /// The serial console and the i8042.
    pub devices: Arc<LegacyDevices>,
    /// Their port bus: every device on it must save.
    pub bus: Arc<PortBus<LegacyDevice>>,
    /// The virtio-mem device, if any.
    pub hotplug: Option<VirtioMemDevice>,
    /// The machine booted.
    pub machine: Machine,
    /// The MSRs each vCPU saves.
    pub msrs: Arc<[u32]>,
    /// The VM clock, held while a client has the VM paused.
    pub clock: crate::vm::state::FrozenClock,
}

impl LinuxMachine {
    /// The devices' states, in the machine's order, one for each device on the port bus and
    /// each virtio-mmio device; a device that has no saved state refuses the save by name.
    fn save_devices(&self) -> Result<Vec<DeviceState>, LinuxStateError> {
        let mut states = Vec::new();
        for range in self.bus.ranges() {
            states.push(match range.device {
                LegacyDevice::Serial => DeviceState::Serial {
                    state: self.devices.serial_state(),
                },
                LegacyDevice::I8042 => DeviceState::I8042,
            });
        }
        if let Some(device) = &self.hotplug {
            let transport = hotplug::lock(device);
            states.push(DeviceState::VirtioMem {
                addr: transport.device().region().start,
                device: transport.device().state(),
                transport: transport.state(),
            });
        }
        // In the machine's order (the bus lists devices by port); a device the machine does not
        // have, or one of its own that did not save, refuses the save by name.
        let mut ordered = Vec::with_capacity(states.len());
        for name in self.machine.devices() {
            let at = states
                .iter()
                .position(|s| s.name() == name)
                .ok_or_else(|| LinuxStateError::NotSaveable(name.to_string()))?;
            ordered.push(states.swap_remove(at));
        }
        if let Some(extra) = states.first() {
            return Err(LinuxStateError::NotSaveable(format!(
                "{} (not in the machine booted)",
                extra.name()
            )));
        }
        let states = ordered;
        Ok(states)
    }

    /// The state of the paused VM: `vcpus` (read by their threads), `layout`, the VM's and the
    /// devices' state now.
    pub(crate) fn save(
        &self,
        snapshot: Option<SnapshotInfo>,
        layout: &MemoryLayout,
        vcpus: Vec<VcpuState>,
        paused: bool,
    ) -> Result<LinuxState, LinuxStateError> {
        let part = LinuxPart {
            devices: self.save_devices()?,
            machine: self.machine.clone(),
        };
        let vm = VmState::save(&self.vm_fd, &self.clock)?;
        let mut state = LinuxState::new(layout.clone(), vcpus, Some(vm), paused, part);
        state.snapshot = snapshot;
        Ok(state)
    }
}

/// A Linux guest's migration State record: the machine's state, taken once the vCPUs are
/// paused.
#[derive(Debug)]
pub(super) struct LinuxRecord {
    /// What the state is taken from.
    pub(crate) machine: Arc<LinuxMachine>,
    /// Whether a client had paused the VM.
    pub(crate) paused: bool,
}

impl StateRecord for LinuxRecord {
    fn to_bytes(&self, layout: &MemoryLayout, states: Vec<VcpuState>) -> Result<Vec<u8>, String> {
        self.machine
            .save(None, layout, states, self.paused)
            .map(|s| s.to_bytes())
            .map_err(|e| e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::legacy::SerialSnapshot;
    use crate::snapshot::state::{test_data, STATE_MAGIC, STATE_VERSION};
    use kvm_memslots::testing::FakeKvm;
    use kvm_memslots::{MemoryManager, RegionSpec};
    use kvm_memslots_persist::frame;
    use serde_json::Value;
    use vm_memory::GuestAddress;

    fn serial() -> SerialSnapshot {
        SerialSnapshot {
            baud_divisor_low: 12,
            baud_divisor_high: 0,
            interrupt_enable: 0,
            interrupt_identification: 1,
            line_control: 3,
            line_status: 0x60,
            modem_control: 8,
            modem_status: 0xb0,
            scratch: 0,
            in_buffer: Vec::new(),
        }
    }

    fn vcpu() -> VcpuState {
        VcpuState {
            regs: Default::default(),
            sregs: Default::default(),
            xsave: Default::default(),
            xcrs: Default::default(),
            events: Default::default(),
            msrs: vec![(0x10, 1)],
            lapic: Some(Default::default()),
            debugregs: Some(Default::default()),
            mp_state: Some(Default::default()),
            cpuid: Vec::new(),
        }
    }

    /// A one-vCPU machine without virtio-mem, its state as JSON to tamper with.
    fn state() -> Value {
        let memory = MemoryManager::new(FakeKvm::new(16, false));
        memory
            .add_region(RegionSpec::new(GuestAddress(0), 2 << 20))
            .expect("RAM");
        let vm = VmState {
            pic_master: Default::default(),
            pic_slave: kvm_bindings::kvm_irqchip {
                chip_id: 1,
                ..Default::default()
            },
            ioapic: kvm_bindings::kvm_irqchip {
                chip_id: 2,
                ..Default::default()
            },
            pit: Default::default(),
            clock: Default::default(),
        };
        let part = LinuxPart {
            devices: vec![DeviceState::Serial { state: serial() }, DeviceState::I8042],
            machine: Machine {
                vcpus: 1,
                acpi: true,
                hotplug_mib: 0,
                hotplug_block_mib: 2,
                hotplug_page_size: Default::default(),
                kernel: KernelRecord {
                    path: "vmlinux".into(),
                    size: 1,
                    crc32: 2,
                },
                cmdline: "console=ttyS0".into(),
            },
        };
        let state = LinuxState::new(
            MemoryLayout::of(&memory),
            vec![vcpu()],
            Some(vm),
            false,
            part,
        );
        serde_json::to_value(&state).expect("JSON")
    }

    fn framed(json: &Value, version: u32) -> Vec<u8> {
        frame(
            STATE_MAGIC,
            version,
            &serde_json::to_vec(json).expect("bytes"),
        )
    }

    fn refused(json: &Value) -> String {
        LinuxState::from_bytes(&framed(json, STATE_VERSION))
            .expect_err("refused")
            .to_string()
    }

    #[test]
    fn a_linux_state_round_trips_and_is_checked_against_its_machine() {
        let json = state();
        let back = LinuxState::from_bytes(&framed(&json, STATE_VERSION)).expect("valid");
        assert_eq!(
            back.guest.devices[0],
            DeviceState::Serial { state: serial() }
        );
        assert_eq!(back.vm.as_ref().map(|vm| vm.ioapic.chip_id), Some(2));

        // A device list that is not the machine's: one missing, one extra, out of order.
        let mut missing = json.clone();
        missing["guest"]["devices"]
            .as_array_mut()
            .expect("a list")
            .pop();
        let why = refused(&missing);
        assert!(
            why.contains(
                "its devices (serial (ports 0x3f8-0x3ff)) do not match its machine's \
                          (serial (ports 0x3f8-0x3ff), i8042 (ports 0x60-0x64))"
            ),
            "{why}"
        );
        let mut with_hotplug = json.clone();
        with_hotplug["guest"]["machine"]["hotplug_mib"] = 1024.into();
        let why = refused(&with_hotplug);
        assert!(
            why.contains("virtio-mem (virtio-mmio at 0xd0000000)"),
            "{why}"
        );
        let mut swapped = json.clone();
        swapped["guest"]["devices"]
            .as_array_mut()
            .expect("a list")
            .reverse();
        assert!(refused(&swapped).contains("do not match"));
        let mut unknown = json.clone();
        unknown["guest"]["devices"][1] = serde_json::json!({"kind": "rtc"});
        assert!(refused(&unknown).contains("unknown variant `rtc`"));

        // vCPUs that are not the machine's.
        let mut two = json.clone();
        two["guest"]["machine"]["vcpus"] = 2.into();
        assert!(refused(&two).contains("1 vCPUs saved for a machine of 2"));

        // A register block of another size, with a valid checksum.
        let mut short = json.clone();
        short["vcpus"][0]["debugregs"]
            .as_array_mut()
            .expect("bytes")
            .pop();
        assert!(refused(&short).contains("vCPU 0's debugregs has"));

        // No VM state (irqchip, PIT and clock).
        let mut no_vm = json.clone();
        no_vm.as_object_mut().expect("an object").remove("vm");
        assert!(refused(&no_vm).contains("it has no `vm`"));

        // A state from a newer build (its header says version 5).
        let newer = LinuxState::from_bytes(&framed(&json, STATE_VERSION + 1))
            .expect_err("refused")
            .to_string();
        assert!(newer.contains("version"), "{newer}");
        // Or one whose header and body disagree.
        let mut body = json.clone();
        body["version"] = (STATE_VERSION + 1).into();
        assert!(refused(&body).contains("the header's version is 4, the state's 5"));
        // A test guest's state is not a Linux one.
        let mut test_guest = json.clone();
        test_guest["kind"] = "test_guest".into();
        let why = refused(&test_guest);
        assert!(
            why.contains("it is a test guest's state, not a Linux guest's"),
            "{why}"
        );
    }

    /// A state file and a State record as the builds before the one envelope wrote them (a
    /// Linux guest's own format, `TVMLINUX` version 1, made by those builds' code) read as
    /// this format's, every field where it was; written again, they are this format.
    #[test]
    fn a_linux_state_of_the_format_before_reads_into_the_envelope() {
        let made = state();
        let wanted = |json: Value, snapshot: bool, paused: bool| {
            let mut json = json;
            json["paused"] = paused.into();
            let state: LinuxState = serde_json::from_value(json).expect("the state");
            (
                snapshot,
                serde_json::to_value(&state.guest).expect("JSON"),
                state.layout.regions.len(),
            )
        };
        for (name, snapshot, paused) in [
            ("linux-v1.state", true, false),
            ("linux-v1.record", false, true),
        ] {
            let bytes = test_data(name);
            assert!(bytes.starts_with(b"TVMLINUX"), "{name}");
            assert_eq!(
                GuestKind::of_bytes(&bytes).expect("a kind"),
                GuestKind::Linux
            );
            let state = LinuxState::from_bytes(&bytes).unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(
                (state.version, state.kind),
                (STATE_VERSION, GuestKind::Linux)
            );
            assert_eq!(state.paused, paused, "{name}");
            assert_eq!(
                (
                    state.snapshot.is_some(),
                    serde_json::to_value(&state.guest).expect("JSON"),
                    state.layout.regions.len()
                ),
                wanted(made.clone(), snapshot, paused),
                "{name}"
            );
            assert_eq!(state.vm.as_ref().map(|vm| vm.pic_slave.chip_id), Some(1));
            assert_eq!(state.vcpus.len(), 1);
            let again = state.to_bytes();
            assert!(again.starts_with(STATE_MAGIC));
            let back = LinuxState::from_bytes(&again).expect("this format");
            assert_eq!(back.snapshot, state.snapshot);
            assert_eq!(back.guest, state.guest);
        }
        // An older state whose header and body disagree.
        let bytes = test_data("linux-v1.state");
        let json = kvm_memslots_persist::unframe(b"TVMLINUX", 1, &bytes).expect("a frame");
        let mut json: Value = serde_json::from_slice(json).expect("JSON");
        json["version"] = 2.into();
        let body = frame(b"TVMLINUX", 1, &serde_json::to_vec(&json).expect("bytes"));
        let why = LinuxState::from_bytes(&body)
            .expect_err("refused")
            .to_string();
        assert!(
            why.contains("the header's version is 1, the state's 2"),
            "{why}"
        );
    }
}
