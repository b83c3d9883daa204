//! The device driven by a guest-side driver model (`support/driver.rs`, written from the
//! virtio specification) through its MMIO registers and a split virtqueue in guest RAM, as a
//! guest's vCPU exits would drive it. Responses, configuration space, interrupts and the
//! manager's slots are checked after every step.
//!
//! Most tests run on `FakeKvm`; the `kvm_` tests use `/dev/kvm` and skip loudly without it.

#[path = "support/driver.rs"]
mod driver;

use std::sync::Arc;

use driver::*;
use kvm_memslots::testing::{FakeKvm, Faulty, KvmCall};
use kvm_memslots::{KvmMemory, KvmSlot, KvmVm, MemoryLimits, MemoryManager, RegionSpec};
use kvm_virtio_mem::{VirtioMem, VirtioMemOptions};
use vm_memory::{Bytes, GuestAddress, GuestAddressSpace};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

const MIB: u64 = 1 << 20;
/// The device's region: 64 MiB in 2 MiB blocks at 4 GiB.
const BASE: u64 = 4 << 30;
const REGION: u64 = 64 * MIB;
const BLOCK: u64 = 2 * MIB;
/// The driver's queue and buffers: ordinary RAM below the device.
const QUEUE_RAM: u64 = 0x10_0000;

struct Setup<K: KvmMemory> {
    driver: Driver<K>,
    irq: EventFd,
}

impl<K: KvmMemory> Setup<K> {
    fn memory(&self) -> &Arc<MemoryManager<K>> {
        &self.driver.memory
    }

    /// The manager's regions other than the driver's RAM, as (gpa, size, slots).
    fn device_regions(&self) -> Vec<(u64, u64, usize)> {
        let mut regions: Vec<_> = self
            .memory()
            .regions()
            .into_iter()
            .filter(|r| r.gpa.0 >= BASE)
            .map(|r| (r.gpa.0, r.size, r.slots))
            .collect();
        // By address: a rolled-back unplug plugs blocks again as new regions (new ids).
        regions.sort();
        regions
    }

    /// How many interrupts were raised since the last call (0 if none).
    fn interrupts(&self) -> u64 {
        self.irq.read().unwrap_or(0)
    }

    fn plugged(&mut self) -> u64 {
        self.driver.config64(CFG_PLUGGED_SIZE)
    }
}

fn setup_on<K: KvmMemory>(kvm: K, headroom: u64) -> Setup<K> {
    let memory = Arc::new(MemoryManager::new(kvm));
    memory
        .add_region(RegionSpec::new(GuestAddress(QUEUE_RAM), 0x10_0000))
        .expect("the driver's RAM");
    // Each block its own region and slot: the scheme these tests were written for (the
    // coalescing tests below set other maximum slot sizes).
    let mut options =
        VirtioMemOptions::new(GuestAddress(BASE), REGION, BLOCK).with_max_slot_size(BLOCK);
    options.usable_headroom = headroom;
    let device = VirtioMem::new(Arc::clone(&memory), options).expect("a valid device");
    let irq = EventFd::new(EFD_NONBLOCK).expect("an eventfd");
    let interrupt = irq.try_clone().expect("clone the eventfd");
    let transport = device.into_mmio(Box::new(interrupt));
    let layout = Layout {
        base: QUEUE_RAM,
        size: 16,
    };
    Setup {
        driver: Driver::new(transport, memory, layout),
        irq,
    }
}

fn setup() -> Setup<FakeKvm> {
    setup_on(FakeKvm::new(512, true), 8 * MIB)
}

/// Blocks at these indices, each as the one-slot region it should be.
fn blocks(indices: &[u64]) -> Vec<(u64, u64, usize)> {
    indices
        .iter()
        .map(|i| (BASE + i * BLOCK, BLOCK, 1))
        .collect()
}

