//! Test doubles for KVM's memory-slot ioctls: [`FakeKvm`] enforces KVM's rules and records its
//! slots, for testing the manager where `/dev/kvm` is missing; [`Hooked`] wraps any
//! [`KvmMemory`] (the fake or real KVM) and runs a [`Hook`] around each of its calls. The
//! hooks here: [`Faulty`]'s [`FailurePlan`] fails the calls a test chooses, for testing every
//! undo path; [`Stopwatch`] counts and times them, for benchmarks.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use vmm_sys_util::errno::Error as Errno;

use crate::kvm::{KvmMemory, KvmSlot};
use crate::ring::RingCollection;
use crate::PAGE_SIZE;

/// A kind of KVM call: what a planned failure hits, what a [`Stopwatch`] counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvmCall {
    /// `KVM_SET_USER_MEMORY_REGION`.
    SetRegion,
    /// `KVM_GET_DIRTY_LOG`.
    GetDirtyLog,
    /// `KVM_CLEAR_DIRTY_LOG`.
    ClearDirtyLog,
    /// Collecting the dirty rings' entries ([`KvmMemory::collect_dirty_rings`]).
    CollectDirtyRings,
    /// `KVM_RESET_DIRTY_RINGS`.
    ResetDirtyRings,
}

struct FakeSlot {
    kvm: KvmSlot,
    /// One bit per page while dirty logging is on.
    dirty: Option<Vec<u64>>,
}

#[derive(Default)]
struct State {
    slots: BTreeMap<u32, FakeSlot>,
    set_calls: u64,
    /// In ring mode: entries published and not collected, in order (one ring for all vCPUs).
    ring: VecDeque<(u32, u64)>,
    /// Pages with an entry not yet reset: KVM publishes a page once until the reset that
    /// follows its collection re-protects it.
    unreset: BTreeSet<(u32, u64)>,
    /// Entries collected and not yet reset.
    collected: Vec<(u32, u64)>,
    /// In ring mode: entries were written over (`overflow_ring`), not yet reported.
    lost: bool,
}

/// A fake VM: KVM's checks on slot changes and per-slot dirty logs, or a dirty ring.
pub struct FakeKvm {
    max_slots: u32,
    manual_dirty_log: bool,
    /// With manual protection: logs start all set (KVM_DIRTY_LOG_INITIALLY_SET).
    initially_set: bool,
    /// Ring mode, with this many entries.
    ring_entries: Option<u32>,
    state: Mutex<State>,
}

/// KVM's limit on the pages of one slot.
const MAX_SLOT_PAGES: u64 = (1 << 31) - 1;

impl FakeKvm {
    /// A fake VM with `max_slots` slot numbers; `manual_dirty_log` as in
    /// [`KvmMemory::manual_dirty_log`].
    pub fn new(max_slots: u32, manual_dirty_log: bool) -> Self {
        FakeKvm {
            max_slots,
            manual_dirty_log,
            initially_set: manual_dirty_log,
            ring_entries: None,
            state: Mutex::new(State::default()),
        }
    }

    /// A fake VM with manual protection whose logs start clear and tracked, as real KVM
    /// without `KVM_DIRTY_LOG_INITIALLY_SET` (what [`KvmVm`](crate::KvmVm) asks for).
    pub fn without_initially_set(max_slots: u32) -> Self {
        FakeKvm {
            initially_set: false,
            ..Self::new(max_slots, true)
        }
    }

    /// A fake VM in ring mode: the guest's writes to logging slots publish ring entries (at
    /// most `entries` outstanding, as one vCPU's ring) instead of setting log bits.
    pub fn with_dirty_ring(max_slots: u32, entries: u32) -> Self {
        FakeKvm {
            max_slots,
            manual_dirty_log: false,
            initially_set: false,
            ring_entries: Some(entries),
            state: Mutex::new(State::default()),
        }
    }

    /// Whether the ring has no room for another entry (a vCPU would exit with
    /// `KVM_EXIT_DIRTY_RING_FULL`).
    pub fn ring_full(&self) -> bool {
        let state = self.state();
        self.ring_entries
            .is_some_and(|n| state.ring.len() + state.collected.len() >= n as usize)
    }

