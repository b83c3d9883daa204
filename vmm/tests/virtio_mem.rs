//! A Linux guest's virtio-mem device as tinyvmm wires it, on /dev/kvm: the spec-written driver
//! model (kvm-virtio-mem's tests) reaches the device only through the vCPU exit path — the exit
//! handler's MMIO routing and the Linux guest kind's MMIO entry points — and the API's
//! `/hotplug/memory` sets the size it plugs to. No Linux here (this host cannot run a kernel
//! past its console; see boot.rs for the boot tests): the driver model stands in for its
//! `virtio_mem` driver.

#[path = "../../crates/kvm-virtio-mem/tests/support/driver.rs"]
#[allow(
    missing_docs,
    missing_debug_implementations,
    clippy::unwrap_used,
    clippy::undocumented_unsafe_blocks
)]
mod driver;

mod support;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use driver::{
    Driver, Layout, Registers, CFG_ADDR, CFG_PLUGGED_SIZE, CFG_REQUESTED_SIZE, INT_CONFIG,
    RESP_ACK, RESP_NACK, STATE_PLUGGED, STATE_UNPLUGGED,
};
use kvm_memslots::{KvmVm, MemoryManager, RegionSpec};
use tinyvmm::control::hotplug::{HotplugConfig, HotplugInfo, HotplugRequest};
use tinyvmm::control::memory::{RegionInfo, RegionPageSize};
use tinyvmm::control::{Apply, ControllerError, ErrorKind, Reply, Request};
use tinyvmm::devices::legacy::LegacyDevices;
use tinyvmm::linux::controller::LinuxController;
use tinyvmm::linux::hotplug::{self, VIRTIO_MEM_MMIO};
use tinyvmm::linux::ports::LinuxPorts;
use tinyvmm::linux::state::{KernelRecord, LinuxMachine, Machine};
use tinyvmm::vm::exit::{handle_exit, Exit, ExitAction, ExitContext};
use tinyvmm::vm::vcpu::VcpuPorts;
use tinyvmm::vm::{Vm, VmOptions};
use vm_memory::{Bytes, GuestAddress, GuestAddressSpace};
use vmm_sys_util::eventfd::EventFd;

const MIB: u64 = 1 << 20;

/// A hotplug area of `total_size_mib` in blocks of `block_size_mib`, plugged blocks sharing
/// slots of up to `slot_size_mib` (a slot per block without), in host pages of `page_size`.
fn area(
    total_size_mib: u64,
    block_size_mib: u64,
    slot_size_mib: Option<u64>,
    page_size: RegionPageSize,
) -> HotplugConfig {
    HotplugConfig {
        total_size_mib,
        block_size_mib,
        slot_size_mib,
        page_size,
    }
}

/// The device as a vCPU reaches it: an MMIO exit at the window's address, decided by the exit
/// handler against the memory map and the guest kind's MMIO bus, then handed to the guest
/// kind's ports.
struct ExitPath {
    ports: LinuxPorts,
    memory: Arc<MemoryManager<KvmVm>>,
}

impl ExitPath {
    /// What the exit handler decides for an access at `gpa`.
    fn decide(&self, gpa: u64, read_len: Option<usize>, write: &[u8]) -> ExitAction<()> {
        let map = self.memory.load();
        let sequence = self.memory.change_sequence();
        let exit = match read_len {
            Some(len) => Exit::MmioRead { gpa, len },
            None => Exit::MmioWrite { gpa, data: write },
        };
        let bus = tinyvmm::vm::ports::PortBus::new(tinyvmm::vm::ports::Unmapped::Absent);
        let ctx = ExitContext {
            memory: &map,
            sequence_at_entry: sequence,
            sequence_now: sequence,
            expected_mmio: None,
            ports: &bus,
            mmio: self.ports.mmio(),
        };
        handle_exit(&exit, &ctx)
    }
}