#[test]
fn plug_state_unplug_and_unplug_all() {
    let mut s = setup();
    s.driver.init();
    assert_eq!(s.driver.config64(CFG_BLOCK_SIZE), BLOCK);
    assert_eq!(s.driver.config64(CFG_ADDR), BASE);
    assert_eq!(s.driver.config64(CFG_REGION_SIZE), REGION);
    assert_eq!(s.driver.config64(CFG_REQUESTED_SIZE), 0);
    assert_eq!(s.driver.config64(CFG_USABLE_REGION_SIZE), 8 * MIB);
    assert_eq!(s.plugged(), 0);
    assert_eq!(s.interrupts(), 0);

    // The host asks for 16 MiB: a configuration-change interrupt and a new generation.
    let generation = s.driver.generation();
    s.driver
        .device
        .set_requested_size(16 * MIB)
        .expect("aligned, in range");
    assert_eq!(s.interrupts(), 1);
    assert_eq!(s.driver.take_interrupt(), INT_CONFIG);
    assert_ne!(s.driver.generation(), generation);
    assert_eq!(s.driver.config64(CFG_REQUESTED_SIZE), 16 * MIB);
    assert_eq!(s.driver.config64(CFG_USABLE_REGION_SIZE), 24 * MIB);

    let slots_before = s.memory().slot_usage().used;
    let generation = s.driver.generation();
    assert_eq!(s.driver.plug(BASE + 2 * BLOCK, 3), RESP_ACK);
    assert_eq!(s.interrupts(), 1);
    assert_eq!(s.driver.take_interrupt(), INT_USED_BUFFER);
    assert_eq!(s.plugged(), 3 * BLOCK);
    assert_ne!(s.driver.generation(), generation, "plugged_size changed");
    assert_eq!(s.device_regions(), blocks(&[2, 3, 4]));
    assert_eq!(s.memory().slot_usage().used, slots_before + 3);
    assert_eq!(s.driver.device.device().plugged_size(), 3 * BLOCK);

    // Plugged memory is guest memory; the blocks around it are not.
    let ram = s.memory().handle();
    ram.memory()
        .write_obj(0xfeed_f00d_u64, GuestAddress(BASE + 3 * BLOCK + 8))
        .expect("plugged memory is writable");
    assert_eq!(
        ram.memory()
            .read_obj::<u64>(GuestAddress(BASE + 3 * BLOCK + 8))
            .expect("readable"),
        0xfeed_f00d
    );
    assert!(ram
        .memory()
        .read_obj::<u64>(GuestAddress(BASE + BLOCK))
        .is_err());
    assert!(ram
        .memory()
        .read_obj::<u64>(GuestAddress(BASE + 5 * BLOCK))
        .is_err());

    assert_eq!(
        s.driver.state(BASE + 2 * BLOCK, 3),
        (RESP_ACK, STATE_PLUGGED)
    );
    assert_eq!(s.driver.state(BASE, 2), (RESP_ACK, STATE_UNPLUGGED));
    assert_eq!(s.driver.state(BASE + BLOCK, 2), (RESP_ACK, STATE_MIXED));
    assert_eq!(s.driver.state(BASE + 4 * BLOCK, 8), (RESP_ACK, STATE_MIXED));

    assert_eq!(s.driver.unplug(BASE + 3 * BLOCK, 1), RESP_ACK);
    assert_eq!(s.plugged(), 2 * BLOCK);
    assert_eq!(s.device_regions(), blocks(&[2, 4]));
    assert!(ram
        .memory()
        .read_obj::<u64>(GuestAddress(BASE + 3 * BLOCK + 8))
        .is_err());
    assert_eq!(s.driver.state(BASE + 2 * BLOCK, 3), (RESP_ACK, STATE_MIXED));

    // Shrinking the request keeps the usable region (it shrinks only on UNPLUG_ALL).
    s.driver.device.set_requested_size(0).expect("zero");
    assert_eq!(s.driver.config64(CFG_USABLE_REGION_SIZE), 24 * MIB);
    s.interrupts();
    s.driver.take_interrupt();
    assert_eq!(s.driver.unplug_all(), RESP_ACK);
    assert_eq!(s.interrupts(), 1);
    assert_eq!(s.plugged(), 0);
    assert_eq!(s.driver.config64(CFG_USABLE_REGION_SIZE), 8 * MIB);
    assert!(s.device_regions().is_empty());
    assert_eq!(s.memory().slot_usage().used, slots_before);
    // UNPLUG_ALL sends no configuration-change interrupt, only the used-buffer one.
    assert_eq!(s.driver.take_interrupt(), INT_USED_BUFFER);
    assert_eq!(s.driver.unplug_all(), RESP_ACK, "nothing plugged is fine");
}

#[test]
fn every_bad_request_is_an_error_and_changes_nothing() {
    let mut s = setup();
    s.driver.init();
    s.driver.device.set_requested_size(8 * MIB).expect("fits");
    // Usable: 16 MiB = 8 blocks.
    assert_eq!(s.driver.plug(BASE, 2), RESP_ACK);
    let regions = s.device_regions();
    let cases: &[(&str, u16, u64, u16)] = &[
        (
            "plug: unaligned address",
            REQ_PLUG,
            BASE + 2 * BLOCK + 4096,
            1,
        ),
        ("plug: zero blocks", REQ_PLUG, BASE + 2 * BLOCK, 0),
        ("plug: below the region", REQ_PLUG, BASE - BLOCK, 1),
        ("plug: far below", REQ_PLUG, 0, 1),
        (
            "plug: past the usable region",
            REQ_PLUG,
            BASE + 8 * BLOCK,
            1,
        ),
        ("plug: straddling its end", REQ_PLUG, BASE + 7 * BLOCK, 2),
        ("plug: past the region", REQ_PLUG, BASE + REGION, 1),
        ("plug: wrapping", REQ_PLUG, u64::MAX - BLOCK + 1, 2),
        ("plug: already plugged", REQ_PLUG, BASE + BLOCK, 1),
        ("plug: partly plugged", REQ_PLUG, BASE + BLOCK, 2),
        ("unplug: unplugged", REQ_UNPLUG, BASE + 2 * BLOCK, 1),
        ("unplug: partly unplugged", REQ_UNPLUG, BASE + BLOCK, 2),
        ("unplug: unaligned", REQ_UNPLUG, BASE + 4096, 1),
        ("unplug: zero blocks", REQ_UNPLUG, BASE, 0),
        ("unplug: past usable", REQ_UNPLUG, BASE + 8 * BLOCK, 1),
        ("state: zero blocks", REQ_STATE, BASE, 0),
        ("state: unaligned", REQ_STATE, BASE + 1, 1),
        ("state: past usable", REQ_STATE, BASE, 9),
        ("state: below", REQ_STATE, BASE - BLOCK, 2),
        ("unknown request type", 7, BASE, 1),
    ];
    for &(what, kind, addr, n) in cases {
        let answer = s.driver.request(kind, addr, n).expect("answered");
        assert_eq!(answer.0, RESP_ERROR, "{what}");
        assert_eq!(s.device_regions(), regions, "{what}");
        assert_eq!(s.plugged(), 2 * BLOCK, "{what}");
        assert_eq!(
            s.driver.status(),
            0xf,
            "{what}: a bad request is not a broken chain"
        );
    }
    assert_eq!(
        s.driver.device.device().request_counts().error,
        cases.len() as u64
    );
}