    /// As a ring that overflowed (this host's instruction emulator pushes past the ring's
    /// room): the entries not yet collected are lost, and the next collection says so
    /// ([`RingCollection::lost`](crate::RingCollection::lost)). Their pages stay unprotected
    /// until a reset, as KVM's do.
    pub fn overflow_ring(&self) {
        let mut state = self.state();
        let lost = std::mem::take(&mut state.ring);
        state.collected.extend(lost);
        state.lost = true;
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The slots KVM has, by slot number.
    pub fn slots(&self) -> Vec<KvmSlot> {
        self.state().slots.values().map(|s| s.kvm).collect()
    }

    /// How many `KVM_SET_USER_MEMORY_REGION` calls succeeded so far.
    pub fn set_calls(&self) -> u64 {
        self.state().set_calls
    }

    /// A guest write to `gpa`: sets the page's dirty bit if a logging slot holds it. Returns
    /// whether a slot holds `gpa` at all (a write elsewhere would exit to the VMM).
    pub fn guest_write(&self, gpa: u64) -> bool {
        let mut state = self.state();
        let Some(slot) = state
            .slots
            .values_mut()
            .find(|s| gpa >= s.kvm.gpa && gpa - s.kvm.gpa < s.kvm.size)
        else {
            return false;
        };
        let page = ((gpa - slot.kvm.gpa) / PAGE_SIZE) as usize;
        let logging = slot.kvm.flags.log_dirty;
        let number = slot.kvm.slot;
        if let Some(bits) = &mut slot.dirty {
            bits[page / 64] |= 1 << (page % 64);
        }
        if let Some(n) = self.ring_entries.filter(|_| logging) {
            if state.unreset.insert((number, page as u64)) {
                assert!(
                    state.ring.len() + state.collected.len() < n as usize,
                    "the guest wrote with its dirty ring full: a vCPU would have exited first"
                );
                state.ring.push_back((number, page as u64));
            }
        }
        true
    }

    fn new_log(&self, pages: u64) -> Vec<u64> {
        let words = pages.div_ceil(64) as usize;
        if !self.manual_dirty_log || !self.initially_set {
            return vec![0; words];
        }
        // KVM_DIRTY_LOG_INITIALLY_SET: every page of the slot starts dirty.
        let mut log = vec![u64::MAX; words];
        if !pages.is_multiple_of(64) {
            log[words - 1] = (1 << (pages % 64)) - 1;
        }
        log
    }
}

impl fmt::Debug for FakeKvm {
    /// The configuration, and the slot count unless the fake is busy (it is never waited for).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut d = f.debug_struct("FakeKvm");
        d.field("max_slots", &self.max_slots)
            .field("manual_dirty_log", &self.manual_dirty_log);
        if let Ok(state) = self.state.try_lock() {
            d.field("slots", &state.slots.len())
                .field("set_calls", &state.set_calls);
        }
        d.finish_non_exhaustive()
    }
}

fn overlaps(slots: &BTreeMap<u32, FakeSlot>, skip: u32, gpa: u64, size: u64) -> bool {
    slots
        .values()
        .any(|s| s.kvm.slot != skip && gpa < s.kvm.gpa + s.kvm.size && s.kvm.gpa < gpa + size)
}

impl KvmMemory for FakeKvm {
    fn max_slots(&self) -> u32 {
        self.max_slots
    }

