use std::collections::BTreeMap;

use super::*;
use crate::control::ErrorKind;
use kvm_memslots::testing::FakeKvm;

const GPA: u64 = 32 << 30;
const LIMIT: u64 = 64 << 30;

fn area(total: u64, block: u64, slot: Option<u64>) -> HotplugArea {
    let config = HotplugConfig {
        total_size_mib: total,
        block_size_mib: block,
        slot_size_mib: slot,
        page_size: Default::default(),
    };
    HotplugArea::new(config, GPA, LIMIT, 1000).unwrap()
}

/// A region as the plans see it: its guest address, its slots and its unreachable byte
/// ranges.
type Piece = (u64, Vec<Range<u64>>, Vec<Range<u64>>);

/// The manager as the plans see it.
#[derive(Default)]
struct Model {
    regions: BTreeMap<RegionId, Piece>,
    next: u64,
}

impl Model {
    /// Carries `plan` out as the manager would its reachability changes and its changes,
    /// then commits it on `area`.
    fn carry_out(&mut self, area: &mut HotplugArea, plan: &HotplugPlan) {
        for (region, range, reachable) in area.flips(plan) {
            let piece = self.regions.get_mut(&region).expect("known");
            let mut bytes: Vec<bool> = (0..area.slot_size / MIB)
                .map(|mib| piece.2.iter().any(|r| r.contains(&(mib * MIB))))
                .collect();
            bytes[(range.start / MIB) as usize..(range.end / MIB) as usize].fill(!reachable);
            piece.2 = plugged_runs(bytes, MIB);
        }
        let mut added = Vec::new();
        for change in area.changes(plan) {
            match change {
                RegionChange::Add(spec) => {
                    let index = ((spec.gpa.0 - area.gpa) / area.slot_size) as usize;
                    assert_eq!(spec.size, area.piece_size(index), "a piece is its own size");
                    let id = RegionId(100 + self.next);
                    self.next += 1;
                    let slots = spec.slot_ranges.expect("a piece names its slots");
                    self.regions
                        .insert(id, (spec.gpa.0, slots, spec.inaccessible));
                    added.push(id);
                }
                RegionChange::Reslot(_) => panic!("a plug or unplug re-slots nothing"),
                RegionChange::Remove(id) => {
                    self.regions.remove(&id).expect("known");
                }
            }
        }
        area.commit(plan, added);
    }

    /// Guest ranges the guest reaches (under a slot and not unreachable), lowest first.
    fn reachable(&self) -> Vec<Range<u64>> {
        let mut all: Vec<Range<u64>> = Vec::new();
        for (gpa, slots, unreachable) in self.regions.values() {
            for slot in slots {
                let mut at = slot.start;
                for gone in unreachable.iter().filter(|g| g.start < slot.end) {
                    if gone.start > at {
                        all.push(gpa + at..gpa + gone.start.min(slot.end));
                    }
                    at = at.max(gone.end);
                }
                if at < slot.end {
                    all.push(gpa + at..gpa + slot.end);
                }
            }
        }
        all.sort_by_key(|r| r.start);
        all
    }

    /// KVM slots in all.
    fn slots(&self) -> usize {
        self.regions.values().map(|(_, slots, _)| slots.len()).sum()
    }
}