impl Registers for ExitPath {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        match self.decide(VIRTIO_MEM_MMIO + offset, Some(data.len()), &[]) {
            ExitAction::MmioRead { device, offset } => {
                self.ports
                    .mmio_read(device, offset, data)
                    .expect("the device answers");
            }
            other => panic!("a read of the device window became {other:?}"),
        }
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        match self.decide(VIRTIO_MEM_MMIO + offset, None, data) {
            ExitAction::MmioWrite { device, offset } => {
                self.ports
                    .mmio_write(device, offset, data)
                    .expect("the device takes it");
            }
            other => panic!("a write to the device window became {other:?}"),
        }
    }
}

/// The guest's driver of `hotplug`'s device, through a Linux guest's exit path over `memory`
/// with legacy devices that go nowhere, initialised; and the device's area's guest address.
fn driver_of(
    hotplug: &hotplug::Hotplug,
    memory: &Arc<MemoryManager<KvmVm>>,
) -> (Driver<KvmVm, ExitPath>, u64) {
    let ports = LinuxPorts {
        devices: Arc::new(LegacyDevices::new(
            Box::new(std::io::sink()),
            EventFd::new(0).expect("eventfd"),
            EventFd::new(0).expect("eventfd"),
        )),
        bus: Arc::new(LegacyDevices::bus()),
        hotplug: Some((Arc::clone(&hotplug.device), Arc::clone(&hotplug.mmio))),
    };
    let path = ExitPath {
        ports,
        memory: Arc::clone(memory),
    };
    let layout = Layout {
        base: 16 * MIB,
        size: 128,
    };
    let mut guest = Driver::new(path, Arc::clone(memory), layout);
    guest.init();
    let base = guest.config64(CFG_ADDR);
    (guest, base)
}

fn patch(controller: &mut LinuxController, mib: u64) -> Result<Reply, ControllerError> {
    controller.apply(Request::RequestHotplug(HotplugRequest {
        requested_size_mib: mib,
    }))
}

fn info(controller: &mut LinuxController) -> HotplugInfo {
    match controller.apply(Request::GetHotplug) {
        Ok(Reply::Hotplug(info)) => info,
        other => panic!("GET /hotplug/memory: {other:?}"),
    }
}

fn regions(controller: &mut LinuxController) -> Vec<RegionInfo> {
    match controller.apply(Request::GetMemory) {
        Ok(Reply::Memory(memory)) => memory.regions,
        other => panic!("GET /memory: {other:?}"),
    }
}

/// A VM with an in-kernel irqchip (virtio-mem's interrupt) and 256 MiB of RAM at 0.
fn vm_with_ram() -> Vm {
    let vm = Vm::new(VmOptions {
        irqchip: true,
        ..VmOptions::default()
    })
    .expect("a VM");
    vm.memory()
        .add_region(RegionSpec::new(GuestAddress(0), 256 * MIB))
        .expect("RAM");
    vm
}

/// [`vm_with_ram`] and its memory, or `None` without KVM (`test` then skips, loudly).
fn kvm_vm_with_ram(test: &str) -> Option<(Vm, Arc<MemoryManager<KvmVm>>)> {
    if !kvm_test_support::require_kvm(test) {
        return None;
    }
    let vm = vm_with_ram();
    let memory = Arc::clone(vm.memory());
    Some((vm, memory))
}