    unsafe fn set_user_memory_region(&self, req: &KvmSlot) -> Result<(), Errno> {
        let mut state = self.state();
        let einval = Err(Errno::new(libc::EINVAL));
        if req.slot >= self.max_slots
            || !req.gpa.is_multiple_of(PAGE_SIZE)
            || !req.size.is_multiple_of(PAGE_SIZE)
            || !req.hva.is_multiple_of(PAGE_SIZE)
            || req.gpa.checked_add(req.size).is_none()
            || req.hva.checked_add(req.size).is_none()
            || req.size / PAGE_SIZE > MAX_SLOT_PAGES
        {
            return einval;
        }
        let pages = req.size / PAGE_SIZE;
        match state.slots.get(&req.slot).map(|s| s.kvm) {
            None if req.size == 0 => return einval,
            None => {
                if overlaps(&state.slots, req.slot, req.gpa, req.size) {
                    return Err(Errno::new(libc::EEXIST));
                }
                let dirty = req.flags.log_dirty.then(|| self.new_log(pages));
                state.slots.insert(req.slot, FakeSlot { kvm: *req, dirty });
            }
            Some(_) if req.size == 0 => {
                state.slots.remove(&req.slot);
                // A slot made again starts write-protected: its next writes publish again.
                // (Entries already in the ring stay; KVM's reset skips a slot that is gone.)
                state.unreset.retain(|(slot, _)| *slot != req.slot);
            }
            Some(old) => {
                if old.size != req.size
                    || old.hva != req.hva
                    || old.flags.read_only != req.flags.read_only
                {
                    return einval;
                }
                if old.gpa != req.gpa && overlaps(&state.slots, req.slot, req.gpa, req.size) {
                    return Err(Errno::new(libc::EEXIST));
                }
                let new_log =
                    (req.flags.log_dirty && !old.flags.log_dirty).then(|| self.new_log(pages));
                if req.flags.log_dirty && !old.flags.log_dirty {
                    // Logging starts with every page protected again.
                    state.unreset.retain(|(slot, _)| *slot != req.slot);
                }
                let slot = state.slots.get_mut(&req.slot).expect("looked up above");
                slot.kvm = *req;
                if !req.flags.log_dirty {
                    slot.dirty = None;
                } else if new_log.is_some() {
                    slot.dirty = new_log;
                }
            }
        }
        state.set_calls += 1;
        Ok(())
    }

    fn get_dirty_log(&self, slot: u32, bitmap: &mut [u64]) -> Result<(), Errno> {
        let mut state = self.state();
        let manual = self.manual_dirty_log;
        let log = state
            .slots
            .get_mut(&slot)
            .and_then(|s| s.dirty.as_mut())
            .ok_or(Errno::new(libc::ENOENT))?;
        if bitmap.len() < log.len() {
            return Err(Errno::new(libc::EFAULT));
        }
        bitmap[..log.len()].copy_from_slice(log);
        if !manual {
            log.fill(0);
        }
        Ok(())
    }

    fn clear_dirty_log(
        &self,
        slot: u32,
        first_page: u64,
        num_pages: u32,
        bitmap: &[u64],
    ) -> Result<(), Errno> {
        let mut state = self.state();
        let s = state.slots.get_mut(&slot).ok_or(Errno::new(libc::ENOENT))?;
        let pages = s.kvm.size / PAGE_SIZE;
        let end = first_page + u64::from(num_pages);
        if !self.manual_dirty_log
            || !first_page.is_multiple_of(64)
            || (!num_pages.is_multiple_of(64) && end != pages)
            || end > pages
            || bitmap.len() < (num_pages as usize).div_ceil(64)
        {
            return Err(Errno::new(libc::EINVAL));
        }
        let log = s.dirty.as_mut().ok_or(Errno::new(libc::ENOENT))?;
        for i in 0..u64::from(num_pages) {
            if bitmap[(i / 64) as usize] & (1 << (i % 64)) != 0 {
                let page = first_page + i;
                log[(page / 64) as usize] &= !(1 << (page % 64));
            }
        }
        Ok(())
    }

    fn manual_dirty_log(&self) -> bool {
        self.manual_dirty_log
    }

    fn initially_set_logs(&self) -> bool {
        self.manual_dirty_log && self.initially_set
    }

    fn dirty_ring(&self) -> bool {
        self.ring_entries.is_some()
    }

    fn collect_dirty_rings(&self, sink: &mut dyn FnMut(u32, u64)) -> Result<RingCollection, Errno> {
        let mut state = self.state();
        let mut found = RingCollection {
            entries: 0,
            lost: std::mem::take(&mut state.lost),
        };
        while let Some((slot, offset)) = state.ring.pop_front() {
            sink(slot, offset);
            state.collected.push((slot, offset));
            found.entries += 1;
        }
        Ok(found)
    }