#[test]
fn configurations_are_checked_with_the_value_named() {
    let config = |total, block, slot| HotplugConfig {
        total_size_mib: total,
        block_size_mib: block,
        slot_size_mib: slot,
        page_size: Default::default(),
    };
    let refuse = |c, free| HotplugArea::new(c, GPA, LIMIT, free).unwrap_err();
    let e = refuse(config(64, 3, None), 100);
    assert_eq!(e.kind, ErrorKind::BadRequest);
    assert!(e.message.contains("block_size_mib 3"), "{e}");
    assert!(refuse(config(64, 1, None), 100)
        .message
        .contains("at least 2"));
    let e = refuse(config(64, 2, Some(5)), 100);
    assert!(e.message.contains("slot_size_mib 5"), "{e}");
    let e = refuse(config(31, 2, Some(8)), 100);
    assert!(e.message.contains("total_size_mib 31"), "{e}");
    // The rules are the request body's (a Linux guest's device obeys them too).
    assert_eq!(
        e.message,
        config(31, 2, Some(8)).validate().unwrap_err().to_string()
    );
    assert!(refuse(config(0, 2, None), 100).message.contains("non-zero"));
    let e = refuse(config(64 << 10, 2, Some(1 << 10)), 100);
    assert!(e.message.contains("does not fit below 0x1000000000"), "{e}");
    let e = refuse(config(u64::MAX / 2 * 2, 2, None), u32::MAX as usize);
    assert_eq!(e.kind, ErrorKind::BadRequest, "{e}");
    let e = refuse(config(64, 2, None), 31);
    assert_eq!(e.kind, ErrorKind::Conflict);
    assert_eq!(
        e.message,
        "the hotplug area needs 32 KVM slots; 31 are free (in KVM and within the slot \
         budget, --max-slots)"
    );
    let a = HotplugArea::new(config(64, 2, Some(8)), GPA, LIMIT, 8).unwrap();
    assert_eq!(
        (a.pieces.len(), a.slot_size, a.blocks_per_slot()),
        (8, 8 << 20, 4)
    );
    assert_eq!(
        area(64, 4, None).slot_size,
        4 << 20,
        "slots default to blocks"
    );
    // A total that is no multiple of the slot size: the last piece is what is left, and
    // counts as a slot.
    let a = HotplugArea::new(config(30, 2, Some(8)), GPA, LIMIT, 4).unwrap();
    assert_eq!((a.pieces.len(), a.piece_size(3)), (4, 6 << 20));
    assert_eq!(a.range(), GPA..GPA + (30 << 20));
    let e = refuse(config(30, 2, Some(8)), 3);
    assert_eq!(e.kind, ErrorKind::Conflict, "{e}");
    // A slot larger than the area: one piece, the whole area.
    let a = area(6, 2, Some(64));
    assert_eq!((a.pieces.len(), a.piece_size(0)), (1, 6 << 20));
}

/// 10 MiB in 2 MiB blocks and 4 MiB slots: pieces of 4, 4 and 2 MiB. Plans, changes and the
/// saved state all take the last piece at its own size, through the manager.
#[test]
fn a_partial_last_piece_is_planned_added_and_saved_at_its_own_size() {
    let mut a = area(10, 2, Some(4));
    assert_eq!(
        (0..3).map(|i| a.piece_size(i)).collect::<Vec<_>>(),
        vec![4 << 20, 4 << 20, 2 << 20]
    );
    let plan = a.plan(10).unwrap();
    assert_eq!(plan.blocks, 5);
    assert_eq!(
        plan.pieces.last(),
        Some(&PieceChange {
            index: 2,
            gpa: GuestAddress(GPA + (8 << 20)),
            region: None,
            before: 0,
            after: 2 << 20,
            slots: vec![0..2 << 20],
            unreachable: vec![],
        })
    );
    let sizes: Vec<u64> = a
        .changes(&plan)
        .iter()
        .map(|c| match c {
            RegionChange::Add(spec) => spec.size,
            other => panic!("a plug adds pieces: {other:?}"),
        })
        .collect();
    assert_eq!(sizes, vec![4 << 20, 4 << 20, 2 << 20]);
    // Carried out through the manager, saved, and checked against the layout.
    let (memory, _) = layout(&[]);
    let failures = a.carry_out(&memory, &plan).expect("plugged");
    assert!(failures.is_empty(), "{failures:?}");
    let layout = MemoryLayout::of(&memory);
    assert_eq!(a.state().validate(&layout), Ok(()));
    // Down to 6 MiB: the second piece keeps its slot, the last goes.
    let down = a.plan(6).unwrap();
    assert_eq!(a.piece_unreachable(1, 3), vec![2 << 20..4 << 20]);
    assert!(matches!(a.changes(&down)[..], [RegionChange::Remove(_)]));
    a.carry_out(&memory, &down).expect("unplugged");
    let layout = MemoryLayout::of(&memory);
    assert_eq!(a.state().validate(&layout), Ok(()));
    assert_eq!(
        memory.regions().len(),
        3,
        "the system region and two pieces"
    );
    // A last piece saved at the slot size is not the area's.
    let (_memory, whole) = layout_of(&[(0, 4), (4, 4), (8, 4)]);
    let state = HotplugState {
        plugged_blocks: 5,
        mapped: vec![true; 3],
        ..a.state()
    };
    let e = state.validate(&whole).expect_err("refused");
    assert!(e.contains("not one of its mapped slots"), "{e}");
    let (_memory, right) = layout_of(&[(0, 4), (4, 4), (8, 2)]);
    assert_eq!(state.validate(&right), Ok(()));
}

