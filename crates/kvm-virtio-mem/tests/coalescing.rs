//! Plugged blocks sharing KVM slots: the driver model's plug and unplug sequences with every
//! maximum slot size from the block size up, checking after every request that each piece with
//! a plugged block has one slot over all of it and the others none, that unplugged blocks are
//! unreachable (vm-memory refuses them), that plugged blocks keep their contents through their
//! neighbours' plugs and unplugs, and that a refused request changes nothing; and on
//! `/dev/kvm` (skipped loudly without it), plug and unplug churn under a vCPU writing the
//! plugged blocks of the same piece, whose slot never changes.

#[path = "support/driver.rs"]
mod driver;

use std::sync::Arc;

use driver::*;
use kvm_memslots::testing::{FakeKvm, Faulty, KvmCall};
use kvm_memslots::{KvmMemory, MemoryManager, RegionSpec};
use kvm_virtio_mem::mem::DEFAULT_MAX_SLOT_SIZE;
use kvm_virtio_mem::{VirtioMem, VirtioMemOptions};
use vm_memory::{Bytes, GuestAddress, GuestAddressSpace};

const MIB: u64 = 1 << 20;
/// The device's region: 64 MiB in 2 MiB blocks at 4 GiB.
const BASE: u64 = 4 << 30;
const BLOCK: u64 = 2 * MIB;
const BLOCKS: usize = 32;
const REGION: u64 = BLOCKS as u64 * BLOCK;
/// The driver's queue and buffers: ordinary RAM below the device.
const QUEUE_RAM: u64 = 0x10_0000;

/// Every maximum slot size: the block size (a slot per block), pieces that divide the region
/// or do not, the whole region, and the default (larger than the region).
const MAX_SLOT_SIZES: [u64; 7] = [
    BLOCK,
    2 * BLOCK,
    4 * BLOCK,
    6 * BLOCK,
    16 * BLOCK,
    REGION,
    DEFAULT_MAX_SLOT_SIZE,
];

fn driver<K: KvmMemory>(kvm: K, max_slot_size: u64) -> Driver<K> {
    driver_of(kvm, REGION, max_slot_size)
}

/// A driver, initialised, of a device of `region` bytes at `BASE` asked for all of them.
fn driver_of<K: KvmMemory>(kvm: K, region: u64, max_slot_size: u64) -> Driver<K> {
    let memory = Arc::new(MemoryManager::new(kvm));
    memory
        .add_region(RegionSpec::new(GuestAddress(QUEUE_RAM), 0x10_0000))
        .expect("the driver's RAM");
    let options =
        VirtioMemOptions::new(GuestAddress(BASE), region, BLOCK).with_max_slot_size(max_slot_size);
    let device = VirtioMem::new(Arc::clone(&memory), options).expect("a valid device");
    let irq = vmm_sys_util::eventfd::EventFd::new(vmm_sys_util::eventfd::EFD_NONBLOCK)
        .expect("an eventfd");
    let layout = Layout {
        base: QUEUE_RAM,
        size: 16,
    };
    let mut driver = Driver::new(device.into_mmio(Box::new(irq)), memory, layout);
    driver.init();
    driver
        .device
        .set_requested_size(region)
        .expect("the whole region");
    driver
}

/// The slots the device should have with blocks `plugged`: one over each piece of `max` bytes
/// (the last one maybe shorter) with a plugged block, as (guest address, size).
fn expected_slots(plugged: &[bool], max: u64) -> Vec<(u64, u64)> {
    let per_piece = (max / BLOCK) as usize;
    plugged
        .chunks(per_piece)
        .enumerate()
        .filter(|(_, piece)| piece.contains(&true))
        .map(|(p, piece)| {
            (
                BASE + (p * per_piece) as u64 * BLOCK,
                piece.len() as u64 * BLOCK,
            )
        })
        .collect()
}

/// KVM's slots in the device's region, as (guest address, size), by address.
fn device_slots<K: KvmMemory>(memory: &MemoryManager<K>) -> Vec<(u64, u64)> {
    let mut slots: Vec<(u64, u64)> = memory
        .current()
        .map()
        .iter()
        .filter(|s| s.gpa().0 >= BASE)
        .map(|s| (s.gpa().0, s.size()))
        .collect();
    slots.sort();
    slots
}

/// What each block holds: written when it is plugged, checked while it stays plugged.
fn stamp(i: usize, round: u64) -> u64 {
    0x5eed_0000_0000 | (round << 8) | i as u64
}