#[test]
fn kvm_the_api_sizes_virtio_mem_and_the_guest_plugs_through_mmio_exits() {
    let Some((vm, memory)) = kvm_vm_with_ram(
        "tinyvmm::kvm_the_api_sizes_virtio_mem_and_the_guest_plugs_through_mmio_exits",
    ) else {
        return;
    };
    // 1 GiB in 2 MiB blocks, above RAM at 4 GiB, a slot per block.
    let hotplug =
        hotplug::setup(&vm, &area(1024, 2, None, Default::default())).expect("the device");
    assert!(
        hotplug
            .cmdline(false)
            .contains(&format!("virtio_mmio.device=512@{VIRTIO_MEM_MMIO:#x}:5")),
        "{}",
        hotplug.cmdline(false)
    );
    let devices = Arc::new(LegacyDevices::new(
        Box::new(std::io::sink()),
        EventFd::new(0).expect("eventfd"),
        EventFd::new(0).expect("eventfd"),
    ));
    let machine = Arc::new(LinuxMachine {
        vm_fd: Arc::clone(vm.fd()),
        devices: Arc::clone(&devices),
        bus: Arc::new(LegacyDevices::bus()),
        hotplug: Some(Arc::clone(&hotplug.device)),
        machine: Machine {
            vcpus: 1,
            acpi: false,
            hotplug_mib: 1024,
            hotplug_block_mib: 2,
            hotplug_page_size: Default::default(),
            kernel: KernelRecord {
                path: "none".into(),
                size: 0,
                crc32: 0,
            },
            cmdline: String::new(),
        },
        msrs: Arc::from(Vec::new()),
        clock: Default::default(),
    });
    let ports = LinuxPorts {
        devices,
        bus: Arc::new(LegacyDevices::bus()),
        hotplug: Some((Arc::clone(&hotplug.device), Arc::clone(&hotplug.mmio))),
    };
    let path = ExitPath {
        ports,
        memory: Arc::clone(&memory),
    };
    let mut guest = Driver::new(
        path,
        Arc::clone(&memory),
        Layout {
            base: 16 * MIB,
            size: 128,
        },
    );
    guest.init();
    let base = guest.config64(CFG_ADDR);
    assert_eq!(base, 4 << 30, "the area starts at 4 GiB");
    let mut api = LinuxController::new(
        Arc::clone(&memory),
        machine,
        Vec::new(),
        false,
        Arc::new(AtomicBool::new(false)),
    );

    // The API asks for 64 MiB: the guest hears of it (config change) and plugs it.
    assert!(matches!(patch(&mut api, 64), Ok(Reply::Done)));
    assert_ne!(
        guest.take_interrupt() & INT_CONFIG,
        0,
        "a config-change interrupt"
    );
    assert_eq!(guest.config64(CFG_REQUESTED_SIZE), 64 * MIB);
    assert_eq!(
        info(&mut api).plugged_size_mib,
        0,
        "nothing plugged before the guest acts"
    );
    assert_eq!(guest.plug(base, 16), RESP_ACK);
    assert_eq!(guest.plug(base + 32 * MIB, 16), RESP_ACK);
    assert_eq!(
        guest.plug(base + 64 * MIB, 1),
        RESP_NACK,
        "past the requested size"
    );
    let plugged = info(&mut api);
    assert_eq!(
        (
            plugged.plugged_size_mib,
            plugged.requested_size_mib,
            plugged.mapped_slots
        ),
        (64, 64, 32),
        "{plugged:?}"
    );
    assert_eq!(guest.config64(CFG_PLUGGED_SIZE), 64 * MIB);
    // Each plugged block is a region of one KVM slot; the rest of the area has none.
    let now = regions(&mut api);
    let in_area: Vec<&RegionInfo> = now.iter().filter(|r| r.guest_address >= base).collect();
    assert_eq!(in_area.len(), 32);
    assert!(in_area.iter().all(|r| r.size == 2 * MIB && r.slots == 1));
    // Plugged memory is memory; an unplugged block is absent memory: the guest goes on.
    let snapshot = memory.handle().memory();
    snapshot
        .write_obj(0x1234_5678u64, GuestAddress(base + 63 * MIB))
        .expect("plugged memory is writable");
    assert_eq!(
        snapshot
            .read_obj::<u64>(GuestAddress(base + 63 * MIB))
            .expect("and readable"),
        0x1234_5678
    );
    drop(snapshot);
    assert_eq!(
        guest.device.decide(base + 64 * MIB, Some(8), &[]),
        ExitAction::AbsentMemory
    );
    assert_eq!(
        guest.device.decide(base + 1023 * MIB, None, &[1; 8]),
        ExitAction::AbsentMemory
    );
    assert_eq!(guest.state(base, 32), (RESP_ACK, STATE_PLUGGED));

    // Bad sizes are refused with what is wrong, and change nothing.
    for (mib, says) in [(3, "multiple"), (2048, "region")] {
        let error = patch(&mut api, mib).expect_err("refused");
        assert_eq!(error.kind, ErrorKind::BadRequest, "{error:?}");
        assert!(error.message.contains(says), "{mib}: {}", error.message);
    }
    assert_eq!(info(&mut api).requested_size_mib, 64);
    let configure = api.apply(Request::ConfigureHotplug(HotplugConfig {
        total_size_mib: 128,
        block_size_mib: 2,
        slot_size_mib: None,
        page_size: Default::default(),
    }));
    assert_eq!(
        configure.expect_err("configured at boot").kind,
        ErrorKind::Conflict
    );
    let test_guest_only = api.apply(Request::RemoveRegion(1)).expect_err("not here");
    assert!(
        test_guest_only
            .message
            .contains("DELETE /memory/regions/{id}"),
        "{}",
        test_guest_only.message
    );

    // Down to nothing: the guest unplugs, and the slots go.
    assert!(matches!(patch(&mut api, 0), Ok(Reply::Done)));
    assert_ne!(guest.take_interrupt() & INT_CONFIG, 0);
    assert_eq!(guest.unplug(base, 16), RESP_ACK);
    assert_eq!(guest.unplug_all(), RESP_ACK);
    assert_eq!(guest.state(base, 32), (RESP_ACK, STATE_UNPLUGGED));
    let unplugged = info(&mut api);
    assert_eq!((unplugged.plugged_size_mib, unplugged.mapped_slots), (0, 0));
    assert_eq!(regions(&mut api).len(), 1, "only RAM is left");
    assert_eq!(
        guest.device.decide(base, Some(8), &[]),
        ExitAction::AbsentMemory
    );
}

