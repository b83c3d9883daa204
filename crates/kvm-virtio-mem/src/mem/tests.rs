//! The device against the fake KVM: options, requests, failures mid-request, the
//! configuration space.
#![allow(clippy::single_range_in_vec_init)]

use std::sync::Arc;

use kvm_memslots::testing::{FakeKvm, Faulty, KvmCall};
use kvm_memslots::{MemoryManager, RegionSpec};
use vm_memory::Bytes;
use vm_memory::GuestAddress;

use super::request::{Request, Response};
use super::*;
use crate::mmio::VirtioDevice;

const MIB: u64 = 1 << 20;
const BASE: u64 = 1 << 32;

fn device(kvm_slots: u32) -> VirtioMem<Faulty<FakeKvm>> {
    let memory = Arc::new(MemoryManager::new(Faulty::new(FakeKvm::new(
        kvm_slots, true,
    ))));
    // Each block its own region and slot: the scheme these tests were written for.
    let mut options =
        VirtioMemOptions::new(GuestAddress(BASE), 64 * MIB, 2 * MIB).with_max_slot_size(2 * MIB);
    options.usable_headroom = 8 * MIB;
    VirtioMem::new(memory, options).expect("valid device")
}

fn plug(addr: u64, blocks: u16) -> Request {
    Request::Plug { addr, blocks }
}

#[test]
fn options_are_checked() {
    let memory = Arc::new(MemoryManager::new(FakeKvm::new(64, true)));
    // The options' own rules are `validate`'s: what it refuses, the device refuses alike.
    let new = |o: VirtioMemOptions| {
        let made = VirtioMem::new(Arc::clone(&memory), o).map(drop);
        if let Err(e) = o.validate() {
            assert_eq!(made, Err(e));
        }
        made
    };
    let o =
        VirtioMemOptions::new(GuestAddress(BASE), 64 * MIB, 2 * MIB).with_max_slot_size(2 * MIB);
    assert_eq!(
        new(VirtioMemOptions {
            block_size: 3 * MIB,
            ..o
        }),
        Err(Error::BlockSize(3 * MIB))
    );
    assert_eq!(
        new(VirtioMemOptions {
            block_size: 2048,
            ..o
        }),
        Err(Error::BlockSize(2048))
    );
    assert!(matches!(
        new(VirtioMemOptions {
            addr: GuestAddress(BASE + MIB),
            ..o
        }),
        Err(Error::Unaligned {
            what: "region base",
            ..
        })
    ));
    assert_eq!(
        new(VirtioMemOptions {
            region_size: 0,
            ..o
        }),
        Err(Error::EmptyRegion)
    );
    assert!(matches!(
        new(VirtioMemOptions {
            addr: GuestAddress(u64::MAX - 2 * MIB + 1),
            region_size: 4 * MIB,
            ..o
        }),
        Err(Error::WrapAround { .. })
    ));
    assert_eq!(
        new(VirtioMemOptions {
            queue_size: 100,
            ..o
        }),
        Err(Error::QueueSize(100))
    );
    // Blocks of 2 MiB pages are whole huge pages.
    let huge = o.with_page_size(kvm_memslots::PageSize::Huge2M);
    let err = new(VirtioMemOptions {
        block_size: MIB,
        max_slot_size: MIB,
        ..huge
    })
    .unwrap_err();
    assert_eq!(
        err.to_string(),
        "block size 0x100000 is not a multiple of the 2m host pages behind the blocks (0x200000)"
    );
    new(huge).expect("2 MiB blocks of 2 MiB pages");
    let err = new(VirtioMemOptions {
        region_size: 130 * MIB,
        ..o
    })
    .unwrap_err();
    assert_eq!(
        err,
        Error::NotEnoughSlots {
            needed: 65,
            free: 64
        }
    );
    assert_eq!(
        err.to_string(),
        "the device region needs 65 KVM slots (one per block) but only 64 are free"
    );
    memory
        .add_region(RegionSpec::new(GuestAddress(BASE + 62 * MIB), 4 * MIB))
        .expect("add a region");
    assert!(matches!(new(o), Err(Error::Overlap { .. })));
    // What depends on the memory the device is made over is not the options' own rules.
    o.validate()
        .expect("valid options, whatever the memory holds");
    VirtioMemOptions {
        region_size: 130 * MIB,
        ..o
    }
    .validate()
    .expect("valid options, whatever slots are free");
    assert_eq!(
        o.with_max_slot_size(3 * MIB).validate(),
        Err(Error::MaxSlotSize {
            max_slot_size: 3 * MIB,
            block_size: 2 * MIB
        })
    );
}

