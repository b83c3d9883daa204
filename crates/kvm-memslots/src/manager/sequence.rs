//! The change sequence a vCPU exit handler reads to tell memory away for a moment from no
//! memory: even while KVM's slots match the published map, odd while a change is applied.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Condvar, Mutex};

/// The change sequence (even while KVM's slots match the published map, odd while a change is
/// being applied), and what wakes those waiting for it to be even.
#[derive(Default)]
pub(super) struct ChangeSequence {
    value: AtomicU64,
    lock: Mutex<()>,
    settled: Condvar,
}

impl ChangeSequence {
    pub(super) fn get(&self) -> u64 {
        self.value.load(Ordering::Acquire)
    }

    pub(super) fn begin(&self) {
        self.value.fetch_add(1, Ordering::AcqRel);
    }

    pub(super) fn end(&self) {
        self.value.fetch_add(1, Ordering::AcqRel);
        // Under the lock: a waiter checks the value and starts waiting under it, so it either
        // saw the new value or is waiting when this wakes it.
        let _waiters = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        self.settled.notify_all();
    }

    pub(super) fn wait_even(&self, give_up: &dyn Fn() -> bool) -> Option<u64> {
        let mut guard = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            let value = self.get();
            if value.is_multiple_of(2) {
                return Some(value);
            }
            if give_up() {
                return None;
            }
            guard = self
                .settled
                .wait_timeout(guard, GIVE_UP_CHECK)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }
}

/// How often [`MemoryManager::wait_settled`](super::MemoryManager::wait_settled) asks whether to give up.
const GIVE_UP_CHECK: std::time::Duration = std::time::Duration::from_millis(1);