#[test]
fn kvm_a_hotplug_area_needing_more_slots_than_are_free_is_refused() {
    if !kvm_test_support::require_kvm(
        "tinyvmm::kvm_a_hotplug_area_needing_more_slots_than_are_free_is_refused",
    ) {
        return;
    }
    let vm = Vm::new(VmOptions::default()).expect("a VM");
    vm.memory()
        .add_region(RegionSpec::new(GuestAddress(0), 256 * MIB))
        .expect("RAM");
    // 64 GiB in 2 MiB blocks, a slot per block: 32768 slots, more than KVM has.
    let error =
        hotplug::setup(&vm, &area(65536, 2, None, Default::default())).expect_err("refused");
    let message = error.to_string();
    assert!(message.contains("32768"), "{message}");
    assert_eq!(vm.memory().regions().len(), 1, "nothing was added");
}

/// The test guest's `op` over the 2 MiB block at `start`, a 4 KiB page at a time, with the
/// pattern `seed`.
fn block(op: tinyvmm::test_guest::Op, start: u64, seed: u64) -> tinyvmm::test_guest::Command {
    tinyvmm::test_guest::Command {
        op,
        start,
        end: start + 2 * MIB,
        stride: 4096,
        seed,
    }
}

/// Checks the 2 MiB block at `start`, written with `seed` while `what` (absent memory): the
/// guest's reads see all ones, not what it wrote.
fn assert_reads_ones(
    vcpus: &mut tinyvmm::test_guest::vcpus::Vcpus,
    start: u64,
    seed: u64,
    what: &str,
) {
    use tinyvmm::test_guest::vcpus::GuestError;

    match vcpus.run(0, block(tinyvmm::test_guest::Op::Verify, start, seed)) {
        Err(GuestError::GuestSawWrongData { found, .. }) => assert_eq!(found, u64::MAX),
        other => panic!("reading {what}: {other:?}"),
    }
}