/// A 2 MiB system region at 0, and at the hotplug area regions at the `(offset, size)` in MiB.
fn layout_of(pieces: &[(u64, u64)]) -> (MemoryManager<FakeKvm>, MemoryLayout) {
    let memory = MemoryManager::new(FakeKvm::new(64, false));
    memory
        .add_region(RegionSpec::new(GuestAddress(0), 2 * MIB))
        .expect("the system region");
    for (offset, size) in pieces {
        let gpa = GuestAddress(HOTPLUG_GPA + offset * MIB);
        memory
            .add_region(RegionSpec::new(gpa, size * MIB))
            .expect("a piece");
    }
    let layout = MemoryLayout::of(&memory);
    (memory, layout)
}

#[test]
fn a_plug_adds_pieces_with_one_slot_and_their_unplugged_blocks_unreachable() {
    let mut a = area(64, 2, Some(8));
    let mut model = Model::default();
    let plan = a.plan(10).unwrap();
    assert_eq!(plan.blocks, 5);
    assert_eq!(
        plan.pieces,
        vec![
            PieceChange {
                index: 0,
                gpa: GuestAddress(GPA),
                region: None,
                before: 0,
                after: 8 << 20,
                slots: vec![0..8 << 20],
                unreachable: vec![],
            },
            PieceChange {
                index: 1,
                gpa: GuestAddress(GPA + (8 << 20)),
                region: None,
                before: 0,
                after: 2 << 20,
                slots: vec![0..8 << 20],
                unreachable: vec![2 << 20..8 << 20],
            },
        ]
    );
    model.carry_out(&mut a, &plan);
    assert_eq!(
        model.reachable(),
        vec![GPA..GPA + (8 << 20), GPA + (8 << 20)..GPA + (10 << 20)]
    );
    // More blocks inside piece 1: they become reachable under its slot, which stays; the
    // guest checks them.
    let plan = a.plan(16).unwrap();
    assert_eq!(plan.pieces.len(), 1);
    let grow = &plan.pieces[0];
    assert_eq!((grow.index, grow.region), (1, Some(RegionId(101))));
    assert_eq!(grow.plugged(), Some(GPA + (10 << 20)..GPA + (16 << 20)));
    assert_eq!(grow.given_back(), None);
    assert!(a.changes(&plan).is_empty(), "no slot changes");
    assert_eq!(
        a.flips(&plan),
        vec![(RegionId(101), 2 << 20..8 << 20, true)]
    );
    model.carry_out(&mut a, &plan);
    assert_eq!(a.info().plugged_size_mib, 16);
    assert_eq!(a.info().mapped_slots, 2);
    // The same size again: nothing at all.
    assert!(a.plan(16).unwrap().pieces.is_empty());
}

