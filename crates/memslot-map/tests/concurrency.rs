//! Concurrent readers of a `SharedMap` see whole published versions and nothing else.
//!
//! A writer thread publishes a fixed number of batches through `SharedMap::apply`, while four
//! reader threads load the current version over and over and check it. Every version is known
//! in advance: batch `k` re-inserts a subset of the slots chosen from `k` (payload `k`, a new
//! guest offset, host base and flags), removes, moves or re-flags a few others, and stamps a
//! marker slot with `k`. A reader reads the marker's stamp `m` from one `load()` and checks, in
//! that same version, that the slots stamped `m` are exactly batch `m`'s subset, that nothing is
//! stamped above `m`, and that every slot, the slot count, and the lookups by id, by guest
//! address (plain and through a per-thread `LookupHint` carried across versions) and by host
//! range are exactly version `m`'s. Readers also keep `load_full()`s and check them again after
//! the writer has moved on. At checkpoints the writer waits until every reader has checked the
//! version just published, so that each reader is sure to see many distinct versions.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread;

use memslot_map::{
    Change, GuestAddress, HostAddress, LookupHint, MapConfig, MemslotMap, SharedMap, Slot,
    SlotFlags, SlotId,
};

const PAGE: u64 = 0x1000;
/// Ordinary slots; slot `i` stays inside guest pages `[4 * i, 4 * i + 4)`.
const SLOTS: u32 = 128;
/// The slot whose payload names the version.
const MARKER: u32 = SLOTS;
const REGION_PAGES: u64 = 4;
/// Host bases are below this many pages, so host ranges overlap a lot.
const HOST_PAGES: u64 = 64;
const BATCHES: u64 = 4000;
/// Every this many batches the writer waits for every reader to check the newest version.
const CHECKPOINT: u64 = 40;
const READERS: usize = 4;

/// What version `k` holds for one ordinary slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct SlotState {
    /// The batch that last (re-)inserted it: its payload.
    stamp: u64,
    /// Pages from the start of its guest region.
    offset: u64,
    flags: SlotFlags,
}

/// What one version holds: the state of each ordinary slot, `None` for an absent one.
type Version = Vec<Option<SlotState>>;