#[test]
fn plugs_beyond_the_requested_size_are_nacked() {
    let mut s = setup();
    s.driver.init();
    assert_eq!(s.driver.plug(BASE, 1), RESP_NACK, "nothing requested");
    s.driver.device.set_requested_size(2 * BLOCK).expect("fits");
    assert_eq!(s.driver.plug(BASE, 3), RESP_NACK);
    assert!(s.device_regions().is_empty());
    assert_eq!(s.driver.plug(BASE, 2), RESP_ACK);
    assert_eq!(s.driver.plug(BASE + 2 * BLOCK, 1), RESP_NACK);
    s.driver.device.set_requested_size(3 * BLOCK).expect("fits");
    assert_eq!(s.driver.plug(BASE + 2 * BLOCK, 1), RESP_ACK);
    assert_eq!(s.device_regions(), blocks(&[0, 1, 2]));
    // Lowering the request does not unplug anything; the driver must.
    s.driver.device.set_requested_size(BLOCK).expect("fits");
    assert_eq!(s.plugged(), 3 * BLOCK);
    assert_eq!(s.driver.plug(BASE + 3 * BLOCK, 1), RESP_NACK);
    assert_eq!(s.driver.unplug(BASE, 2), RESP_ACK);
    assert_eq!(s.plugged(), BLOCK);
}

#[test]
fn set_requested_size_is_checked_and_changes_nothing_on_error() {
    let mut s = setup();
    s.driver.init();
    let generation = s.driver.generation();
    let err = s
        .driver
        .device
        .set_requested_size(BLOCK + 4096)
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "requested size 0x201000 is not a multiple of the block size 0x200000"
    );
    let err = s
        .driver
        .device
        .set_requested_size(REGION + BLOCK)
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "requested size 0x4200000 is larger than the region size 0x4000000"
    );
    assert_eq!(s.driver.generation(), generation);
    assert_eq!(s.interrupts(), 0);
    assert_eq!(s.driver.config64(CFG_REQUESTED_SIZE), 0);
    s.driver.device.set_requested_size(REGION).expect("fits");
    assert_eq!(s.driver.config64(CFG_USABLE_REGION_SIZE), REGION);
}

#[test]
fn feature_negotiation_refusals_leave_features_ok_clear() {
    let cases = [
        ("no VERSION_1", F_UNPLUGGED_INACCESSIBLE),
        ("no UNPLUGGED_INACCESSIBLE", F_VERSION_1),
        (
            "ACPI_PXM, not offered",
            F_VERSION_1 | F_UNPLUGGED_INACCESSIBLE | F_ACPI_PXM,
        ),
        (
            "an unknown high bit",
            F_VERSION_1 | F_UNPLUGGED_INACCESSIBLE | (1 << 60),
        ),
    ];
    for (what, accept) in cases {
        let mut s = setup();
        assert_eq!(
            s.driver.init_with(accept),
            Err(InitError::FeaturesRefused),
            "{what}"
        );
        assert_eq!(s.driver.status(), S_ACKNOWLEDGE | S_DRIVER, "{what}");
        // Without DRIVER_OK, a notify does nothing.
        s.driver.device.set_requested_size(BLOCK).expect("fits");
        assert!(s.driver.request(REQ_PLUG, BASE, 1).is_none(), "{what}");
        assert!(s.device_regions().is_empty(), "{what}");
        assert_eq!(s.interrupts(), 0, "{what}: no interrupt before DRIVER_OK");
    }
    let mut s = setup();
    let offered = s
        .driver
        .init_with(F_VERSION_1 | F_UNPLUGGED_INACCESSIBLE)
        .expect("accepted");
    assert_eq!(offered, F_VERSION_1 | F_UNPLUGGED_INACCESSIBLE);
    assert_eq!(s.driver.device.acked_features(), offered);
}