#[test]
fn an_unplug_removes_emptied_pieces_and_shrinks_the_slot_of_a_partial_one() {
    let mut a = area(64, 2, Some(8));
    let mut model = Model::default();
    let all = a.plan(64).unwrap();
    assert_eq!(all.pieces.len(), 8);
    model.carry_out(&mut a, &all);
    let plan = a.plan(10).unwrap();
    let indices: Vec<usize> = plan.pieces.iter().map(|p| p.index).collect();
    assert_eq!(indices, vec![1, 2, 3, 4, 5, 6, 7]);
    // Blocks 5..8 of piece 1 become unreachable and go back to the host; the piece and its
    // slot stay.
    assert_eq!(plan.pieces[0].given_back(), Some(2 << 20..8 << 20));
    assert_eq!(plan.pieces[0].plugged(), None);
    assert_eq!(
        a.flips(&plan),
        vec![(RegionId(101), 2 << 20..8 << 20, false)]
    );
    let changes = a.changes(&plan);
    assert_eq!(changes.len(), 6);
    assert!(changes.iter().all(|c| matches!(c, RegionChange::Remove(_))));
    assert_eq!(
        plan.pieces[1].given_back(),
        None,
        "a removed piece goes whole"
    );
    model.carry_out(&mut a, &plan);
    assert_eq!(
        model.reachable(),
        vec![GPA..GPA + (8 << 20), GPA + (8 << 20)..GPA + (10 << 20)]
    );
    assert_eq!(model.slots(), 2);
    // Down to a piece boundary: piece 1 goes.
    let plan = a.plan(8).unwrap();
    assert!(matches!(
        a.changes(&plan)[..],
        [RegionChange::Remove(RegionId(101))]
    ));
    model.carry_out(&mut a, &plan);
    let none = a.plan(0).unwrap();
    assert!(matches!(
        a.changes(&none)[..],
        [RegionChange::Remove(RegionId(100))]
    ));
    model.carry_out(&mut a, &none);
    assert_eq!((a.plugged_blocks, a.mapped_slots()), (0, 0));
    assert!(model.regions.is_empty());
}

#[test]
fn requests_off_the_block_size_or_past_the_area_are_refused() {
    let a = area(64, 4, Some(8));
    for bad in [2, 6, 68] {
        let e = a.plan(bad).unwrap_err();
        assert_eq!(e.kind, ErrorKind::BadRequest);
        assert!(
            e.message
                .starts_with(&format!("requested_size_mib {bad} must be")),
            "{e}"
        );
    }
}

/// A sequence of sizes up and down, with every piece size from the block to the area: what
/// the guest reaches is exactly the plugged memory (every unplugged block under a slot is
/// unreachable), one slot per piece with a plugged block, and a plan back undoes a plan
/// (what a failed check or a signal does).
#[test]
fn every_sequence_keeps_the_reachable_memory_exactly_the_plugged_blocks() {
    let block = 2;
    for slot in [2, 4, 8, 16, 32] {
        let mut a = area(32, block, Some(slot));
        let mut model = Model::default();
        let sizes = [6, 32, 0, 2, 30, 14, 16, 18, 4, 32, 10, 0];
        for (step, &size) in sizes.iter().enumerate() {
            let before = a.plugged_blocks;
            let plan = a.plan(size).unwrap();
            model.carry_out(&mut a, &plan);
            let plugged = size << 20;
            let wanted: Vec<Range<u64>> = (0..plugged)
                .step_by((slot << 20) as usize)
                .map(|start| GPA + start..GPA + (start + (slot << 20)).min(plugged))
                .collect();
            let context = format!("slot {slot} MiB, step {step}: {size} MiB");
            assert_eq!(model.reachable(), wanted, "{context}");
            assert_eq!(model.slots(), wanted.len(), "{context}");
            assert_eq!(a.mapped_slots(), wanted.len(), "{context}");
            assert_eq!(model.regions.len(), wanted.len(), "{context}");
            // Going back and forth again leaves the same slots.
            let back = a.plan_blocks(before);
            model.carry_out(&mut a, &back);
            let again = a.plan(size).unwrap();
            model.carry_out(&mut a, &again);
            assert_eq!(
                model.reachable(),
                wanted,
                "{context}, after an undo and a redo"
            );
        }
    }
}