#[test]
fn requests_are_answered_as_the_specification_says() {
    let mut d = device(64);
    d.set_requested_size(8 * MIB).expect("aligned and in range");
    assert_eq!(d.usable_region_size(), 16 * MIB);
    assert_eq!(d.handle(plug(BASE, 2)), (Response::ACK, true));
    assert_eq!(d.plugged_size(), 4 * MIB);
    assert_eq!(
        d.handle(plug(BASE, 1)).0,
        Response::ERROR,
        "already plugged"
    );
    assert_eq!(
        d.handle(plug(BASE + MIB, 1)).0,
        Response::ERROR,
        "unaligned"
    );
    assert_eq!(
        d.handle(plug(BASE + 4 * MIB, 0)).0,
        Response::ERROR,
        "no blocks"
    );
    assert_eq!(
        d.handle(plug(BASE - 2 * MIB, 1)).0,
        Response::ERROR,
        "below"
    );
    assert_eq!(
        d.handle(plug(BASE + 16 * MIB, 1)).0,
        Response::ERROR,
        "past usable"
    );
    assert_eq!(
        d.handle(plug(BASE + 14 * MIB, 2)).0,
        Response::ERROR,
        "straddles"
    );
    assert_eq!(
        d.handle(plug(BASE + 4 * MIB, 3)),
        (Response::NACK, false),
        "past requested"
    );
    assert_eq!(d.handle(plug(BASE + 4 * MIB, 2)).0, Response::ACK);
    assert_eq!(
        d.handle(Request::State {
            addr: BASE,
            blocks: 5
        })
        .0,
        Response {
            kind: VIRTIO_MEM_RESP_ACK,
            state: VIRTIO_MEM_STATE_MIXED
        }
    );
    assert_eq!(
        d.handle(Request::State {
            addr: BASE + 4 * MIB,
            blocks: 2
        })
        .0
        .state,
        VIRTIO_MEM_STATE_PLUGGED
    );
    assert_eq!(
        d.handle(Request::State {
            addr: BASE + 8 * MIB,
            blocks: 4
        })
        .0
        .state,
        VIRTIO_MEM_STATE_UNPLUGGED
    );
    assert_eq!(
        d.handle(Request::Unplug {
            addr: BASE + 6 * MIB,
            blocks: 2
        })
        .0,
        Response::ERROR
    );
    assert_eq!(
        d.handle(Request::Unplug {
            addr: BASE + 2 * MIB,
            blocks: 1
        })
        .0,
        Response::ACK
    );
    assert_eq!(d.plugged_size(), 6 * MIB);
    assert_eq!(d.handle(Request::Unknown(9)).0, Response::ERROR);
    d.set_requested_size(0).expect("zero is fine");
    assert_eq!(
        d.usable_region_size(),
        16 * MIB,
        "the usable region does not shrink"
    );
    assert_eq!(d.handle(Request::UnplugAll), (Response::ACK, true));
    assert_eq!(d.plugged_size(), 0);
    assert_eq!(d.usable_region_size(), 8 * MIB, "UNPLUG_ALL shrinks it");
    assert!(d.memory().regions().is_empty());
    assert_eq!(
        d.request_counts(),
        RequestCounts {
            ack: 7,
            nack: 1,
            busy: 0,
            error: 8
        }
    );
}

#[test]
fn set_requested_size_checks_and_names_the_values() {
    let mut d = device(64);
    let err = d.set_requested_size(MIB).unwrap_err();
    assert_eq!(
        err.to_string(),
        "requested size 0x100000 is not a multiple of the block size 0x200000"
    );
    let err = d.set_requested_size(66 * MIB).unwrap_err();
    assert_eq!(
        err.to_string(),
        "requested size 0x4200000 is larger than the region size 0x4000000"
    );
    assert_eq!(d.requested_size(), 0);
    d.set_requested_size(60 * MIB).expect("fits");
    assert_eq!(d.usable_region_size(), 64 * MIB, "capped at the region");
}