    fn reset_dirty_rings(&self) -> Result<(), Errno> {
        let mut state = self.state();
        for entry in std::mem::take(&mut state.collected) {
            state.unreset.remove(&entry);
        }
        Ok(())
    }
}

/// One KVM call as a [`Hook`] sees it: its kind and its request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvmRequest<'a> {
    /// [`KvmMemory::set_user_memory_region`] of this slot.
    SetRegion(&'a KvmSlot),
    /// [`KvmMemory::get_dirty_log`] of this slot.
    GetDirtyLog {
        /// KVM's slot number.
        slot: u32,
    },
    /// [`KvmMemory::clear_dirty_log`] of these pages.
    ClearDirtyLog {
        /// KVM's slot number.
        slot: u32,
        /// The first page the bitmap covers.
        first_page: u64,
        /// How many pages it covers.
        num_pages: u32,
        /// One bit per page to clear.
        bitmap: &'a [u64],
    },
    /// [`KvmMemory::collect_dirty_rings`].
    CollectDirtyRings,
    /// [`KvmMemory::reset_dirty_rings`].
    ResetDirtyRings,
}

impl KvmRequest<'_> {
    /// Its kind.
    pub fn kind(&self) -> KvmCall {
        match self {
            KvmRequest::SetRegion(_) => KvmCall::SetRegion,
            KvmRequest::GetDirtyLog { .. } => KvmCall::GetDirtyLog,
            KvmRequest::ClearDirtyLog { .. } => KvmCall::ClearDirtyLog,
            KvmRequest::CollectDirtyRings => KvmCall::CollectDirtyRings,
            KvmRequest::ResetDirtyRings => KvmCall::ResetDirtyRings,
        }
    }

    /// The KVM slot number it names, if it names one.
    pub fn slot(&self) -> Option<u32> {
        match *self {
            KvmRequest::SetRegion(slot) => Some(slot.slot),
            KvmRequest::GetDirtyLog { slot } | KvmRequest::ClearDirtyLog { slot, .. } => Some(slot),
            KvmRequest::CollectDirtyRings | KvmRequest::ResetDirtyRings => None,
        }
    }
}

/// What a [`Hooked`] KVM runs around each of its calls.
pub trait Hook: Send + Sync {
    /// Makes the call `request` describes by calling `proceed` (which passes it to the wrapped
    /// KVM and returns its answer), doing anything it likes before and after: counting or
    /// timing it, stopping it until a test says go, or failing it instead (returning an error
    /// without calling `proceed`). It returns the call's answer.
    ///
    /// A hook that returns `Ok` without calling `proceed` tells the caller that KVM did what
    /// it did not.
    fn around<T>(
        &self,
        request: KvmRequest<'_>,
        proceed: impl FnOnce() -> Result<T, Errno>,
    ) -> Result<T, Errno>;
}

/// No hook: every call goes straight through.
impl Hook for () {
    fn around<T>(
        &self,
        _request: KvmRequest<'_>,
        proceed: impl FnOnce() -> Result<T, Errno>,
    ) -> Result<T, Errno> {
        proceed()
    }
}

/// A [`KvmMemory`] that runs `hook` around each call of the wrapped one (every method that
/// makes a call; the properties [`max_slots`](KvmMemory::max_slots),
/// [`manual_dirty_log`](KvmMemory::manual_dirty_log),
/// [`initially_set_logs`](KvmMemory::initially_set_logs) and
/// [`dirty_ring`](KvmMemory::dirty_ring) are the wrapped KVM's, unhooked).
///
/// To wrap a KVM that something else holds too (a test that drives the fake while a manager
/// owns it), wrap an `Arc` of it, or a reference.
#[derive(Debug)]
pub struct Hooked<K, H> {
    inner: K,
    hook: H,
}

impl<K: KvmMemory, H: Hook> Hooked<K, H> {
    /// `inner`, with `hook` around its calls.
    pub fn with_hook(inner: K, hook: H) -> Self {
        Hooked { inner, hook }
    }