/// The model of the device's blocks, checked against the device after every request.
struct Model {
    max: u64,
    plugged: Vec<bool>,
    stamps: Vec<u64>,
    round: u64,
}

impl Model {
    fn new(max: u64) -> Self {
        Model {
            max,
            plugged: vec![false; BLOCKS],
            stamps: vec![0; BLOCKS],
            round: 0,
        }
    }

    /// Sends one request and checks everything the device should have become.
    fn request<K: KvmMemory>(&mut self, d: &mut Driver<K>, plug: bool, first: usize, n: usize) {
        let addr = BASE + first as u64 * BLOCK;
        let response = if plug {
            d.plug(addr, n as u16)
        } else {
            d.unplug(addr, n as u16)
        };
        let what = format!(
            "max slot {:#x}: {} {first}..{}",
            self.max,
            if plug { "plug" } else { "unplug" },
            first + n
        );
        assert_eq!(response, RESP_ACK, "{what}");
        self.round += 1;
        let mem = d.memory.handle().memory();
        for i in first..first + n {
            self.plugged[i] = plug;
            let gpa = GuestAddress(BASE + i as u64 * BLOCK + 64);
            if plug {
                // Fresh memory, or memory given back to the host when it was unplugged.
                assert_eq!(mem.read_obj::<u64>(gpa).expect("plugged"), 0, "{what}: {i}");
                self.stamps[i] = stamp(i, self.round);
                mem.write_obj(self.stamps[i], gpa).expect("plugged");
            }
        }
        self.check(d, &what);
    }

    fn check<K: KvmMemory>(&self, d: &mut Driver<K>, what: &str) {
        assert_eq!(
            device_slots(&d.memory),
            expected_slots(&self.plugged, self.max),
            "{what}"
        );
        let plugged = self.plugged.iter().filter(|p| **p).count() as u64;
        assert_eq!(d.config64(CFG_PLUGGED_SIZE), plugged * BLOCK, "{what}");
        let mem = d.memory.handle().memory();
        for (i, &p) in self.plugged.iter().enumerate() {
            let gpa = GuestAddress(BASE + i as u64 * BLOCK + 64);
            match mem.read_obj::<u64>(gpa) {
                Ok(value) => {
                    assert!(p, "{what}: unplugged block {i} is memory");
                    assert_eq!(value, self.stamps[i], "{what}: block {i} lost its contents");
                }
                Err(_) => assert!(!p, "{what}: plugged block {i} is no memory"),
            }
        }
        let blocks = d.device.device().plugged_blocks();
        assert_eq!(blocks.len() as u64, plugged, "{what}");
        // A piece's blocks share one region; pieces do not.
        let per_piece = (self.max / BLOCK) as usize;
        for pair in blocks.windows(2) {
            let piece = |b: &kvm_virtio_mem::PluggedBlock| (b.gpa.0 - BASE) / self.max;
            assert_eq!(
                pair[0].region == pair[1].region,
                piece(&pair[0]) == piece(&pair[1]),
                "{what}: {pair:?} ({per_piece} blocks a piece)"
            );
        }
    }
}

/// Linux's driver in small: plugs lowest first, in requests of one block and of 16, unplugs
/// highest first; then holes made and filled, and a deterministic random mix.
fn sequence() -> Vec<(bool, usize, usize)> {
    let mut steps = Vec::new();
    for i in 0..4 {
        steps.push((true, i, 1));
    }
    steps.push((true, 4, 16));
    steps.extend([(false, 19, 1), (false, 18, 1), (false, 5, 4), (true, 30, 2)]);
    steps.extend([(true, 24, 1), (true, 5, 4), (false, 0, 4), (true, 18, 2)]);
    let mut plugged = [false; BLOCKS];
    for &(plug, first, n) in &steps {
        plugged[first..first + n].fill(plug);
    }
    let mut seed: u64 = 0x9e37_79b9_7f4a_7c15;
    while steps.len() < 80 {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        let first = (seed % BLOCKS as u64) as usize;
        let n = 1 + ((seed >> 8) % 4) as usize;
        if first + n > BLOCKS {
            continue;
        }
        let range = &mut plugged[first..first + n];
        if range.iter().all(|p| !p) {
            range.fill(true);
            steps.push((true, first, n));
        } else if range.iter().all(|p| *p) {
            range.fill(false);
            steps.push((false, first, n));
        }
    }
    steps
}