#[test]
fn a_kvm_failure_mid_plug_or_unplug_changes_nothing() {
    let mut d = device(64);
    d.set_requested_size(16 * MIB).expect("fits");
    assert_eq!(d.handle(plug(BASE, 1)).0, Response::ACK);
    let before = d.memory().kvm().inner().slots();
    // The third block's slot is refused.
    d.memory().kvm().fail(KvmCall::SetRegion, 2, libc_eio());
    assert_eq!(d.handle(plug(BASE + 2 * MIB, 4)), (Response::BUSY, false));
    assert!(!d.memory().kvm().failure_pending());
    assert_eq!(d.memory().kvm().inner().slots(), before);
    assert_eq!(d.plugged_blocks().len(), 1);
    assert_eq!(d.plugged_size(), 2 * MIB);
    assert_eq!(d.handle(plug(BASE + 2 * MIB, 4)).0, Response::ACK);
    let ranges = |d: &VirtioMem<Faulty<FakeKvm>>| {
        let mut r: Vec<_> = d
            .memory()
            .kvm()
            .inner()
            .slots()
            .iter()
            .map(|s| (s.gpa, s.size))
            .collect();
        r.sort();
        r
    };
    let before = ranges(&d);
    d.memory().kvm().fail(KvmCall::SetRegion, 3, libc_eio());
    assert_eq!(
        d.handle(Request::Unplug {
            addr: BASE + 2 * MIB,
            blocks: 4
        })
        .0,
        Response::BUSY
    );
    assert_eq!(ranges(&d), before);
    assert_eq!(d.plugged_size(), 10 * MIB);
    d.memory().kvm().fail(KvmCall::SetRegion, 1, libc_eio());
    assert_eq!(d.handle(Request::UnplugAll), (Response::BUSY, false));
    assert_eq!(ranges(&d), before);
    assert_eq!(d.handle(Request::UnplugAll).0, Response::ACK);
    assert!(d.memory().kvm().inner().slots().is_empty());
}

fn libc_eio() -> i32 {
    5
}

#[test]
fn config_space_layout() {
    let mut d = device(64);
    d.set_requested_size(4 * MIB).expect("fits");
    assert_eq!(d.handle(plug(BASE, 1)).0, Response::ACK);
    let mut space = [0xaau8; 64];
    d.read_config(0, &mut space);
    let le = |at: usize| u64::from_le_bytes(space[at..at + 8].try_into().expect("8 bytes"));
    assert_eq!(le(0), 2 * MIB);
    assert_eq!(&space[8..16], &[0; 8], "node_id and padding");
    assert_eq!(le(16), BASE);
    assert_eq!(le(24), 64 * MIB);
    assert_eq!(le(32), 12 * MIB);
    assert_eq!(le(40), 2 * MIB);
    assert_eq!(le(48), 4 * MIB);
    assert_eq!(&space[56..], &[0; 8], "past the end");
    let mut word = [0u8; 4];
    d.read_config(20, &mut word);
    assert_eq!(u32::from_le_bytes(word), 1, "high half of addr");
    d.read_config(u64::MAX, &mut word);
    assert_eq!(word, [0; 4]);
}

/// `memory`'s regions as a restore rebuilds them from a layout: the same ids, holes and slots.
fn as_rebuilt(memory: &MemoryManager<FakeKvm>) -> Vec<RegionSpec> {
    memory
        .regions()
        .iter()
        .map(|r| {
            RegionSpec::new(r.gpa, r.size)
                .with_id(r.id)
                .with_slot_ranges(memory.slot_ranges(r.id).expect("its slots"))
        })
        .collect()
}