    /// The wrapped KVM.
    pub fn inner(&self) -> &K {
        &self.inner
    }

    /// The hook.
    pub fn hook(&self) -> &H {
        &self.hook
    }
}

impl<K: KvmMemory, H: Hook + Default> Hooked<K, H> {
    /// `inner`, with a hook in its default state around its calls ([`Faulty::new`] plans no
    /// failure).
    pub fn new(inner: K) -> Self {
        Self::with_hook(inner, H::default())
    }
}

impl<K: KvmMemory, H: Hook> KvmMemory for Hooked<K, H> {
    fn max_slots(&self) -> u32 {
        self.inner.max_slots()
    }

    unsafe fn set_user_memory_region(&self, slot: &KvmSlot) -> Result<(), Errno> {
        self.hook.around(KvmRequest::SetRegion(slot), || {
            // SAFETY: the caller's guarantee about `slot`'s memory is passed on unchanged; the
            // hook neither changes the request nor outlives the call, so KVM gets this slot
            // (or nothing) while the caller is still inside this call.
            unsafe { self.inner.set_user_memory_region(slot) }
        })
    }

    fn get_dirty_log(&self, slot: u32, bitmap: &mut [u64]) -> Result<(), Errno> {
        self.hook.around(KvmRequest::GetDirtyLog { slot }, || {
            self.inner.get_dirty_log(slot, bitmap)
        })
    }

    fn clear_dirty_log(
        &self,
        slot: u32,
        first_page: u64,
        num_pages: u32,
        bitmap: &[u64],
    ) -> Result<(), Errno> {
        let request = KvmRequest::ClearDirtyLog {
            slot,
            first_page,
            num_pages,
            bitmap,
        };
        self.hook.around(request, || {
            self.inner
                .clear_dirty_log(slot, first_page, num_pages, bitmap)
        })
    }

    fn manual_dirty_log(&self) -> bool {
        self.inner.manual_dirty_log()
    }

    fn initially_set_logs(&self) -> bool {
        self.inner.initially_set_logs()
    }

    fn dirty_ring(&self) -> bool {
        self.inner.dirty_ring()
    }

    fn collect_dirty_rings(&self, sink: &mut dyn FnMut(u32, u64)) -> Result<RingCollection, Errno> {
        self.hook.around(KvmRequest::CollectDirtyRings, || {
            self.inner.collect_dirty_rings(sink)
        })
    }

    fn reset_dirty_rings(&self) -> Result<(), Errno> {
        self.hook.around(KvmRequest::ResetDirtyRings, || {
            self.inner.reset_dirty_rings()
        })
    }
}

#[derive(Debug)]
struct PlannedFailure {
    call: KvmCall,
    /// Calls of that kind still to succeed before the failing one.
    skip: u64,
    errno: i32,
    /// Every later call of that kind fails too.
    sticky: bool,
    /// The call panics instead of failing.
    panics: bool,
}

/// The hook of [`Faulty`]: the failures planned, at most one per kind of call ([`KvmCall`]).
#[derive(Default)]
pub struct FailurePlan {
    failures: Mutex<Vec<PlannedFailure>>,
}

impl fmt::Debug for FailurePlan {
    /// The planned failures, unless a call is checking them.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut d = f.debug_struct("FailurePlan");
        if let Ok(failures) = self.failures.try_lock() {
            d.field("failures", &*failures);
        }
        d.finish_non_exhaustive()
    }
}

impl FailurePlan {
    fn plan(&self, failure: PlannedFailure) {
        let mut planned = self.planned();
        planned.retain(|f| f.call != failure.call);
        planned.push(failure);
    }

    fn planned(&self) -> MutexGuard<'_, Vec<PlannedFailure>> {
        self.failures.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn check(&self, call: KvmCall) -> Result<(), Errno> {
        let mut planned = self.planned();
        let Some(i) = planned.iter().position(|f| f.call == call) else {
            return Ok(());
        };
        let f = &mut planned[i];
        if f.skip > 0 {
            f.skip -= 1;
            return Ok(());
        }
        let (errno, panics) = (f.errno, f.panics);
        if !f.sticky {
            planned.remove(i);
        }
        if panics {
            drop(planned);
            panic!("Faulty: the planned panic in {call:?}");
        }
        Err(Errno::new(errno))
    }
}

