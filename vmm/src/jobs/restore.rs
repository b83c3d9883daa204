//! `tinyvmm restore`: a test-guest VM restored from a snapshot (`PUT /snapshot/create`), served
//! paused as `serve` serves a new one. The state file is read and checked before anything is
//! built; nothing runs until every byte is loaded and every vCPU has its state.

use std::path::PathBuf;
use std::sync::Arc;

use vmm_sys_util::eventfd::EventFd;

use super::serve::ServeError;
use crate::test_guest::controller::Controller;
use crate::test_guest::snapshot::SnapshotState;
use crate::test_guest::vcpus::{MemBackend, TestVm};
use crate::vm::VmOptions;

/// The files of a snapshot to restore from.
#[derive(Debug, Clone)]
pub struct RestoreFrom {
    /// The state file (`snapshot_path` of `PUT /snapshot/create`).
    pub snapshot: PathBuf,
    /// The memory file (`mem_file_path`; with Diff snapshots, merged onto the Full first).
    pub mem_file: PathBuf,
    /// How memory comes from the memory file.
    pub backend: MemBackend,
}

/// The controller of a VM restored from `from` in a VM made with `options`, paused, its vCPUs
/// telling `stopped` when they stop.
pub(crate) fn restored_controller(
    from: &RestoreFrom,
    options: VmOptions,
    stopped: &Arc<EventFd>,
) -> Result<Controller, ServeError> {
    // Nothing runs until every byte is loaded and every vCPU has its state.
    let read = |path: &PathBuf| {
        std::fs::read(path).map_err(|source| ServeError::Restore {
            path: path.clone(),
            reason: source.to_string(),
        })
    };
    let state =
        SnapshotState::from_bytes(&read(&from.snapshot)?).map_err(|e| ServeError::Restore {
            path: from.snapshot.clone(),
            reason: e.to_string(),
        })?;
    let mem_file = std::fs::File::open(&from.mem_file).map_err(|source| ServeError::Restore {
        path: from.mem_file.clone(),
        reason: source.to_string(),
    })?;
    let vm = TestVm::restore(&state.layout, &mem_file, from.backend, options)?;
    let vcpus = vm.start_restored_vcpus(&state.vcpus, stopped)?;
    Controller::new(vm, vcpus)
        .paused()
        .with_hotplug(state.hotplug.as_ref())
        .map_err(|e| ServeError::Restore {
            path: from.snapshot.clone(),
            reason: e.to_string(),
        })
}