/// A device restored from a saved state over memory with the plugged blocks' regions (as a
/// restore rebuilds them from the layout: ids, holes and slots): the same blocks plugged in the
/// same regions, the same sizes; a memory map that does not hold exactly what the plugged
/// blocks need is refused by name. With shared slots (pieces of 16 MiB) and with one slot per
/// block.
#[test]
fn a_saved_state_restores_over_the_plugged_blocks_regions_and_nothing_else() {
    for max_slot in [16 * MIB, 2 * MIB] {
        let mut options = VirtioMemOptions::new(GuestAddress(BASE), 64 * MIB, 2 * MIB)
            .with_max_slot_size(max_slot);
        options.usable_headroom = 8 * MIB;
        let memory = Arc::new(MemoryManager::new(FakeKvm::new(64, true)));
        let mut dev = VirtioMem::new(Arc::clone(&memory), options).expect("valid device");
        dev.set_requested_size(16 * MIB).expect("requested");
        assert_eq!(dev.handle(plug(BASE, 2)).0, Response::ACK);
        assert_eq!(dev.handle(plug(BASE + 8 * MIB, 1)).0, Response::ACK);
        let state = dev.state();
        assert_eq!(state.plugged, vec![[0, 2], [4, 5]]);
        assert_eq!(state.requested_size, 16 * MIB);
        let blocks = dev.plugged_blocks();
        // Memory as a restore rebuilds it: the same regions, ids, holes and slots; `skip`
        // leaves the last region out, `extra` adds one.
        let specs = as_rebuilt(&memory);
        let rebuilt = |skip: bool, extra: Option<RegionSpec>| {
            let memory = Arc::new(MemoryManager::new(FakeKvm::new(64, true)));
            let mut specs = specs.clone();
            if skip {
                specs.pop();
            }
            specs.extend(extra);
            memory.add_regions(specs).expect("the regions");
            memory
        };
        let back = VirtioMem::restore(rebuilt(false, None), options, &state).expect("restored");
        assert_eq!(back.state(), state);
        assert_eq!(back.plugged_blocks(), blocks);
        assert_eq!(back.plugged_size(), 3 * 2 * MIB);
        let refused =
            |memory, state: &VirtioMemState| match VirtioMem::restore(memory, options, state) {
                Err(Error::State(why)) => why,
                other => panic!("expected a refusal, got {other:?}"),
            };
        // Without the last region: block 4's (one slot a block), or the one piece's.
        let missing = refused(rebuilt(true, None), &state);
        let first_missing = if max_slot == 2 * MIB {
            "block 4 at 0x100800000 is plugged, but the memory has no region there"
        } else {
            "block 0 at 0x100000000 is plugged, but the memory has no region there"
        };
        assert!(missing.contains(first_missing), "{missing}");
        let stray = RegionSpec::new(GuestAddress(BASE + 48 * MIB), max_slot);
        let unplugged = refused(rebuilt(false, Some(stray)), &state);
        assert!(
            unplugged.contains("whose blocks the state says are all unplugged"),
            "{unplugged}"
        );
        let odd = RegionSpec::new(GuestAddress(BASE + 50 * MIB), 2 * MIB);
        if max_slot != 2 * MIB {
            let why = refused(rebuilt(false, Some(odd)), &state);
            assert!(why.contains("is not one of its pieces"), "{why}");
        }
        // One more block plugged than the memory has: with a region per block, block 2's is
        // missing; a piece's one slot over it all says nothing of which blocks are plugged.
        let more = VirtioMemState {
            plugged: vec![[0, 3], [4, 5]],
            ..state.clone()
        };
        if max_slot == 2 * MIB {
            let why = refused(rebuilt(false, None), &more);
            assert!(
                why.contains("block 2 at 0x100400000 is plugged, but"),
                "{why}"
            );
        }
        // Slots that are neither the whole piece nor its plugged runs.
        if max_slot != 2 * MIB {
            let memory = Arc::new(MemoryManager::new(FakeKvm::new(64, true)));
            let mut specs = specs.clone();
            specs[0] = specs[0].clone().with_slot_ranges(vec![0..2 * MIB]);
            memory.add_regions(specs).expect("the regions");
            let why = refused(memory, &state);
            assert!(why.contains("its plugged blocks need"), "{why}");
        }
        let overlapping = VirtioMemState {
            plugged: vec![[0, 2], [1, 5]],
            ..state.clone()
        };
        let why = refused(rebuilt(false, None), &overlapping);
        assert!(
            why.contains("plugged blocks 1..5 are not an ascending range"),
            "{why}"
        );
        let beyond = VirtioMemState {
            usable_region_size: 65 * MIB,
            ..state.clone()
        };
        let why = refused(rebuilt(false, None), &beyond);
        assert!(why.contains("usable region size 0x4100000"), "{why}");
    }
}