#[test]
fn a_queue_notify_before_driver_ok_is_ignored() {
    let mut s = setup();
    s.driver.device.set_requested_size(BLOCK).expect("fits");
    s.driver
        .init_until_driver_ok(F_VERSION_1 | F_UNPLUGGED_INACCESSIBLE)
        .expect("features accepted");
    assert_eq!(s.driver.status(), S_ACKNOWLEDGE | S_DRIVER | S_FEATURES_OK);
    assert!(s.driver.request(REQ_PLUG, BASE, 1).is_none());
    assert!(s.device_regions().is_empty());
    // The same request goes through once the driver sets DRIVER_OK.
    s.driver.write32(
        STATUS,
        S_ACKNOWLEDGE | S_DRIVER | S_FEATURES_OK | S_DRIVER_OK,
    );
    s.driver.write32(QUEUE_NOTIFY, 0);
    assert!(s.driver.take_used().is_some());
    assert_eq!(s.device_regions(), blocks(&[0]));
}

#[test]
fn the_ring_indices_wrap_around() {
    let mut s = setup();
    s.driver.init();
    s.driver.device.set_requested_size(REGION).expect("fits");
    // 16 entries in the ring; 70 requests wrap it several times.
    for round in 0..35u64 {
        let block = BASE + (round % 32) * BLOCK;
        assert_eq!(s.driver.plug(block, 1), RESP_ACK, "round {round}");
        assert_eq!(s.driver.unplug(block, 1), RESP_ACK, "round {round}");
    }
    assert!(s.device_regions().is_empty());
    assert_eq!(s.driver.device.device().request_counts().ack, 70);
}

/// Sends a chain that breaks the rules and checks that the device asks for a reset, answers
/// nothing, changes no memory, processes nothing more, and works again after a reset.
fn assert_needs_reset(what: &str, build: impl FnOnce(&mut Driver<FakeKvm>)) {
    let mut s = setup();
    s.driver.init();
    s.driver.device.set_requested_size(4 * BLOCK).expect("fits");
    assert_eq!(s.driver.take_interrupt(), INT_CONFIG);
    s.interrupts();
    build(&mut s.driver);
    assert_eq!(
        s.driver.status(),
        0xf | S_DEVICE_NEEDS_RESET,
        "{what}: DEVICE_NEEDS_RESET"
    );
    assert!(s.driver.device.needs_reset(), "{what}");
    assert_eq!(s.interrupts(), 1, "{what}: one interrupt");
    assert_eq!(
        s.driver.take_interrupt(),
        INT_CONFIG,
        "{what}: a config change"
    );
    assert!(s.driver.take_used().is_none(), "{what}: nothing used");
    assert!(s.device_regions().is_empty(), "{what}: no memory changed");
    // A good request is not processed until the reset.
    assert!(s.driver.request(REQ_PLUG, BASE, 1).is_none(), "{what}");
    assert!(s.device_regions().is_empty(), "{what}");
    s.driver.init();
    assert!(!s.driver.device.needs_reset());
    assert_eq!(
        s.driver.plug(BASE, 1),
        RESP_ACK,
        "{what}: works after reset"
    );
}