/// A well-mixed hash of `(k, i)` (splitmix64).
fn mix(k: u64, i: u32) -> u64 {
    let mut z = k
        .wrapping_mul(0x9e37_79b9_7f4a_7c15)
        .wrapping_add(u64::from(i).wrapping_mul(0xbf58_476d_1ce4_e5b9));
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn flags_of(bits: u64) -> SlotFlags {
    SlotFlags {
        log_dirty: bits & 1 != 0,
        read_only: bits & 2 != 0,
    }
}

/// Whether batch `k` re-inserts slot `i` (stamping it `k`).
fn restamped(k: u64, i: u32) -> bool {
    k > 0 && mix(k, i).is_multiple_of(4)
}

/// The slot `i` is in state `state`. Its size and host base depend on its stamp, its guest base
/// on its offset.
fn slot(i: u32, state: SlotState) -> Slot<u64> {
    let size = (1 + state.stamp % 2) * PAGE;
    let gpa = (u64::from(i) * REGION_PAGES + state.offset) * PAGE;
    let hva = ((u64::from(i) * 5 + state.stamp) % HOST_PAGES) * PAGE;
    Slot::new(
        SlotId(i),
        GuestAddress(gpa),
        size,
        HostAddress(hva),
        state.flags,
        state.stamp,
    )
}

fn marker(k: u64) -> Slot<u64> {
    Slot::new(
        SlotId(MARKER),
        GuestAddress(u64::from(SLOTS) * REGION_PAGES * PAGE),
        PAGE,
        HostAddress(HOST_PAGES * PAGE),
        SlotFlags::default(),
        k,
    )
}

/// Every version's expected slots (index `k` for the version batch `k` published; version 0 is
/// the initial map) and every batch (index `k - 1` for batch `k`).
fn script() -> (Vec<Version>, Vec<Vec<Change<u64>>>) {
    let initial = SlotState {
        stamp: 0,
        offset: 0,
        flags: SlotFlags::default(),
    };
    let mut states = vec![vec![Some(initial); SLOTS as usize]];
    let mut batches = Vec::new();
    for k in 1..=BATCHES {
        let mut state = states[states.len() - 1].clone();
        let mut changes = Vec::new();
        for i in 0..SLOTS {
            if i == SLOTS / 2 {
                // The marker changes in the middle of the batch.
                changes.push(Change::Remove(SlotId(MARKER)));
                changes.push(Change::Insert(marker(k)));
            }
            let h = mix(k, i);
            let current = &mut state[i as usize];
            let offset = (h >> 8) % 3;
            let flags = flags_of(h >> 16);
            if restamped(k, i) {
                if current.is_some() {
                    changes.push(Change::Remove(SlotId(i)));
                }
                let next = SlotState {
                    stamp: k,
                    offset,
                    flags,
                };
                changes.push(Change::Insert(slot(i, next)));
                *current = Some(next);
            } else if let Some(now) = current {
                match h % 16 {
                    1 => {
                        changes.push(Change::Remove(SlotId(i)));
                        *current = None;
                    }
                    2 => {
                        changes.push(Change::SetFlags {
                            id: SlotId(i),
                            flags,
                        });
                        now.flags = flags;
                    }
                    3 => {
                        let moved = SlotState { offset, ..*now };
                        changes.push(Change::Move {
                            id: SlotId(i),
                            gpa: slot(i, moved).gpa(),
                        });
                        *now = moved;
                    }
                    _ => {}
                }
            }
        }
        states.push(state);
        batches.push(changes);
    }
    (states, batches)
}

fn initial_map() -> MemslotMap<u64> {
    let (states, _) = script();
    let mut map = MemslotMap::new(MapConfig::default());
    for (i, state) in (0..SLOTS).zip(&states[0]) {
        let state = state.expect("every slot is in the first version");
        map.insert(slot(i, state))
            .expect("the first version is valid");
    }
    map.insert(marker(0)).expect("the marker fits");
    map
}

/// Checks that `map` is exactly the version its marker names, and returns that version.
fn verify(map: &MemslotMap<u64>, states: &[Version], hint: &mut LookupHint<u64>) -> u64 {
    let m = *map
        .get(SlotId(MARKER))
        .expect("every version has the marker")
        .payload();
    let state = states
        .get(usize::try_from(m).expect("small"))
        .unwrap_or_else(|| panic!("marker stamp {m} was never published"));
    let expected: Vec<Slot<u64>> = (0..SLOTS)
        .zip(state)
        .filter_map(|(i, s)| s.map(|s| slot(i, s)))
        .chain([marker(m)])
        .collect();

    // The invariant in its plain form: the slots stamped `m` are batch `m`'s subset, and no
    // slot carries a later stamp.
    let mut stamped_m: Vec<u32> = Vec::new();
    for s in map.iter().filter(|s| s.id() != SlotId(MARKER)) {
        assert!(
            *s.payload() <= m,
            "version {m}: slot {} stamped {}",
            s.id(),
            s.payload()
        );
        if *s.payload() == m && m > 0 {
            stamped_m.push(s.id().0);
        }
    }
    let subset: Vec<u32> = (0..SLOTS).filter(|&i| restamped(m, i)).collect();
    assert_eq!(stamped_m, subset, "version {m}: slots stamped {m}");

    // Everything else about the version, by each index.
    assert_eq!(map.len(), expected.len(), "version {m}: slot count");
    let listed: Vec<&Slot<u64>> = map.iter().map(|s| &**s).collect();
    let wanted: Vec<&Slot<u64>> = expected.iter().collect();
    assert_eq!(listed, wanted, "version {m}: slots in guest order");
    for s in &expected {
        let id = s.id();
        let by_id = map.get(id).map(|f| &**f);
        assert_eq!(by_id, Some(s), "version {m}: get({id})");
        let range = s.gpa_range();
        for addr in [range.start, range.start + PAGE / 2, range.end - 1] {
            let found = map.find_by_gpa(GuestAddress(addr)).map(|f| &**f);
            assert_eq!(found, Some(s), "version {m}: find_by_gpa({addr:#x})");
            let hinted = map
                .find_by_gpa_hinted(GuestAddress(addr), hint)
                .map(|f| &**f);
            assert_eq!(hinted, Some(s), "version {m}: hinted lookup of {addr:#x}");
        }
    }
    // Guest pages no slot of this version holds find nothing.
    for page in 0..(u64::from(SLOTS) + 1) * REGION_PAGES + 1 {
        let addr = page * PAGE;
        let holder = expected.iter().find(|s| s.contains_gpa(GuestAddress(addr)));
        let found = map
            .find_by_gpa_hinted(GuestAddress(addr), hint)
            .map(|f| &**f);
        assert_eq!(found, holder, "version {m}: page {page}");
    }
    // Host ranges: each host page, and everything.
    for (hva, len) in (0..=HOST_PAGES)
        .map(|p| (p * PAGE, 1))
        .chain([(0, u64::MAX), (PAGE / 2, 3 * PAGE)])
    {
        let mut found: Vec<u32> = map
            .slots_overlapping_hva(HostAddress(hva), len)
            .iter()
            .map(|s| s.id().0)
            .collect();
        found.sort_unstable();
        let end = hva.saturating_add(len);
        let mut wanted: Vec<u32> = expected
            .iter()
            .filter(|s| s.hva().0 < end && hva < s.hva_range().end)
            .map(|s| s.id().0)
            .collect();
        wanted.sort_unstable();
        assert_eq!(found, wanted, "version {m}: host range {hva:#x}+{len:#x}");
    }
    m
}

/// What one reader saw.
struct Seen {
    checks: u64,
    /// The distinct versions it checked, in the order it saw them.
    versions: Vec<u64>,
    kept_rechecked: u64,
}

/// Counts the readers still running, so that a writer waiting for a reader that failed stops
/// waiting.
struct Alive<'a>(&'a AtomicUsize);