#[test]
fn kvm_a_guest_touching_unplugged_memory_is_counted_and_goes_on() {
    if !kvm_test_support::require_kvm(
        "tinyvmm::kvm_a_guest_touching_unplugged_memory_is_counted_and_goes_on",
    ) {
        return;
    }
    use tinyvmm::test_guest::vcpus::TestVm;
    use tinyvmm::test_guest::Op;
    use tinyvmm::vm::mmio::MmioBus;

    // 2 MiB of absent memory at 4 GiB (an unplugged block), and 2 MiB of RAM beside it.
    let mut absent = MmioBus::new();
    absent
        .insert_absent(4 << 30, 2 * MIB)
        .expect("an empty bus takes it");
    let vm = TestVm::new().expect("a VM").with_mmio(absent);
    vm.memory()
        .add_region(RegionSpec::new(GuestAddress((4 << 30) + 2 * MIB), 2 * MIB))
        .expect("RAM");
    let stopped = Arc::new(EventFd::new(0).expect("eventfd"));
    let mut vcpus = vm.start_vcpus(1, &stopped).expect("vCPUs");
    // A real vCPU's 512 writes into absent memory: each an MMIO exit, dropped, the guest on.
    vcpus
        .run(0, block(Op::Write, 4 << 30, 1))
        .expect("the guest goes on");
    let counted = vcpus
        .shared(0)
        .counters
        .absent_memory
        .load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!(counted, 512);
    // Its reads see all ones, not what it wrote.
    assert_reads_ones(&mut vcpus, 4 << 30, 1, "absent memory");
    // And the VM is as good as before: memory beside it works both ways.
    vcpus
        .run(0, block(Op::Write, (4 << 30) + 2 * MIB, 2))
        .expect("write");
    vcpus
        .run(0, block(Op::Verify, (4 << 30) + 2 * MIB, 2))
        .expect("verify");
    vcpus.shut_down().expect("clean stop");
}

/// A Linux guest's plugged blocks share KVM slots by default (pieces of 128 MiB, a slot per run
/// of plugged blocks in each), through the same exit path, and the device's saved state
/// restores over the memory a restore rebuilds, with the maximum slot size it was saved with.
#[test]
fn kvm_a_linux_guests_plugged_blocks_share_slots_and_restore() {
    use tinyvmm::linux::config::DEFAULT_HOTPLUG_MAX_SLOT_MIB;
    let Some((vm, memory)) =
        kvm_vm_with_ram("tinyvmm::kvm_a_linux_guests_plugged_blocks_share_slots_and_restore")
    else {
        return;
    };
    let hotplug = hotplug::setup(
        &vm,
        &area(
            1024,
            2,
            Some(DEFAULT_HOTPLUG_MAX_SLOT_MIB),
            Default::default(),
        ),
    )
    .expect("the device");
    let (mut guest, base) = driver_of(&hotplug, &memory);
    hotplug
        .device
        .lock()
        .expect("the device")
        .set_requested_size(512 * MIB)
        .expect("512 MiB");
    // Two whole 128 MiB memory blocks as Linux's driver plugs them (64 blocks a request), then
    // 16 MiB past a 16 MiB hole, then one block unplugged inside the first memory block.
    for at in (0..256).step_by(128) {
        assert_eq!(guest.plug(base + at * MIB, 64), RESP_ACK);
    }
    assert_eq!(guest.plug(base + 272 * MIB, 8), RESP_ACK);
    assert_eq!(guest.unplug(base + 64 * MIB, 1), RESP_ACK);
    let info = hotplug::hotplug_info(&hotplug.device);
    assert_eq!(
        (info.slot_size_mib, info.plugged_size_mib, info.mapped_slots),
        (128, 270, 3),
        "{info:?}"
    );
    assert_eq!(
        memory.slot_usage().used,
        1 + 3,
        "RAM's slot and a piece's each"
    );
    let pieces: Vec<(u64, u64, usize)> = memory
        .regions()
        .iter()
        .filter(|r| r.gpa.0 >= base)
        .map(|r| ((r.gpa.0 - base) / MIB, r.size / MIB, r.slots))
        .collect();
    assert_eq!(pieces, vec![(0, 128, 1), (128, 128, 1), (256, 128, 1)]);
    // The unplugged block lies under its piece's slot, unreachable: a vCPU's access faults in
    // KVM, and the bus isolates the piece (the vCPU loop does this on the fault), after which
    // the access exits as absent memory.
    let bus = Arc::clone(&hotplug.mmio);
    assert!(
        !bus.isolate(Some(base + 63 * MIB)),
        "a plugged block: not the device's"
    );
    assert!(bus.isolate(Some(base + 64 * MIB)));
    assert!(
        !bus.isolate(Some(base + 64 * MIB)),
        "isolated already: nothing to do"
    );
    assert_eq!(
        guest.device.decide(base + 64 * MIB, Some(8), &[]),
        ExitAction::AbsentMemory,
        "the unplugged block has no slot once its piece is isolated"
    );
    let info = hotplug::hotplug_info(&hotplug.device);
    assert_eq!(info.mapped_slots, 4, "the isolated piece's two runs");
    assert_eq!(memory.slot_usage().used, 1 + 4);

    // Saved and restored over the memory a restore rebuilds: the same pieces, runs and sizes.
    let (state, transport) = {
        let device = hotplug.device.lock().expect("the device");
        (device.device().state(), device.state())
    };
    assert_eq!(state.max_slot_size, Some(128 * MIB));
    let again = vm_with_ram();
    let specs: Vec<RegionSpec> = memory
        .regions()
        .iter()
        .filter(|r| r.gpa.0 >= base)
        .map(|r| {
            RegionSpec::new(r.gpa, r.size)
                .with_id(r.id)
                .with_slot_ranges(memory.slot_ranges(r.id).expect("its slots"))
        })
        .collect();
    again.memory().add_regions(specs).expect("the pieces");
    let restored = hotplug::restore(
        &again,
        base,
        &area(1024, 2, None, Default::default()),
        &state,
        &transport,
    )
    .expect("restored");
    assert_eq!(hotplug::hotplug_info(&restored.device), info);
    assert_eq!(again.memory().slot_usage().used, 1 + 4);
    // The layout carries no protection: the restore put it back on every unplugged block (the
    // isolated first piece's block 32, the third piece around its 8 plugged blocks).
    let unreachable = |gpa: u64| {
        let region = again
            .memory()
            .regions()
            .into_iter()
            .find(|r| r.gpa.0 == gpa)
            .expect("the piece");
        again
            .memory()
            .region_memory(region.id)
            .expect("mapped")
            .inaccessible()
    };
    assert_eq!(unreachable(base), vec![64 * MIB..66 * MIB]);
    assert_eq!(unreachable(base + 128 * MIB), vec![]);
    assert_eq!(
        unreachable(base + 256 * MIB),
        vec![0..16 * MIB, 32 * MIB..128 * MIB]
    );
    // Restored isolated, the first piece gets its one slot back with its next plug.
    let restored_bus = Arc::clone(&restored.mmio);
    assert!(
        !restored_bus.isolate(Some(base + 64 * MIB)),
        "isolated already"
    );
    assert!(
        restored_bus.isolate(Some(base + 300 * MIB)),
        "the third piece"
    );
}