#[test]
fn malformed_chains_put_the_device_in_needs_reset() {
    let l = |d: &Driver<FakeKvm>| d.layout;
    let plug_request = |d: &Driver<FakeKvm>| {
        let mut req = [0u8; 24];
        req[8..16].copy_from_slice(&BASE.to_le_bytes());
        req[16..18].copy_from_slice(&1u16.to_le_bytes());
        d.write_ram(d.layout.request(), &req);
    };
    let response = |d: &Driver<FakeKvm>, next: u16| Desc {
        addr: l(d).response(),
        len: 10,
        flags: DESC_F_WRITE,
        next,
    };
    assert_needs_reset("request too short", |d| {
        plug_request(d);
        let descs = [
            Desc {
                addr: l(d).request(),
                len: 16,
                flags: DESC_F_NEXT,
                next: 1,
            },
            response(d, 0),
        ];
        d.submit(&descs, 0);
    });
    assert_needs_reset("request not device-readable", |d| {
        plug_request(d);
        let descs = [
            Desc {
                addr: l(d).request(),
                len: 24,
                flags: DESC_F_NEXT | DESC_F_WRITE,
                next: 1,
            },
            response(d, 0),
        ];
        d.submit(&descs, 0);
    });
    assert_needs_reset("response not device-writable", |d| {
        plug_request(d);
        let descs = [
            Desc {
                addr: l(d).request(),
                len: 24,
                flags: DESC_F_NEXT,
                next: 1,
            },
            Desc {
                addr: l(d).response(),
                len: 10,
                flags: 0,
                next: 0,
            },
        ];
        d.submit(&descs, 0);
    });
    assert_needs_reset("response too short", |d| {
        plug_request(d);
        let descs = [
            Desc {
                addr: l(d).request(),
                len: 24,
                flags: DESC_F_NEXT,
                next: 1,
            },
            Desc {
                addr: l(d).response(),
                len: 4,
                flags: DESC_F_WRITE,
                next: 0,
            },
        ];
        d.submit(&descs, 0);
    });
    assert_needs_reset("no response at all", |d| {
        plug_request(d);
        let descs = [Desc {
            addr: l(d).request(),
            len: 24,
            flags: 0,
            next: 0,
        }];
        d.submit(&descs, 0);
    });
    assert_needs_reset("request outside guest memory", |d| {
        let descs = [
            Desc {
                addr: 0x7000_0000,
                len: 24,
                flags: DESC_F_NEXT,
                next: 1,
            },
            response(d, 0),
        ];
        d.submit(&descs, 0);
    });
    assert_needs_reset("request in an unplugged block", |d| {
        let descs = [
            Desc {
                addr: BASE + 8 * BLOCK,
                len: 24,
                flags: DESC_F_NEXT,
                next: 1,
            },
            response(d, 0),
        ];
        d.submit(&descs, 0);
    });
    assert_needs_reset("response outside guest memory", |d| {
        plug_request(d);
        let descs = [
            Desc {
                addr: l(d).request(),
                len: 24,
                flags: DESC_F_NEXT,
                next: 1,
            },
            Desc {
                addr: 0x7000_0000,
                len: 10,
                flags: DESC_F_WRITE,
                next: 0,
            },
        ];
        d.submit(&descs, 0);
    });
    assert_needs_reset("response running off the end of RAM", |d| {
        plug_request(d);
        let descs = [
            Desc {
                addr: l(d).request(),
                len: 24,
                flags: DESC_F_NEXT,
                next: 1,
            },
            Desc {
                addr: QUEUE_RAM + 0x10_0000 - 4,
                len: 10,
                flags: DESC_F_WRITE,
                next: 0,
            },
        ];
        d.submit(&descs, 0);
    });
    assert_needs_reset("next index past the table", |d| {
        plug_request(d);
        let descs = [Desc {
            addr: l(d).request(),
            len: 24,
            flags: DESC_F_NEXT,
            next: 200,
        }];
        d.submit(&descs, 0);
    });
    assert_needs_reset("head index past the table", |d| {
        plug_request(d);
        let descs = [
            Desc {
                addr: l(d).request(),
                len: 24,
                flags: DESC_F_NEXT,
                next: 1,
            },
            response(d, 0),
        ];
        d.submit(&descs, 40);
    });
    assert_needs_reset("a readable buffer after a writable one", |d| {
        plug_request(d);
        let descs = [
            Desc {
                addr: l(d).request(),
                len: 24,
                flags: DESC_F_NEXT,
                next: 1,
            },
            Desc {
                addr: l(d).response(),
                len: 10,
                flags: DESC_F_WRITE | DESC_F_NEXT,
                next: 2,
            },
            Desc {
                addr: l(d).scratch(),
                len: 8,
                flags: 0,
                next: 0,
            },
        ];
        d.submit(&descs, 0);
    });
    assert_needs_reset("a descriptor loop", |d| {
        plug_request(d);
        let descs = [
            Desc {
                addr: l(d).request(),
                len: 24,
                flags: DESC_F_NEXT,
                next: 1,
            },
            Desc {
                addr: l(d).request(),
                len: 24,
                flags: DESC_F_NEXT,
                next: 0,
            },
        ];
        d.submit(&descs, 0);
    });
    assert_needs_reset("available idx far ahead of the ring", |d| {
        d.publish_avail_idx(100);
    });
}

#[test]
fn requests_split_across_descriptors_are_read_whole() {
    let mut s = setup();
    s.driver.init();
    s.driver.device.set_requested_size(4 * BLOCK).expect("fits");
    let l = s.driver.layout;
    let mut req = [0u8; 24];
    req[8..16].copy_from_slice(&(BASE + BLOCK).to_le_bytes());
    req[16..18].copy_from_slice(&2u16.to_le_bytes());
    // The request in three pieces and the response in two, scattered over the scratch area.
    let (a, b, c) = (l.scratch(), l.scratch() + 0x100, l.scratch() + 0x200);
    s.driver.write_ram(a, &req[..5]);
    s.driver.write_ram(b, &req[5..17]);
    s.driver.write_ram(c, &req[17..]);
    let (r1, r2) = (l.scratch() + 0x300, l.scratch() + 0x400);
    s.driver.write_ram(r1, &[0xee; 3]);
    s.driver.write_ram(r2, &[0xee; 7]);
    let used = s.driver.submit(
        &[
            Desc {
                addr: a,
                len: 5,
                flags: DESC_F_NEXT,
                next: 1,
            },
            Desc {
                addr: b,
                len: 12,
                flags: DESC_F_NEXT,
                next: 2,
            },
            Desc {
                addr: c,
                len: 7,
                flags: DESC_F_NEXT,
                next: 3,
            },
            Desc {
                addr: r1,
                len: 3,
                flags: DESC_F_WRITE | DESC_F_NEXT,
                next: 4,
            },
            Desc {
                addr: r2,
                len: 7,
                flags: DESC_F_WRITE,
                next: 0,
            },
        ],
        0,
    );
    assert_eq!(used, Some((0, 10)));
    let mut resp = [0u8; 3];
    s.driver.read_ram(r1, &mut resp);
    assert_eq!(u16::from_le_bytes([resp[0], resp[1]]), RESP_ACK);
    assert_eq!(s.device_regions(), blocks(&[1, 2]));
}