impl Drop for Alive<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

fn reader(
    shared: &SharedMap<u64>,
    states: &[Version],
    done: &AtomicBool,
    last_checked: &AtomicU64,
    alive: &AtomicUsize,
) -> Seen {
    let _alive = Alive(alive);
    let mut hint = LookupHint::default();
    let mut seen = Seen {
        checks: 0,
        versions: Vec::new(),
        kept_rechecked: 0,
    };
    let mut kept: Option<Arc<MemslotMap<u64>>> = None;
    loop {
        // Read the flag before loading: once it is set, the load sees the last version.
        let finished = done.load(Ordering::SeqCst);
        let m = verify(&shared.load(), states, &mut hint);
        seen.checks += 1;
        let previous = seen.versions.last().copied();
        assert!(
            previous.is_none_or(|p| p <= m),
            "version {m} loaded after {previous:?}"
        );
        if previous != Some(m) {
            seen.versions.push(m);
        }
        last_checked.store(m, Ordering::SeqCst);
        if seen.checks.is_multiple_of(8) {
            // A version kept past later changes is still whole.
            if let Some(old) = kept.replace(shared.load_full()) {
                verify(&old, states, &mut hint);
                seen.kept_rechecked += 1;
            }
        }
        if finished {
            assert_eq!(m, BATCHES, "the last load after the writer finished");
            return seen;
        }
    }
}

fn writer(
    shared: &SharedMap<u64>,
    batches: &[Vec<Change<u64>>],
    done: &AtomicBool,
    last_checked: &[AtomicU64],
    alive: &AtomicUsize,
) {
    for (k, batch) in (1..).zip(batches) {
        let published = shared
            .apply(batch.iter().cloned())
            .unwrap_or_else(|e| panic!("batch {k} refused: {e}"));
        assert_eq!(published.get(SlotId(MARKER)).map(|s| *s.payload()), Some(k));
        assert_eq!(shared.load_full().generation(), published.generation());
        if k % CHECKPOINT == 0 {
            while last_checked.iter().any(|c| c.load(Ordering::SeqCst) < k) {
                if alive.load(Ordering::SeqCst) < READERS {
                    // A reader failed; its panic is reported when the scope joins it.
                    done.store(true, Ordering::SeqCst);
                    return;
                }
                thread::yield_now();
            }
        }
    }
    done.store(true, Ordering::SeqCst);
}

#[test]
fn readers_see_only_whole_published_versions() {
    let (states, batches) = script();
    let shared = SharedMap::new(initial_map());
    let done = AtomicBool::new(false);
    let alive = AtomicUsize::new(READERS);
    let last_checked: Vec<AtomicU64> = (0..READERS).map(|_| AtomicU64::new(0)).collect();

    let seen: Vec<Seen> = thread::scope(|scope| {
        let readers: Vec<_> = last_checked
            .iter()
            .map(|last| scope.spawn(|| reader(&shared, &states, &done, last, &alive)))
            .collect();
        let writer = scope.spawn(|| writer(&shared, &batches, &done, &last_checked, &alive));
        let seen = readers
            .into_iter()
            .map(|r| r.join().expect("a reader failed"))
            .collect();
        writer.join().expect("the writer failed");
        seen
    });

    assert_eq!(
        verify(&shared.load(), &states, &mut LookupHint::default()),
        BATCHES
    );
    let checkpoints = BATCHES / CHECKPOINT;
    for (n, s) in seen.iter().enumerate() {
        // The writer waited at every checkpoint until this reader had checked that version.
        for c in 1..=checkpoints {
            assert!(
                s.versions.contains(&(c * CHECKPOINT)),
                "reader {n} never checked version {}",
                c * CHECKPOINT
            );
        }
        assert!(s.checks >= checkpoints, "reader {n}: {} checks", s.checks);
        assert!(s.kept_rechecked > 0, "reader {n} rechecked no kept version");
    }
}

/// The script itself is sound: every batch is accepted by a map on its own, and the versions
/// it builds are the ones the readers expect (so that the concurrent test fails only for what
/// it is about).
#[test]
fn the_script_builds_the_expected_versions() {
    let (states, batches) = script();
    let mut map = initial_map();
    let mut hint = LookupHint::default();
    assert_eq!(verify(&map, &states, &mut hint), 0);
    let mut stamped = 0;
    for (k, batch) in (1..).zip(&batches) {
        map = map
            .with_changes(batch.iter().cloned())
            .unwrap_or_else(|e| panic!("batch {k}: {e}"));
        assert_eq!(verify(&map, &states, &mut hint), k);
        stamped += (0..SLOTS).filter(|&i| restamped(k, i)).count();
    }
    // The batches do what they are meant to: most slots are re-stamped many times, and some
    // are absent at the end.
    assert!(stamped as u64 > BATCHES * u64::from(SLOTS) / 5);
    assert!(states[states.len() - 1].iter().any(Option::is_none));
}