/// The device as the test below reaches it: its registers through its lock.
struct Locked(hotplug::VirtioMemDevice);

impl Registers for Locked {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        self.0.lock().expect("the device").read(offset, data);
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        self.0.lock().expect("the device").write(offset, data);
    }
}

/// A piece keeps one KVM slot over all of it while a block of it is plugged; its unplugged
/// blocks are unreachable under that slot (`PROT_NONE`). A real vCPU's access to one faults
/// inside KVM; the VMM isolates the piece (its slots become the runs of its plugged blocks)
/// and runs the access again, which then exits as absent memory: counted, writes dropped,
/// reads all ones, the guest goes on, the plugged blocks beside it keep their data. The next
/// plug in the piece gives it its one slot back.
#[test]
#[allow(clippy::single_range_in_vec_init)]
fn kvm_a_guest_touching_an_unplugged_block_under_its_pieces_slot_goes_on() {
    if !kvm_test_support::require_kvm(
        "tinyvmm::kvm_a_guest_touching_an_unplugged_block_under_its_pieces_slot_goes_on",
    ) {
        return;
    }
    use kvm_virtio_mem::{VirtioMem, VirtioMemOptions};
    use std::sync::atomic::Ordering;
    use std::sync::Mutex;
    use tinyvmm::test_guest::vcpus::TestVm;
    use tinyvmm::test_guest::Op;
    use tinyvmm::vm::mmio::MmioBus;

    const AREA: u64 = 8 << 30;
    const QUEUE: u64 = 6 << 30;
    let vm = TestVm::new().expect("a VM");
    let memory = Arc::clone(vm.memory());
    memory
        .add_region(RegionSpec::new(GuestAddress(QUEUE), MIB))
        .expect("the driver's RAM");
    let options = VirtioMemOptions::new(GuestAddress(AREA), 128 * MIB, 2 * MIB);
    let device: hotplug::VirtioMemDevice = Arc::new(Mutex::new(
        VirtioMem::new(Arc::clone(&memory), options)
            .expect("the device")
            .into_mmio(Box::new(EventFd::new(0).expect("eventfd"))),
    ));
    let mut bus = MmioBus::new();
    bus.insert_absent(AREA, 128 * MIB).expect("an empty bus");
    bus.set_unreachable(Arc::new(hotplug::Isolator(Arc::clone(&device))));
    let vm = vm.with_mmio(bus);
    let layout = Layout {
        base: QUEUE,
        size: 128,
    };
    let mut guest = Driver::new(Locked(Arc::clone(&device)), Arc::clone(&memory), layout);
    guest.init();
    device
        .lock()
        .expect("the device")
        .set_requested_size(8 * MIB)
        .expect("8 MiB");
    // Blocks 0 and 2 plugged, block 1 between them unplugged under the piece's one slot.
    assert_eq!(guest.plug(AREA, 1), RESP_ACK);
    assert_eq!(guest.plug(AREA + 4 * MIB, 1), RESP_ACK);
    let piece = memory
        .regions()
        .into_iter()
        .find(|r| r.gpa.0 == AREA)
        .expect("the piece")
        .id;
    assert_eq!(memory.slot_ranges(piece), Some(vec![0..128 * MIB]));

    let stopped = Arc::new(EventFd::new(0).expect("eventfd"));
    let mut vcpus = vm.start_vcpus(1, &stopped).expect("vCPUs");
    let counters = |vcpus: &tinyvmm::test_guest::vcpus::Vcpus| {
        let c = &vcpus.shared(0).counters;
        (
            c.unreachable_isolated.load(Ordering::Relaxed),
            c.absent_memory.load(Ordering::Relaxed),
        )
    };
    for (at, seed) in [(AREA, 1), (AREA + 4 * MIB, 2)] {
        vcpus
            .run(0, block(Op::Write, at, seed))
            .expect("plugged memory");
    }
    assert_eq!(counters(&vcpus), (0, 0));
    // The unplugged block: a fault in KVM, the piece isolated, then 512 absent writes.
    vcpus
        .run(0, block(Op::Write, AREA + 2 * MIB, 3))
        .expect("the guest goes on");
    assert_eq!(counters(&vcpus), (1, 512));
    assert_eq!(
        memory.slot_ranges(piece),
        Some(vec![0..2 * MIB, 4 * MIB..6 * MIB])
    );
    assert_reads_ones(&mut vcpus, AREA + 2 * MIB, 3, "an unplugged block");
    for (at, seed) in [(AREA, 1), (AREA + 4 * MIB, 2)] {
        vcpus
            .run(0, block(Op::Verify, at, seed))
            .expect("the plugged blocks kept their data");
    }
    // Plugged: the piece has its one slot again, and the block is memory.
    assert_eq!(guest.plug(AREA + 2 * MIB, 1), RESP_ACK);
    assert_eq!(memory.slot_ranges(piece), Some(vec![0..128 * MIB]));
    vcpus
        .run(0, block(Op::Write, AREA + 2 * MIB, 4))
        .expect("plugged memory");
    vcpus
        .run(0, block(Op::Verify, AREA + 2 * MIB, 4))
        .expect("plugged memory");
    // Another unplugged block of the piece, under its slot again: isolated once more.
    vcpus
        .run(0, block(Op::Write, AREA + 6 * MIB, 5))
        .expect("the guest goes on");
    assert_eq!(counters(&vcpus).0, 2);
    vcpus.shut_down().expect("clean stop");
}