#[test]
fn a_kvm_failure_mid_request_is_rolled_back_and_answered_busy() {
    let mut s = setup_on(Faulty::new(FakeKvm::new(512, true)), 8 * MIB);
    s.driver.init();
    s.driver.device.set_requested_size(8 * BLOCK).expect("fits");
    assert_eq!(s.driver.plug(BASE, 2), RESP_ACK);
    let kvm_slots = |s: &Setup<Faulty<FakeKvm>>| {
        let mut slots: Vec<(u64, u64)> = s
            .memory()
            .kvm()
            .inner()
            .slots()
            .iter()
            .map(|k: &KvmSlot| (k.gpa, k.size))
            .collect();
        slots.sort();
        slots
    };
    let before = (kvm_slots(&s), s.device_regions(), s.memory().slot_usage());

    // The third of four new slots is refused: the two made are deleted again.
    s.memory().kvm().fail(KvmCall::SetRegion, 2, libc::EIO);
    assert_eq!(s.driver.plug(BASE + 2 * BLOCK, 4), RESP_BUSY);
    assert!(!s.memory().kvm().failure_pending(), "the failure was hit");
    assert_eq!(
        (kvm_slots(&s), s.device_regions(), s.memory().slot_usage()),
        before
    );
    assert_eq!(s.plugged(), 2 * BLOCK);
    assert_eq!(
        s.driver.state(BASE + 2 * BLOCK, 4),
        (RESP_ACK, STATE_UNPLUGGED)
    );
    assert_eq!(
        s.driver.status(),
        0xf,
        "a host failure is not a driver error"
    );

    // The driver retries, as Linux does on BUSY.
    assert_eq!(s.driver.plug(BASE + 2 * BLOCK, 4), RESP_ACK);
    let before = (kvm_slots(&s), s.device_regions());
    let ram = s.memory().handle();
    ram.memory()
        .write_obj(0x5a5a_u32, GuestAddress(BASE + BLOCK))
        .expect("plugged");
    s.memory().kvm().fail(KvmCall::SetRegion, 2, libc::EIO);
    assert_eq!(s.driver.unplug(BASE + BLOCK, 4), RESP_BUSY);
    assert_eq!((kvm_slots(&s), s.device_regions()), before);
    assert_eq!(
        ram.memory()
            .read_obj::<u32>(GuestAddress(BASE + BLOCK))
            .expect("still plugged"),
        0x5a5a,
        "a refused unplug is one undone change: the blocks keep their memory"
    );
    assert_eq!(s.plugged(), 6 * BLOCK);
    s.memory().kvm().fail(KvmCall::SetRegion, 4, libc::EIO);
    assert_eq!(s.driver.unplug_all(), RESP_BUSY);
    assert_eq!((kvm_slots(&s), s.device_regions()), before);
    assert_eq!(s.driver.unplug_all(), RESP_ACK);
    assert_eq!(kvm_slots(&s), vec![(QUEUE_RAM, 0x10_0000)]);
    assert_eq!(s.driver.device.device().request_counts().busy, 3);
}

#[test]
fn a_device_reset_keeps_plugged_memory_until_unplug_all() {
    let mut s = setup();
    s.driver.init();
    s.driver.device.set_requested_size(4 * BLOCK).expect("fits");
    assert_eq!(s.driver.plug(BASE + BLOCK, 2), RESP_ACK);
    let ram = s.memory().handle();
    ram.memory()
        .write_obj(0x1234_u32, GuestAddress(BASE + 2 * BLOCK))
        .expect("plugged");
    s.driver.write32(STATUS, 0);
    assert_eq!(s.driver.status(), 0);
    assert_eq!(s.driver.device.interrupt_status(), 0);
    // A new driver finds the memory still plugged, and its contents intact.
    s.driver.init();
    assert_eq!(s.plugged(), 2 * BLOCK);
    assert_eq!(s.device_regions(), blocks(&[1, 2]));
    assert_eq!(
        ram.memory()
            .read_obj::<u32>(GuestAddress(BASE + 2 * BLOCK))
            .expect("still plugged"),
        0x1234
    );
    assert_eq!(s.driver.unplug_all(), RESP_ACK);
    assert!(s.device_regions().is_empty());
}