/// A state records the maximum slot size its pieces were cut by, and a restore takes it over
/// the options' (a VMM whose default changed since the save still restores); a state without
/// it (saved before it was recorded) takes the options'.
#[test]
fn a_state_restores_with_the_max_slot_size_it_was_saved_with() {
    let options = |max_slot: u64| {
        VirtioMemOptions::new(GuestAddress(BASE), 64 * MIB, 2 * MIB).with_max_slot_size(max_slot)
    };
    let memory = Arc::new(MemoryManager::new(FakeKvm::new(64, true)));
    let mut dev = VirtioMem::new(Arc::clone(&memory), options(16 * MIB)).expect("valid device");
    dev.set_requested_size(16 * MIB).expect("requested");
    assert_eq!(dev.slots(), 0);
    assert_eq!(dev.handle(plug(BASE, 3)).0, Response::ACK);
    assert_eq!(dev.handle(plug(BASE + 8 * MIB, 1)).0, Response::ACK);
    assert_eq!(dev.slots(), 1, "one slot over the 16 MiB piece");
    let state = dev.state();
    assert_eq!(state.max_slot_size, Some(16 * MIB));
    let rebuilt = || {
        let again = Arc::new(MemoryManager::new(FakeKvm::new(64, true)));
        again.add_regions(as_rebuilt(&memory)).expect("the regions");
        again
    };
    let back = VirtioMem::restore(rebuilt(), options(2 * MIB), &state).expect("restored");
    assert_eq!(back.max_slot_size(), 16 * MIB);
    assert_eq!(back.state(), state);
    assert_eq!(back.slots(), 1);
    let older = VirtioMemState {
        max_slot_size: None,
        ..state.clone()
    };
    assert!(
        VirtioMem::restore(rebuilt(), options(2 * MIB), &older).is_err(),
        "one slot per block does not fit 16 MiB pieces"
    );
    let back = VirtioMem::restore(rebuilt(), options(16 * MIB), &older).expect("restored");
    assert_eq!(back.max_slot_size(), 16 * MIB);
}

/// Under a slot budget (`MemoryLimits::max_slots`), a plug that would need a slot more than
/// the budget leaves is refused (BUSY, nothing changed; the manager's error names the budget),
/// while one inside a piece with a plugged block goes through: the piece's one slot covers it
/// already, so no plug inside it needs a slot.
#[test]
fn a_plug_over_the_slot_budget_is_refused_unless_its_piece_has_a_slot() {
    let limits = kvm_memslots::MemoryLimits {
        max_slots: 1,
        ..kvm_memslots::MemoryLimits::unlimited()
    };
    let memory = Arc::new(MemoryManager::with_limits(FakeKvm::new(64, true), limits));
    let options =
        VirtioMemOptions::new(GuestAddress(BASE), 64 * MIB, 2 * MIB).with_max_slot_size(16 * MIB);
    let mut dev = VirtioMem::new(Arc::clone(&memory), options).expect("valid device");
    dev.set_requested_size(64 * MIB).expect("requested");
    assert_eq!(dev.handle(plug(BASE, 1)).0, Response::ACK);
    assert_eq!(dev.handle(plug(BASE + 4 * MIB, 1)).0, Response::ACK);
    assert_eq!((dev.slots(), memory.slot_usage().used), (1, 1));
    let before = (dev.plugged_blocks(), memory.regions());
    // A block in another piece: a slot over the budget.
    assert_eq!(dev.last_busy(), None);
    assert_eq!(dev.handle(plug(BASE + 32 * MIB, 1)).0, Response::BUSY);
    assert_eq!((dev.plugged_blocks(), memory.regions()), before);
    // The guest learns BUSY; whoever watches the device learns why.
    let why = dev.last_busy().expect("a reason");
    assert!(why.contains("over the limit max_slots = 1"), "{why}");
    // Anywhere in the first piece: no slot more.
    assert_eq!(dev.handle(plug(BASE + 8 * MIB, 1)).0, Response::ACK);
    assert_eq!(dev.handle(plug(BASE + 12 * MIB, 2)).0, Response::ACK);
    assert_eq!((dev.slots(), memory.slot_usage().used), (1, 1));
    assert_eq!(dev.request_counts().busy, 1);
}

/// Whether the host lets the process read the page at `hva`: its mapping's permissions in
/// `/proc/self/maps` (the crate has no unsafe code to try it).
fn host_readable(hva: u64) -> bool {
    let maps = std::fs::read_to_string("/proc/self/maps").expect("/proc/self/maps");
    for line in maps.lines() {
        let mut fields = line.split_whitespace();
        let (range, perms) = (fields.next().unwrap(), fields.next().unwrap());
        let (start, end) = range.split_once('-').unwrap();
        let start = u64::from_str_radix(start, 16).unwrap();
        let end = u64::from_str_radix(end, 16).unwrap();
        if (start..end).contains(&hva) {
            return perms.starts_with('r');
        }
    }
    panic!("no mapping at {hva:#x}");
}

