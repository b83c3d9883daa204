//! The whole VM: `GET` and `PATCH /vm`, `PUT /actions`.

use serde::{Deserialize, Serialize};

/// The VM's run state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
pub enum RunState {
    /// The guest runs commands.
    Running,
    /// The guest runs no command until resumed.
    Paused,
    /// A vCPU stopped on an error (a triple fault, an internal error, an exit the VMM cannot
    /// handle): the guest runs nothing again; [`VmInfo::failure`] says why, and stopping the
    /// VMM now ends it with exit status [`FAILED_EXIT_STATUS`].
    Failed,
    /// No VM yet: a migration's destination (`tinyvmm receive`) waits for its source.
    Waiting,
    /// No VM yet: a migration's destination receives the VM's memory and state; it serves the
    /// VM once that runs here.
    Receiving,
}

/// The exit status of a VMM stopped (by `PUT /actions` Stop or SIGINT/SIGTERM) after its guest
/// failed: distinct from 1 (a VMM error), 2 (usage), 3 and 124 (`boot`) and 130 (a signal
/// with a healthy guest).
pub(crate) const FAILED_EXIT_STATUS: u8 = 4;

/// What stopped a vCPU for good.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum FailureReason {
    /// The guest shut down: a triple fault (`KVM_EXIT_SHUTDOWN`).
    TripleFault,
    /// KVM could not handle the guest's instruction (`KVM_EXIT_INTERNAL_ERROR`).
    InternalError,
    /// The guest took an exception it reports as fatal (the test guest's exception stubs).
    Exception,
    /// An exit the VMM cannot go on from (an access to no memory and no device, an unknown
    /// port, a failed entry), or `KVM_RUN` itself failed.
    Error,
    /// The vCPU's thread ended without being asked to (or panicked).
    Stopped,
}

/// Why the VM is [`RunState::Failed`]: the first vCPU that stopped on an error.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct VmFailure {
    /// The vCPU.
    pub(crate) vcpu: usize,
    /// What kind of failure.
    pub(crate) reason: FailureReason,
    /// The guest's instruction pointer where it stopped, when known.
    pub(crate) rip: Option<u64>,
    /// The whole story, as the vCPU told it.
    pub(crate) message: String,
}

impl std::fmt::Display for VmFailure {
    /// One line: the vCPU's own message (which names the vCPU), and the rip if it does not
    /// say it already.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "the guest failed: {}", self.message)?;
        match self.rip {
            Some(rip) if !self.message.contains("rip") => write!(f, " (rip {rip:#x})"),
            _ => Ok(()),
        }
    }
}

/// `PATCH /vm` (Firecracker's shape).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VmStatePatch {
    /// `Paused` or `Resumed`.
    pub(crate) state: VmStateRequest,
}

/// The states a client may ask for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
pub(crate) enum VmStateRequest {
    /// Pause.
    Paused,
    /// Resume.
    Resumed,
}

/// `PUT /actions` (Firecracker's shape).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VmAction {
    /// Only `Stop`: shut the VMM down.
    pub(crate) action_type: VmActionType,
}

/// Actions on the whole VM.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
pub(crate) enum VmActionType {
    /// Stop the guest and the VMM.
    Stop,
}

/// `GET /vm`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct VmInfo {
    /// Running, paused or failed; waiting or receiving on a destination with no VM yet.
    pub(crate) state: RunState,
    /// vCPUs (0 once shutting down).
    pub(crate) vcpus: usize,
    /// Why the VM failed, once it has.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) failure: Option<VmFailure>,
    /// What the lazy restore's loader has done so far: only for a restore through userfaultfd
    /// (`--mem-backend uffd`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) lazy_restore: Option<LazyRestoreInfo>,
}

/// [`VmInfo::lazy_restore`]: the loader's counts. Pages are 4 KiB pages whatever the regions'
/// page size (a 2 MiB page filled counts 512).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub(crate) struct LazyRestoreInfo {
    /// Pages filled from the memory file on the guest's first touch.
    copied_pages: u64,
    /// Pages filled with zeros (holes of the memory file).
    zeroed_pages: u64,
    /// Pages of a working set (`--prefetch`) filled ahead of the guest.
    prefetched_pages: u64,
    /// `UFFDIO_COPY` calls, for faults and prefetch: a call fills a run of neighbouring pages
    /// (a fault in a hugetlb region its whole 2 MiB page); zeros copied into hugetlb pages,
    /// and a call that found its page filled meanwhile, count too.
    copy_calls: u64,
    /// Whether the prefetch has gone through its whole list (true without one).
    prefetch_done: bool,
}

impl LazyRestoreInfo {
    /// The counts of `stats` now.
    pub(crate) fn of(stats: &kvm_memslots_persist::LoaderStats) -> Self {
        use std::sync::atomic::Ordering::Acquire;
        LazyRestoreInfo {
            copied_pages: stats.copied.load(Acquire),
            zeroed_pages: stats.zeroed.load(Acquire),
            prefetched_pages: stats.prefetched.load(Acquire),
            copy_calls: stats.copy_calls.load(Acquire),
            prefetch_done: stats.prefetch_done.load(Acquire),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvm_memslots_persist::LoaderStats;
    use serde_json::json;
    use std::sync::atomic::Ordering;

    #[test]
    fn get_vm_shows_a_loader_s_counts_only_for_a_lazy_restore() {
        let mut info = VmInfo {
            state: RunState::Running,
            vcpus: 1,
            failure: None,
            lazy_restore: None,
        };
        let value = serde_json::to_value(info.clone()).expect("serialises");
        assert_eq!(value, json!({"state": "Running", "vcpus": 1}));
        let stats = LoaderStats::default();
        stats.copied.store(1024, Ordering::Release);
        stats.zeroed.store(512, Ordering::Release);
        stats.prefetched.store(7, Ordering::Release);
        stats.copy_calls.store(3, Ordering::Release);
        stats.prefetch_done.store(true, Ordering::Release);
        info.lazy_restore = Some(LazyRestoreInfo::of(&stats));
        let value = serde_json::to_value(info).expect("serialises");
        assert_eq!(
            value["lazy_restore"],
            json!({
                "copied_pages": 1024,
                "zeroed_pages": 512,
                "prefetched_pages": 7,
                "copy_calls": 3,
                "prefetch_done": true,
            })
        );
    }
}