/// A 2 MiB system region at 0, and at the hotplug area the regions of `slots` 8 MiB slots.
pub(crate) fn layout(slots: &[u64]) -> (MemoryManager<FakeKvm>, MemoryLayout) {
    let memory = MemoryManager::new(FakeKvm::new(64, false));
    memory
        .add_region(RegionSpec::new(GuestAddress(0), 2 * MIB))
        .expect("the system region");
    for slot in slots {
        let gpa = GuestAddress(HOTPLUG_GPA + slot * 8 * MIB);
        memory
            .add_region(RegionSpec::new(gpa, 8 * MIB))
            .expect("a slot");
    }
    let layout = MemoryLayout::of(&memory);
    (memory, layout)
}

/// 64 MiB in 2 MiB blocks and 8 MiB slots, 5 blocks plugged: slots 0 and 1 mapped.
pub(crate) fn hotplug() -> HotplugState {
    HotplugState {
        config: HotplugConfig {
            total_size_mib: 64,
            block_size_mib: 2,
            slot_size_mib: Some(8),
            page_size: Default::default(),
        },
        plugged_blocks: 5,
        mapped: [[true; 2].as_slice(), &[false; 6]].concat(),
    }
}

#[test]
fn a_hotplug_area_is_checked_against_itself_and_the_layout() {
    let (_memory, two) = layout(&[0, 1]);
    // Slots of the whole piece (the layout helper's): a piece's one slot.
    assert_eq!(hotplug().validate(&two), Ok(()));
    let refused = |change: fn(&mut HotplugState), layout: &MemoryLayout| {
        let mut state = hotplug();
        change(&mut state);
        state.validate(layout).expect_err("refused")
    };
    let short = refused(|s| s.mapped.truncate(2), &two);
    assert!(short.contains("8 slots, but `mapped` lists 2"), "{short}");
    let absurd = refused(|s| s.plugged_blocks = 1 << 62, &two);
    assert!(absurd.contains("more than its 32 blocks"), "{absurd}");
    let none = refused(|s| s.plugged_blocks = 0, &two);
    assert!(none.contains("slot 0 is mapped"), "{none}");
    let more = refused(|s| s.plugged_blocks = 9, &two);
    assert!(more.contains("slot 2 is not mapped"), "{more}");
    let block = refused(|s| s.config.block_size_mib = 3, &two);
    assert!(block.contains("block_size_mib 3"), "{block}");
    // The layout lacks a mapped slot's region, or has one the map does not list.
    let (_memory, one) = layout(&[0]);
    let missing = hotplug().validate(&one).expect_err("refused");
    assert!(missing.contains("mapped slot 1"), "{missing}");
    let (_memory, three) = layout(&[0, 1, 3]);
    let extra = hotplug().validate(&three).expect_err("refused");
    assert!(extra.contains("inside the hotplug area"), "{extra}");
    // A partly plugged piece's slot covers it whole (or, written when pieces had holes,
    // its plugged block); any other slotting is refused, naming both.
    let with_slots = |piece_1: Vec<Range<u64>>| {
        let (memory, _) = layout(&[0]);
        let gpa = GuestAddress(HOTPLUG_GPA + 8 * MIB);
        memory
            .add_region(RegionSpec::new(gpa, 8 * MIB).with_slot_ranges(piece_1))
            .expect("a piece with a hole");
        MemoryLayout::of(&memory)
    };
    let cut = with_slots(vec![0..2 * MIB]);
    assert_eq!(hotplug().validate(&cut), Ok(()));
    let wrong = hotplug()
        .validate(&with_slots(vec![0..4 * MIB]))
        .expect_err("refused");
    assert!(
        wrong.contains("has slots [0..400000]") && wrong.contains("need [0..800000]"),
        "{wrong}"
    );
    let odd = hotplug()
        .validate(&with_slots(vec![0..2 * MIB, 6 * MIB..8 * MIB]))
        .expect_err("neither the piece nor its plugged blocks");
    assert!(odd.contains("need [0..800000]"), "{odd}");
}