/// A device of 16 MiB pieces over a manager on the fake KVM, 32 MiB requested.
fn pieces_device() -> VirtioMem<Faulty<FakeKvm>> {
    let memory = Arc::new(MemoryManager::new(Faulty::new(FakeKvm::new(64, true))));
    let options =
        VirtioMemOptions::new(GuestAddress(BASE), 64 * MIB, 2 * MIB).with_max_slot_size(16 * MIB);
    let mut d = VirtioMem::new(memory, options).expect("valid device");
    d.set_requested_size(32 * MIB).expect("requested");
    d
}

/// Host address of guest address `gpa` in the device's piece there.
fn hva(d: &VirtioMem<Faulty<FakeKvm>>, gpa: u64) -> u64 {
    let piece = (gpa - BASE) / (16 * MIB);
    let region = d
        .memory()
        .regions()
        .into_iter()
        .find(|r| r.gpa.0 == BASE + piece * 16 * MIB)
        .expect("the piece's region");
    d.memory().region_memory(region.id).unwrap().host_address() + (gpa - region.gpa.0)
}

/// A piece keeps one slot over all of it from its first plug to its last unplug; plugs and
/// unplugs inside it make no KVM call, and its unplugged blocks are unreachable (protected,
/// their memory given back: a plug finds zeros).
#[test]
fn a_piece_has_one_slot_and_plugs_inside_it_make_no_kvm_call() {
    let mut d = pieces_device();
    let memory = Arc::clone(d.memory());
    let fake = || memory.kvm().inner().set_calls();
    assert_eq!(d.handle(plug(BASE + 2 * MIB, 1)).0, Response::ACK);
    assert_eq!(fake(), 1, "the piece's one slot");
    let region = d.plugged_blocks()[0].region;
    assert_eq!(d.memory().slot_ranges(region), Some(vec![0..16 * MIB]));
    assert_eq!(d.slots(), 1);
    let (plugged, unplugged) = (BASE + 2 * MIB, BASE + 4 * MIB);
    assert!(host_readable(hva(&d, plugged)));
    assert!(!host_readable(hva(&d, unplugged)));
    assert!(!host_readable(hva(&d, BASE)));
    assert_eq!(
        d.unplugged_under_slot(GuestAddress(unplugged + 8)),
        Some(GuestAddress(unplugged))
    );
    assert_eq!(d.unplugged_under_slot(GuestAddress(plugged)), None);
    assert_eq!(
        d.unplugged_under_slot(GuestAddress(BASE + 32 * MIB)),
        None,
        "no piece there"
    );
    let mem = d.memory().current();
    mem.write_obj(0x77u64, GuestAddress(plugged)).unwrap();
    assert!(
        mem.read_obj::<u64>(GuestAddress(unplugged)).is_err(),
        "a device is refused it"
    );
    // Plugs and unplugs inside the live piece: no KVM call, the slot as it was.
    for request in [
        plug(unplugged, 2),
        Request::Unplug {
            addr: plugged,
            blocks: 1,
        },
        plug(BASE + 14 * MIB, 1),
        Request::Unplug {
            addr: unplugged,
            blocks: 1,
        },
    ] {
        assert_eq!(d.handle(request).0, Response::ACK, "{request:?}");
    }
    assert_eq!(fake(), 1, "no KVM call inside a live piece");
    assert_eq!(d.memory().slot_ranges(region), Some(vec![0..16 * MIB]));
    assert!(!host_readable(hva(&d, plugged)));
    assert!(host_readable(hva(&d, BASE + 6 * MIB)));
    // Plugged again: zeros, not what the guest left there.
    assert_eq!(d.handle(plug(plugged, 1)).0, Response::ACK);
    assert_eq!(
        d.memory()
            .current()
            .read_obj::<u64>(GuestAddress(plugged))
            .unwrap(),
        0
    );
    // The last unplug removes the piece (its slot goes with it).
    assert_eq!(d.handle(Request::UnplugAll).0, Response::ACK);
    assert_eq!(fake(), 2);
    assert!(d.memory().regions().is_empty());
}