#[test]
fn plugged_blocks_share_slots_up_to_the_maximum_slot_size() {
    for max in MAX_SLOT_SIZES {
        let mut d = driver(FakeKvm::new(512, true), max);
        assert_eq!(d.device.device().max_slot_size(), max);
        let mut model = Model::new(max);
        for (plug, first, n) in sequence() {
            model.request(&mut d, plug, first, n);
        }
        assert_eq!(d.unplug_all(), RESP_ACK);
        model.plugged.fill(false);
        model.check(&mut d, "unplug all");
        assert!(device_slots(&d.memory).is_empty());
        assert_eq!(d.memory.regions().len(), 1, "only the driver's RAM is left");
    }
}

/// With 128 MiB pieces (the default), 1 GiB plugged in 2 MiB blocks lowest first takes 8
/// slots, whatever the requests' sizes; a hole costs none (its piece keeps its one slot).
#[test]
fn a_gib_plugged_block_by_block_takes_eight_slots() {
    let mut d = driver_of(FakeKvm::new(512, true), 1 << 30, DEFAULT_MAX_SLOT_SIZE);
    let memory = Arc::clone(&d.memory);
    for i in 0..512 {
        assert_eq!(d.plug(BASE + i * BLOCK, 1), RESP_ACK);
    }
    assert_eq!(device_slots(&memory).len(), 8);
    assert_eq!(d.unplug(BASE + 100 * BLOCK, 3), RESP_ACK);
    assert_eq!(device_slots(&memory).len(), 8);
}

/// KVM refusing any step of a plug or unplug that starts or empties a piece: the request is
/// answered BUSY and nothing changes (slots, plugged blocks, their contents); the retry goes
/// through. A request inside a live piece makes no KVM call, so nothing can refuse it.
#[test]
fn a_refused_step_of_a_coalescing_request_changes_nothing() {
    for max in [4 * BLOCK, REGION] {
        let mut d = driver(Faulty::new(FakeKvm::new(512, true)), max);
        let mut model = Model::new(max);
        let steps = [
            (true, 0, 3),
            (true, 3, 2),
            (true, 8, 4),
            (true, 5, 3),
            (false, 2, 2),
            (false, 8, 1),
            (false, 0, 2),
        ];
        for (plug, first, n) in steps {
            let mut k = 0;
            loop {
                d.memory.kvm().fail(KvmCall::SetRegion, k, libc::EIO);
                let addr = BASE + first as u64 * BLOCK;
                let response = if plug {
                    d.plug(addr, n as u16)
                } else {
                    d.unplug(addr, n as u16)
                };
                if !d.memory.kvm().failure_pending() {
                    assert_eq!(response, RESP_BUSY, "max {max:#x}: step {k}");
                    model.check(&mut d, &format!("max {max:#x}, refused at step {k}"));
                    k += 1;
                    continue;
                }
                // Fewer requests than k: it went through; take it back and redo it through the
                // model (which checks it).
                d.memory.kvm().heal();
                assert_eq!(response, RESP_ACK);
                let undo = if plug {
                    d.unplug(addr, n as u16)
                } else {
                    d.plug(addr, n as u16)
                };
                assert_eq!(undo, RESP_ACK);
                if !plug {
                    // Re-plugged blocks come back zeroed: restamp them as the model expects.
                    let mem = d.memory.handle().memory();
                    for i in first..first + n {
                        let gpa = GuestAddress(BASE + i as u64 * BLOCK + 64);
                        mem.write_obj(model.stamps[i], gpa).expect("plugged");
                    }
                }
                model.check(&mut d, "undone");
                model.request(&mut d, plug, first, n);
                break;
            }
            if first == 0 && plug {
                assert!(k >= 1, "max {max:#x}: the first plug makes a slot");
            }
        }
    }
}

/// Where the churn test's real-mode guest and its device live (below 1 MiB, where real mode
/// reaches): code and the driver's queue in RAM below `CHURN_DEV`, then four 64 KiB blocks in
/// one piece.
const CHURN_DEV: u64 = 0x8_0000;
const CHURN_BLOCK: u64 = 0x1_0000;
/// The byte the guest polls: not zero tells it to stop.
const CHURN_STOP: u16 = 0x800;

/// Real-mode code: writes an iteration count into blocks 0 and 2 of the churn device, over and
/// over, until the stop byte is set; then reports the count on port 0x10 and halts.
fn churn_guest() -> Vec<u8> {
    let blocks = [CHURN_DEV >> 4, (CHURN_DEV + 2 * CHURN_BLOCK) >> 4].map(|s| s as u16);
    kvm_test_support::counting_guest(&blocks, CHURN_STOP, 0x10)
}