#[test]
fn a_device_needing_more_slots_than_free_is_refused() {
    let memory = Arc::new(MemoryManager::new(FakeKvm::new(40, true)));
    memory
        .add_region(RegionSpec::new(GuestAddress(0), 0x10_0000).with_slot_size(0x1_0000))
        .expect("16 slots");
    let err = VirtioMem::new(
        memory,
        VirtioMemOptions::new(GuestAddress(BASE), 32 * BLOCK, BLOCK).with_max_slot_size(BLOCK),
    )
    .unwrap_err();
    assert_eq!(
        err.to_string(),
        "the device region needs 32 KVM slots (one per block) but only 24 are free"
    );
}

// ---- Real KVM -----------------------------------------------------------------------------

/// A KVM VM's manager, with the top slot number reserved for probing KVM's slots.
fn kvm_manager(test: &str) -> Option<(Arc<kvm_ioctls::VmFd>, Arc<MemoryManager<KvmVm>>)> {
    if !kvm_test_support::require_kvm(&format!("kvm-virtio-mem::{test}")) {
        return None;
    }
    let kvm = kvm_ioctls::Kvm::new().expect("open /dev/kvm");
    let vm = Arc::new(kvm.create_vm().expect("KVM_CREATE_VM"));
    let kvm_vm = KvmVm::new(&kvm, Arc::clone(&vm)).expect("set up the VM");
    let memory = MemoryManager::with_reserved_slots(kvm_vm, MemoryLimits::for_this_host(), 1)
        .expect("one slot reserved");
    Some((vm, Arc::new(memory)))
}

/// Whether KVM itself has a slot covering `gpa` (probed in the manager's reserved slot).
fn kvm_has_slot(vm: &kvm_ioctls::VmFd, memory: &MemoryManager<KvmVm>, gpa: u64) -> bool {
    kvm_test_support::kvm_has_slot_at(vm, memory.reserved_slots().start, gpa)
}

#[test]
fn kvm_plugged_blocks_are_kvm_slots_and_unplugged_ones_are_not() {
    let test = "kvm_plugged_blocks_are_kvm_slots_and_unplugged_ones_are_not";
    let Some((vm, memory)) = kvm_manager(test) else {
        return;
    };
    memory
        .add_region(RegionSpec::new(GuestAddress(QUEUE_RAM), 0x10_0000))
        .expect("the driver's RAM");
    let mut options =
        VirtioMemOptions::new(GuestAddress(BASE), REGION, BLOCK).with_max_slot_size(BLOCK);
    options.usable_headroom = 8 * MIB;
    let irq = EventFd::new(EFD_NONBLOCK).expect("eventfd");
    let device = VirtioMem::new(Arc::clone(&memory), options)
        .expect("device")
        .into_mmio(Box::new(irq.try_clone().expect("clone")));
    let mut driver = Driver::new(
        device,
        Arc::clone(&memory),
        Layout {
            base: QUEUE_RAM,
            size: 16,
        },
    );
    driver.init();
    driver.device.set_requested_size(6 * BLOCK).expect("fits");
    assert_eq!(irq.read().expect("a config interrupt"), 1);
    assert_eq!(driver.plug(BASE + BLOCK, 3), RESP_ACK);
    assert_eq!(driver.plug(BASE + 6 * BLOCK, 1), RESP_ACK);
    let plugged = [1u64, 2, 3, 6];
    let ram = memory.handle();
    for i in 0..10u64 {
        let first = BASE + i * BLOCK;
        let last = first + BLOCK - 4096;
        let is = plugged.contains(&i);
        assert_eq!(kvm_has_slot(&vm, &memory, first), is, "block {i} start");
        assert_eq!(kvm_has_slot(&vm, &memory, last), is, "block {i} end");
        if is {
            ram.memory()
                .write_obj(i * 7 + 1, GuestAddress(last + 64))
                .expect("plugged memory is writable");
        }
    }
    for i in plugged {
        let at = GuestAddress(BASE + i * BLOCK + BLOCK - 4096 + 64);
        assert_eq!(
            ram.memory().read_obj::<u64>(at).expect("readable"),
            i * 7 + 1
        );
    }
    assert_eq!(driver.unplug(BASE + 2 * BLOCK, 2), RESP_ACK);
    assert!(kvm_has_slot(&vm, &memory, BASE + BLOCK));
    assert!(!kvm_has_slot(&vm, &memory, BASE + 2 * BLOCK));
    assert!(!kvm_has_slot(&vm, &memory, BASE + 3 * BLOCK));
    assert!(kvm_has_slot(&vm, &memory, BASE + 6 * BLOCK));
    assert_eq!(driver.unplug_all(), RESP_ACK);
    for i in 0..10u64 {
        assert!(!kvm_has_slot(&vm, &memory, BASE + i * BLOCK), "block {i}");
    }
    assert!(kvm_has_slot(&vm, &memory, QUEUE_RAM));
}