/// A piece isolated after a fault at one of its unplugged blocks has the runs of its plugged
/// blocks as slots (the block has none, so an access exits as absent memory); its next plug
/// gives it back its one slot. A plug the manager refuses there leaves its blocks unplugged
/// and unreachable.
#[test]
fn an_isolated_piece_gets_its_one_slot_back_on_the_next_plug() {
    let mut d = pieces_device();
    assert_eq!(d.handle(plug(BASE, 2)).0, Response::ACK);
    assert_eq!(d.handle(plug(BASE + 16 * MIB, 1)).0, Response::ACK);
    let region = d.plugged_blocks()[0].region;
    assert_eq!(
        d.isolate_unplugged(Some(GuestAddress(BASE))).unwrap(),
        0,
        "plugged"
    );
    assert_eq!(
        d.isolate_unplugged(Some(GuestAddress(BASE + 8 * MIB)))
            .unwrap(),
        1
    );
    assert_eq!(d.memory().slot_ranges(region), Some(vec![0..4 * MIB]));
    assert_eq!(d.unplugged_under_slot(GuestAddress(BASE + 8 * MIB)), None);
    assert_eq!(d.slots(), 2);
    // A fault that says nothing of where: every piece with an unplugged block.
    assert_eq!(d.isolate_unplugged(None).unwrap(), 1, "the other piece");
    assert_eq!(d.slots(), 2);
    // The manager refuses the re-slot: BUSY, the block unplugged and unreachable still.
    d.memory().kvm().fail(KvmCall::SetRegion, 0, libc::ENOMEM);
    assert_eq!(d.handle(plug(BASE + 4 * MIB, 1)).0, Response::BUSY);
    assert!(!host_readable(hva(&d, BASE + 4 * MIB)));
    assert_eq!(d.memory().slot_ranges(region), Some(vec![0..4 * MIB]));
    d.memory().kvm().heal();
    assert_eq!(d.handle(plug(BASE + 4 * MIB, 1)).0, Response::ACK);
    assert_eq!(d.memory().slot_ranges(region), Some(vec![0..16 * MIB]));
    assert!(host_readable(hva(&d, BASE + 4 * MIB)));
    assert!(!host_readable(hva(&d, BASE + 6 * MIB)));
    assert_eq!(d.slots(), 2);
}

/// A restore makes the unplugged blocks unreachable again (the memory layout does not carry
/// protection), and takes an isolated piece's slots as they were.
#[test]
fn a_restore_makes_unplugged_blocks_unreachable_again() {
    let mut d = pieces_device();
    assert_eq!(d.handle(plug(BASE, 2)).0, Response::ACK);
    assert_eq!(d.handle(plug(BASE + 16 * MIB, 1)).0, Response::ACK);
    d.isolate_unplugged(Some(GuestAddress(BASE + 20 * MIB)))
        .unwrap();
    let state = d.state();
    let memory = Arc::new(MemoryManager::new(FakeKvm::new(64, true)));
    memory
        .add_regions(
            d.memory()
                .regions()
                .iter()
                .map(|r| {
                    RegionSpec::new(r.gpa, r.size)
                        .with_id(r.id)
                        .with_slot_ranges(d.memory().slot_ranges(r.id).unwrap())
                })
                .collect::<Vec<_>>(),
        )
        .unwrap();
    let options =
        VirtioMemOptions::new(GuestAddress(BASE), 64 * MIB, 2 * MIB).with_max_slot_size(16 * MIB);
    let back = VirtioMem::restore(Arc::clone(&memory), options, &state).expect("restored");
    assert_eq!(back.slots(), 2);
    let memory_of = |gpa: u64| {
        let r = memory
            .regions()
            .into_iter()
            .find(|r| r.gpa.0 == gpa)
            .unwrap();
        memory.region_memory(r.id).unwrap()
    };
    assert_eq!(memory_of(BASE).inaccessible(), vec![4 * MIB..16 * MIB]);
    assert_eq!(
        memory_of(BASE + 16 * MIB).inaccessible(),
        vec![2 * MIB..16 * MIB]
    );
    assert_eq!(
        back.unplugged_under_slot(GuestAddress(BASE + 8 * MIB)),
        Some(GuestAddress(BASE + 8 * MIB))
    );
    assert_eq!(
        back.unplugged_under_slot(GuestAddress(BASE + 20 * MIB)),
        None,
        "isolated"
    );
}