/// A vCPU writes two plugged blocks of a piece in a loop while the driver plugs and unplugs
/// the blocks between and after them: the piece's one slot never changes under the guest, so
/// every write lands (the blocks hold the guest's last count), none exits (no slot is ever
/// away) and none is taken for absent memory.
#[test]
fn kvm_plug_and_unplug_churn_under_a_writing_vcpu_loses_no_write() {
    let test = "kvm_plug_and_unplug_churn_under_a_writing_vcpu_loses_no_write";
    if !kvm_test_support::require_kvm(&format!("kvm-virtio-mem::{test}")) {
        return;
    }
    let kvm = kvm_ioctls::Kvm::new().expect("open /dev/kvm");
    let vm = Arc::new(kvm.create_vm().expect("KVM_CREATE_VM"));
    let kvm_vm = kvm_memslots::KvmVm::new(&kvm, Arc::clone(&vm)).expect("set up the VM");
    let memory = Arc::new(MemoryManager::new(kvm_vm));
    memory
        .add_region(RegionSpec::new(GuestAddress(0), CHURN_DEV))
        .expect("low RAM");
    let mut options = VirtioMemOptions::new(GuestAddress(CHURN_DEV), 4 * CHURN_BLOCK, CHURN_BLOCK)
        .with_max_slot_size(4 * CHURN_BLOCK);
    options.requested_size = 4 * CHURN_BLOCK;
    let transport = VirtioMem::new(Arc::clone(&memory), options)
        .expect("device")
        .into_mmio(Box::new(
            vmm_sys_util::eventfd::EventFd::new(0).expect("eventfd"),
        ));
    let layout = Layout {
        base: 0x4_0000,
        size: 8,
    };
    let mut d = Driver::new(transport, Arc::clone(&memory), layout);
    d.init();
    let block = |i: u64| CHURN_DEV + i * CHURN_BLOCK;
    assert_eq!(d.plug(block(0), 1), RESP_ACK);
    assert_eq!(d.plug(block(2), 1), RESP_ACK);
    memory
        .current()
        .write_slice(&churn_guest(), GuestAddress(0x1000))
        .expect("load the guest");
    let mut vcpu = vm.create_vcpu(0).expect("KVM_CREATE_VCPU");
    kvm_test_support::start_in_real_mode(&vcpu, 0x1000);
    let guest_memory = Arc::clone(&memory);
    let guest = std::thread::spawn(move || {
        let (mut reported, mut completed, mut absent) = (Vec::new(), 0u64, Vec::new());
        loop {
            match vcpu.run().expect("KVM_RUN") {
                kvm_ioctls::VcpuExit::IoOut(0x10, data) => reported.push(data[0]),
                kvm_ioctls::VcpuExit::MmioWrite(addr, data) => {
                    // A slot away for a moment: wait for the change, then write where the
                    // memory is, if it is memory.
                    let data = data.to_vec();
                    guest_memory.wait_settled(|| false).expect("never gives up");
                    match guest_memory
                        .current()
                        .write_slice(&data, GuestAddress(addr))
                    {
                        Ok(()) => completed += 1,
                        Err(_) => absent.push(addr),
                    }
                }
                kvm_ioctls::VcpuExit::Hlt => return (reported, completed, absent),
                other => panic!("unexpected exit {other:?}"),
            }
        }
    });
    let started = std::time::Instant::now();
    let mut requests = 0;
    while requests < 400 || started.elapsed().as_secs() < 1 {
        // Merge 0..3 into one slot, then 0..4, then split back to 0, 2..4, then 0 and 2.
        for (plug, i) in [(true, 1), (true, 3), (false, 1), (false, 3)] {
            let answer = if plug {
                d.plug(block(i), 1)
            } else {
                d.unplug(block(i), 1)
            };
            assert_eq!(answer, RESP_ACK, "request {requests}");
            requests += 1;
        }
    }
    memory
        .current()
        .write_obj(1u8, GuestAddress(u64::from(CHURN_STOP)))
        .expect("stop the guest");
    let (reported, completed, absent) = guest.join().expect("the vCPU thread");
    assert!(absent.is_empty(), "reported absent: {absent:x?}");
    assert_eq!(
        completed, 0,
        "no write met a slot away: the piece's slot never changed"
    );
    let count = u16::from_le_bytes([reported[0], reported[1]]);
    assert!(count > 1, "the guest ran");
    for i in [0, 2] {
        let got: u16 = memory
            .current()
            .read_obj(GuestAddress(block(i) + 0x10))
            .expect("plugged");
        assert_eq!(got, count, "block {i}: a write was lost");
    }
    eprintln!("{test}: {requests} requests, guest count {count}, {completed} writes completed after a change");
}