/// Real-mode code at `CODE`: write 0x5a to the first byte of each of `blocks`, read it back
/// and report it on port 0x10, then halt. Each block address must lie below 1 MiB.
fn guest_program(blocks: &[u64]) -> Vec<u8> {
    let mut code = Vec::new();
    for &gpa in blocks {
        let segment = (gpa >> 4) as u16;
        code.push(0xb8); // mov ax, segment
        code.extend(segment.to_le_bytes());
        code.extend([0x8e, 0xd8]); // mov ds, ax
        code.extend([0xc6, 0x06, 0x00, 0x00, 0x5a]); // mov byte [0], 0x5a
        code.extend([0xa0, 0x00, 0x00]); // mov al, [0]
        code.extend([0xe6, 0x10]); // out 0x10, al
    }
    code.push(0xf4); // hlt
    code
}

#[test]
fn kvm_a_guest_uses_plugged_blocks_and_exits_on_unplugged_ones() {
    guest_uses_plugged_blocks(
        "kvm_a_guest_uses_plugged_blocks_and_exits_on_unplugged_ones",
        1,
    );
}

/// The same with the four blocks in one piece: the plugged ones in two slots of one region,
/// the unplugged ones its holes, mapped on the host but no memory for the guest.
#[test]
fn kvm_a_guest_exits_on_unplugged_blocks_between_plugged_ones_of_a_slot_piece() {
    guest_uses_plugged_blocks(
        "kvm_a_guest_exits_on_unplugged_blocks_between_plugged_ones_of_a_slot_piece",
        4,
    );
}

/// Plugs two of four blocks (`blocks_per_slot` to a piece) and has a real-mode guest touch
/// all four.
fn guest_uses_plugged_blocks(test: &str, blocks_per_slot: u64) {
    let Some((vm, memory)) = kvm_manager(test) else {
        return;
    };
    // RAM below 512 KiB holds the code and the driver's queue; the device's region is the
    // 256 KiB above it, in 64 KiB blocks, so that real mode reaches all of it.
    const CODE: u64 = 0x1000;
    const DEV: u64 = 0x8_0000;
    const BLK: u64 = 0x1_0000;
    memory
        .add_region(RegionSpec::new(GuestAddress(0), DEV))
        .expect("low RAM");
    let mut options = VirtioMemOptions::new(GuestAddress(DEV), 4 * BLK, BLK)
        .with_max_slot_size(blocks_per_slot * BLK);
    options.requested_size = 2 * BLK;
    let device = VirtioMem::new(Arc::clone(&memory), options)
        .expect("device")
        .into_mmio(Box::new(EventFd::new(EFD_NONBLOCK).expect("eventfd")));
    let mut driver = Driver::new(
        device,
        Arc::clone(&memory),
        Layout {
            base: 0x4_0000,
            size: 8,
        },
    );
    driver.init();
    assert_eq!(driver.plug(DEV, 1), RESP_ACK);
    assert_eq!(driver.plug(DEV + 2 * BLK, 1), RESP_ACK);
    assert_eq!(
        driver.plug(DEV + 3 * BLK, 1),
        RESP_NACK,
        "past the requested size"
    );

    let targets = [DEV, DEV + BLK, DEV + 2 * BLK, DEV + 3 * BLK];
    memory
        .handle()
        .memory()
        .write_slice(&guest_program(&targets), GuestAddress(CODE))
        .expect("load the code");
    let mut vcpu = vm.create_vcpu(0).expect("KVM_CREATE_VCPU");
    kvm_test_support::start_in_real_mode(&vcpu, CODE);
    let mut reported = Vec::new();
    let mut mmio_writes = Vec::new();
    let mut mmio_reads = Vec::new();
    loop {
        match vcpu.run().expect("KVM_RUN") {
            kvm_ioctls::VcpuExit::IoOut(0x10, data) => reported.push(data[0]),
            kvm_ioctls::VcpuExit::MmioWrite(addr, _) => mmio_writes.push(addr),
            kvm_ioctls::VcpuExit::MmioRead(addr, data) => {
                data.fill(0);
                mmio_reads.push(addr);
            }
            kvm_ioctls::VcpuExit::Hlt => break,
            other => panic!("unexpected exit {other:?}"),
        }
    }
    // Plugged blocks: the guest's write lands in memory and reads back. Unplugged ones: each
    // access leaves the guest as MMIO (no KVM slot), and reads back what the VMM said.
    assert_eq!(reported, [0x5a, 0, 0x5a, 0]);
    assert_eq!(mmio_writes, [DEV + BLK, DEV + 3 * BLK]);
    assert_eq!(mmio_reads, [DEV + BLK, DEV + 3 * BLK]);
    let ram = memory.handle().memory();
    assert_eq!(
        ram.read_obj::<u8>(GuestAddress(DEV)).expect("plugged"),
        0x5a
    );
    assert_eq!(
        ram.read_obj::<u8>(GuestAddress(DEV + 2 * BLK))
            .expect("plugged"),
        0x5a
    );
    assert!(ram.read_obj::<u8>(GuestAddress(DEV + BLK)).is_err());
    let regions = driver.device.device().plugged_blocks();
    assert_eq!(
        regions[0].region == regions[1].region,
        blocks_per_slot == 4,
        "one region for the piece"
    );
}