/// A Linux guest's virtio-mem device with 2 MiB pages (`--hotplug-page-size 2m`): the pieces
/// the guest plugs are hugetlb regions, `GET /hotplug/memory` says so, and each block the guest
/// unplugs gives its huge page back.
#[test]
fn kvm_virtio_mem_with_2m_pages_plugs_huge_pages_and_gives_them_back() {
    let test = "tinyvmm::kvm_virtio_mem_with_2m_pages_plugs_huge_pages_and_gives_them_back";
    if !support::require_hugetlb_pages(test, 2, "2") {
        return;
    }
    let Some((vm, memory)) = kvm_vm_with_ram(test) else {
        return;
    };
    // 64 MiB in 2 MiB blocks, pieces of two blocks.
    let hotplug =
        hotplug::setup(&vm, &area(64, 2, Some(4), RegionPageSize::Huge2M)).expect("the device");
    let (mut guest, base) = driver_of(&hotplug, &memory);
    hotplug
        .device
        .lock()
        .expect("the device")
        .set_requested_size(4 * MIB)
        .expect("4 MiB");
    assert_eq!(guest.plug(base, 2), RESP_ACK);
    let info = hotplug::hotplug_info(&hotplug.device);
    assert_eq!(
        (info.page_size, info.plugged_size_mib),
        (RegionPageSize::Huge2M, 4),
        "{info:?}"
    );
    let piece = || {
        let regions = memory.regions();
        let r = regions.iter().find(|r| r.gpa.0 == base)?;
        assert_eq!(r.page_size, kvm_memslots::PageSize::Huge2M, "{r:?}");
        Some(r.hva.0)
    };
    let hva = piece().expect("the piece");
    let snapshot = memory.handle().memory();
    for at in [base + 8, base + 3 * MIB] {
        snapshot
            .write_obj(0x38u64, GuestAddress(at))
            .expect("plugged memory is writable");
    }
    drop(snapshot);
    assert_eq!(
        support::hugetlb_bytes(hva, 4 * MIB),
        4 * MIB,
        "two huge pages"
    );
    // The second block unplugged, the piece stays: its huge page goes back.
    assert_eq!(guest.unplug(base + 2 * MIB, 1), RESP_ACK);
    assert_eq!(piece(), Some(hva));
    assert_eq!(
        support::hugetlb_bytes(hva, 4 * MIB),
        2 * MIB,
        "one huge page left"
    );
    // The first too: the piece goes.
    assert_eq!(guest.unplug(base, 1), RESP_ACK);
    assert_eq!(piece(), None);
    // Plugged again: zeros.
    assert_eq!(guest.plug(base, 2), RESP_ACK);
    let snapshot = memory.handle().memory();
    for at in [base + 8, base + 3 * MIB] {
        assert_eq!(snapshot.read_obj::<u64>(GuestAddress(at)).expect("read"), 0);
    }
}