/// A planned failure fails its call without reaching the wrapped KVM.
impl Hook for FailurePlan {
    fn around<T>(
        &self,
        request: KvmRequest<'_>,
        proceed: impl FnOnce() -> Result<T, Errno>,
    ) -> Result<T, Errno> {
        self.check(request.kind())?;
        proceed()
    }
}

/// Wraps a [`KvmMemory`] and makes chosen calls fail (without reaching the inner one). Each
/// kind of call ([`KvmCall`]) has its own plan, so one test can fail, say, the third
/// `KVM_SET_USER_MEMORY_REGION` and the first `KVM_CLEAR_DIRTY_LOG` of one operation.
/// [`Faulty::new`] wraps a KVM with no failure planned.
pub type Faulty<K> = Hooked<K, FailurePlan>;

impl<K: KvmMemory> Faulty<K> {
    /// Makes the call of kind `call` that comes after `skip` successful ones fail with `errno`.
    /// Replaces a failure planned before for the same kind of call; plans for other kinds stay.
    pub fn fail(&self, call: KvmCall, skip: u64, errno: i32) {
        self.hook.plan(PlannedFailure {
            call,
            skip,
            errno,
            sticky: false,
            panics: false,
        });
    }

    /// Makes the call of kind `call` that comes after `skip` successful ones panic, as a bug in
    /// a KVM wrapper would: for testing that the caller survives an unwinding change (the
    /// manager's change sequence ends even, say). Replaces a plan for the same kind of call.
    pub fn panic_at(&self, call: KvmCall, skip: u64) {
        self.hook.plan(PlannedFailure {
            call,
            skip,
            errno: 0,
            sticky: false,
            panics: true,
        });
    }

    /// Like [`fail`](Self::fail), but that call and every later one of its kind fail, until
    /// [`heal`](Self::heal).
    pub fn fail_from(&self, call: KvmCall, skip: u64, errno: i32) {
        self.hook.plan(PlannedFailure {
            call,
            skip,
            errno,
            sticky: true,
            panics: false,
        });
    }

    /// Cancels every planned failure.
    pub fn heal(&self) {
        self.hook.planned().clear();
    }

    /// Whether a planned failure is still to come.
    pub fn failure_pending(&self) -> bool {
        !self.hook.planned().is_empty()
    }
}

/// How many kinds of call there are.
const KINDS: usize = 5;

/// A hook that counts the calls of each kind and adds up the time each kind spent in the
/// wrapped KVM: for benchmarks, to tell their own time from KVM's.
#[derive(Debug, Default)]
pub struct Stopwatch {
    calls: [AtomicU64; KINDS],
    nanos: [AtomicU64; KINDS],
}

impl Stopwatch {
    /// Calls of kind `kind` so far (failed ones too).
    pub fn calls(&self, kind: KvmCall) -> u64 {
        self.calls[kind as usize].load(Ordering::Relaxed)
    }

    /// Time spent in calls of kind `kind` so far.
    pub fn time(&self, kind: KvmCall) -> Duration {
        Duration::from_nanos(self.nanos[kind as usize].load(Ordering::Relaxed))
    }

    /// Time spent in calls of every kind so far.
    pub fn total_time(&self) -> Duration {
        let nanos = self.nanos.iter().map(|n| n.load(Ordering::Relaxed)).sum();
        Duration::from_nanos(nanos)
    }
}

impl Hook for Stopwatch {
    fn around<T>(
        &self,
        request: KvmRequest<'_>,
        proceed: impl FnOnce() -> Result<T, Errno>,
    ) -> Result<T, Errno> {
        let kind = request.kind() as usize;
        let start = Instant::now();
        let answer = proceed();
        let nanos = u64::try_from(start.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.nanos[kind].fetch_add(nanos, Ordering::Relaxed);
        self.calls[kind].fetch_add(1, Ordering::Relaxed);
        answer
    }
}