/// A plug into a 2 MiB virtio-mem piece the hugetlb pool cannot hold is the manager's refusal:
/// the guest hears BUSY, `GET /hotplug/memory` says why (naming the pool's free pages), and
/// nothing is plugged.
#[test]
fn kvm_virtio_mem_with_2m_pages_answers_busy_when_the_pool_cannot_hold_a_piece() {
    let Some((vm, memory)) = kvm_vm_with_ram(
        "tinyvmm::kvm_virtio_mem_with_2m_pages_answers_busy_when_the_pool_cannot_hold_a_piece",
    ) else {
        return;
    };
    // One piece of more pages than the pool has, whatever its size.
    let piece_mib = (kvm_memslots::hugetlb_pages_available() + 64) * 2;
    let hotplug = hotplug::setup(
        &vm,
        &area(piece_mib, 2, Some(piece_mib), RegionPageSize::Huge2M),
    )
    .expect("the device");
    let (mut guest, base) = driver_of(&hotplug, &memory);
    hotplug
        .device
        .lock()
        .expect("the device")
        .set_requested_size(2 * MIB)
        .expect("2 MiB");
    assert_eq!(guest.plug(base, 1), driver::RESP_BUSY);
    let info = hotplug::hotplug_info(&hotplug.device);
    assert_eq!(
        (info.plugged_size_mib, info.mapped_slots),
        (0, 0),
        "{info:?}"
    );
    let why = info.last_busy.unwrap_or_default();
    assert!(why.contains("free 2 MiB pages"), "{why}");
    assert_eq!(memory.regions().len(), 1, "only RAM");
}
