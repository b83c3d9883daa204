//! `tinyvmm restore`: a VM restored from a snapshot (`PUT /snapshot/create`), paused: a test
//! guest served as `serve` serves a new one (`restored_controller`), a Linux guest run as
//! `boot` runs one, its console on stdout (`restore_linux`); the state file says which. The
//! state file is read once (`StateFile`: the guest kind told from its bytes, then the
//! kind's state read from them) and checked before anything is built, and the memory file
//! checked against what the state file recorded of it: a Diff
//! restores from its chain merged (`tinyvmm snapshot-merge`) with its own state file, and its
//! own memory file, or another snapshot's or VM's, is refused. Nothing runs until every byte is
//! loaded and every vCPU has its state.

use std::path::PathBuf;
use std::sync::Arc;

use vmm_sys_util::eventfd::EventFd;

use super::args::{file_to_write, seconds, ApiArgs};
use super::boot::{run_linux, BootJobError, LinuxRun};
use super::working_set::WorkingSetFiles;
use crate::api::server::ApiSocket;
use crate::linux::state::LinuxState;
use crate::linux::{BootEnding, LinuxVm};
use crate::snapshot::StateFile;
use crate::test_guest::controller::Controller;
use crate::test_guest::snapshot::{
    open_input, MemoryMismatch, SnapshotInfo, SnapshotKind, SnapshotState,
};
use crate::test_guest::vcpus::{GuestError, MemBackend, TestVm};
use crate::vm::VmOptions;

/// Why a test guest could not be restored (`serve` with a snapshot).
#[derive(Debug, thiserror::Error)]
pub enum RestoreError {
    /// A snapshot file could not be read or is not valid.
    #[error("cannot restore from {path}: {reason}")]
    File {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// The VM could not be rebuilt.
    #[error(transparent)]
    Vm(#[from] GuestError),
}

/// The files of a snapshot to restore from.
#[derive(Debug, Clone)]
pub struct RestoreFrom {
    /// The state file (`snapshot_path` of `PUT /snapshot/create`).
    pub snapshot: PathBuf,
    /// The memory file (`mem_file_path`; with Diff snapshots, merged onto the Full first).
    pub mem_file: PathBuf,
    /// How memory comes from the memory file.
    pub backend: MemBackend,
    /// A working set to prefetch, or to record (the uffd backend's).
    pub working_set: WorkingSetFiles,
    /// Every region in pages of this size rather than the ones the snapshot was taken with
    /// (`restore --page-size`); `None`: the snapshot's.
    pub page_size: Option<kvm_memslots::PageSize>,
}

impl RestoreFrom {
    /// The layout to rebuild: the state file's `layout`, or with every region in pages of
    /// [`page_size`](Self::page_size) (refused, naming the region, where one does not fit
    /// the new page size's grid). The restored VM's memory is built from it, its working-set
    /// files are checked against it, and its later snapshots record it.
    fn layout(
        &self,
        layout: kvm_memslots_persist::MemoryLayout,
    ) -> Result<kvm_memslots_persist::MemoryLayout, String> {
        match self.page_size {
            None => Ok(layout),
            Some(page_size) => layout
                .with_page_size(page_size)
                .map_err(|e| format!("--page-size {}: {e}", page_size.name())),
        }
    }
}

/// The controller of a VM restored from `from` in a VM made with `options`, paused, its vCPUs
/// telling `stopped` when they stop; its state file's bytes are `read` if read already
/// (`tinyvmm restore` reads them to tell the guest kind), else read here.
pub(crate) fn restored_controller(
    from: &RestoreFrom,
    read: Option<&StateFile>,
    options: VmOptions,
    stopped: &Arc<EventFd>,
) -> Result<Controller, RestoreError> {
    // Nothing runs until every byte is loaded and every vCPU has its state.
    let refused = |path: &PathBuf, reason: String| RestoreError::File {
        path: path.clone(),
        reason,
    };
    let state = match read {
        Some(read) => read.state(),
        None => SnapshotState::read_file(&from.snapshot),
    };
    let mut state = state.map_err(|e| refused(&from.snapshot, e.to_string()))?;
    state.layout = from
        .layout(state.layout)
        .map_err(|e| refused(&from.snapshot, e))?;
    let (mem_file, lazy) = memory_of(from, state.snapshot.as_ref(), &state.layout)
        .map_err(|(path, reason)| refused(&path, reason))?;
    let vm = TestVm::restore_with(&state.layout, &mem_file, from.backend, lazy, options)?;
    let vcpus = vm.start_restored_vcpus(&state.vcpus, stopped)?;
    Controller::new(vm, vcpus)
        .paused()
        .with_hotplug(state.guest.hotplug.as_ref())
        .map_err(|e| RestoreError::File {
            path: from.snapshot.clone(),
            reason: e.to_string(),
        })
}

/// Restores the Linux guest of `from` with its console on `output`, paused, serving its API on
/// `api_sock`, within `limits`, and runs it as `boot` does until it ends (a client resumes
/// it). The state file (`read` from `from`'s, once) is checked, and the memory file checked
/// against it, before anything is built.
pub(super) fn restore_linux(
    from: &RestoreFrom,
    read: &StateFile,
    api_sock: PathBuf,
    output: crate::devices::legacy::ConsoleOutput,
    limits: Option<kvm_memslots::MemoryLimits>,
) -> Result<BootEnding, BootJobError> {
    let refused = |path: &PathBuf, reason: String| BootJobError::Restore {
        path: path.clone(),
        reason,
    };
    let mut state: LinuxState = read
        .state()
        .map_err(|e| refused(&from.snapshot, e.to_string()))?;
    state.layout = from
        .layout(state.layout)
        .map_err(|e| refused(&from.snapshot, e))?;
    let (mem_file, lazy) = memory_of(from, state.snapshot.as_ref(), &state.layout)
        .map_err(|(path, reason)| refused(&path, reason))?;
    // A client that finds the socket may signal the VMM before its run loop exists.
    crate::lifecycle::catch_termination_signals()?;
    let api = ApiSocket::bind(&api_sock)?;
    let linux = LinuxVm::restore(&state, (&mem_file, from.backend, lazy), output, limits)?;
    let vcpus = linux.restored_vcpus(&state)?;
    crate::lifecycle::log(
        crate::lifecycle::LogLevel::Info,
        format_args!(
            "Linux guest restored from {} ({} vCPUs, {} regions), paused: PATCH /vm \
             {{\"state\": \"Resumed\"}} on {} runs it",
            from.snapshot.display(),
            state.vcpus.len(),
            state.layout.regions.len(),
            api_sock.display()
        ),
    );
    run_linux(
        &linux,
        vcpus,
        LinuxRun {
            api: Some(api),
            paused: true,
            ..LinuxRun::default()
        },
    )
}

/// `from`'s memory file, checked against what the state file recorded of it (`info`), and the
/// lazy loader's options for its working-set files, checked against the snapshot and
/// `layout`; or the file at fault and why.
fn memory_of(
    from: &RestoreFrom,
    info: Option<&SnapshotInfo>,
    layout: &kvm_memslots_persist::MemoryLayout,
) -> Result<(std::fs::File, kvm_memslots_persist::LazyOptions), (PathBuf, String)> {
    let mem_file = open_input(&from.mem_file).map_err(|e| (from.mem_file.clone(), e))?;
    if let Some(info) = info {
        info.memory
            .check(&mem_file)
            .map_err(|e| (from.snapshot.clone(), wrong_memory(from, info, &e)))?;
    }
    let lazy = from
        .working_set
        .lazy_options(info.map_or(0, |i| i.id.0), layout)?;
    Ok((mem_file, lazy))
}

/// Why `from`'s memory file is not the memory of the snapshot `info` (`mismatch`), and for a
/// Diff what to restore instead.
fn wrong_memory(from: &RestoreFrom, info: &SnapshotInfo, mismatch: &MemoryMismatch) -> String {
    let (state, mem) = (from.snapshot.display(), from.mem_file.display());
    match info.kind {
        SnapshotKind::Full => format!(
            "{mem} is not the memory of Full snapshot {} ({mismatch}): another snapshot's or \
             another VM's memory file?",
            info.id
        ),
        SnapshotKind::Diff => format!(
            "{mem} is not the memory of Diff snapshot {} ({mismatch}): a Diff's own memory file \
             has only the pages changed since its parent; merge its chain with `tinyvmm \
             snapshot-merge --out MERGED FULL.state FULL.mem ... {state} DIFF.mem` and restore \
             MERGED with this last state file",
            info.id
        ),
    }
}

/// `tinyvmm restore`'s arguments: the snapshot's files, how its memory comes back, its
/// working set, and the API socket it is served on. A test guest restored is served as
/// `serve` serves one, so the subcommand runs there ([`super::serve::restore`]).
#[derive(Debug, clap::Args)]
pub struct RestoreArgs {
    /// The state file a snapshot wrote (`snapshot_path` of PUT /snapshot/create).
    #[arg(long)]
    pub(crate) snapshot: PathBuf,
    /// The memory file: a Full's own (`mem_file_path`), or for a Diff its chain merged with
    /// `tinyvmm snapshot-merge` (a Diff's own memory file is refused).
    #[arg(long)]
    pub(crate) mem_file: PathBuf,
    /// copy: read the memory in before the guest runs; file: map the file privately, pages
    /// load when first touched; uffd: a userfaultfd handler fills each page on first touch.
    #[arg(long, value_enum, default_value_t)]
    pub(crate) mem_backend: MemBackend,
    /// Record the pages the VM touches first, in that order, into this file when the
    /// recording ends (after --record-secs, on PUT /working-set/stop, or when the VMM stops).
    /// Needs --mem-backend uffd [default: no recording]
    #[arg(long, value_name = "PATH", conflicts_with = "prefetch", value_parser = file_to_write)]
    pub(crate) record_working_set: Option<PathBuf>,
    /// End the recording this many seconds after the restore [default: when the VMM stops]
    #[arg(long, value_name = "N", requires = "record_working_set", value_parser = seconds)]
    pub(crate) record_secs: Option<std::time::Duration>,
    /// Fetch the pages of this list (recorded on a restore of the same snapshot) ahead of the
    /// guest while the rest still loads on fault. Needs --mem-backend uffd [default: none]
    #[arg(long, value_name = "PATH")]
    pub(crate) prefetch: Option<PathBuf>,
    /// Every region in pages of this size rather than the ones the snapshot was taken with
    /// (2m: each region's guest address, size and slots on the 2 MiB grid, and the hugetlb pool
    /// must hold them; a working set recorded with one page size serves restores with that
    /// size) [default: the snapshot's]
    #[arg(long, value_enum)]
    pub(crate) page_size: Option<crate::control::memory::RegionPageSize>,
    /// The API socket and the VM's limits (its memory and vCPUs are the snapshot's).
    #[command(flatten)]
    pub(crate) api: ApiArgs,
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use crate::linux::state::LinuxState;
    use crate::snapshot::{GuestKind, StateFile};
    use crate::test_guest::snapshot::SnapshotState;

    /// The file of `name` in `vmm/tests/data`.
    fn data_file(name: &str) -> std::path::PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/data")
            .join(name)
    }

    /// What `tinyvmm restore` reads: a state file of an older format is read once, from its
    /// path: its kind is told from the bytes read, and the same bytes read as that kind's
    /// state (not as the other kind's); a State record read as a state file is refused,
    /// saying it is no snapshot.
    #[test]
    fn an_older_state_file_is_read_once_for_its_kind_and_its_state() {
        for name in ["test-guest-v2.state", "test-guest-v3.state"] {
            let read = StateFile::read(&data_file(name)).unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(read.kind().expect("a kind"), GuestKind::TestGuest, "{name}");
            let state: SnapshotState = read.state().unwrap_or_else(|e| panic!("{name}: {e}"));
            assert!(state.snapshot.is_some(), "{name}");
            let why = read.state::<crate::linux::state::LinuxPart>();
            let why = why.expect_err("not a Linux guest's").to_string();
            assert!(why.contains("not a Linux guest's"), "{name}: {why}");
        }
        let read = StateFile::read(&data_file("linux-v1.state")).expect("read");
        assert_eq!(read.kind().expect("a kind"), GuestKind::Linux);
        let state: LinuxState = read.state().expect("a Linux guest's state");
        assert!(state.snapshot.is_some());
        let record = StateFile::read(&data_file("test-guest-v3.record")).expect("read");
        let why = record.state::<crate::test_guest::snapshot::TestGuestPart>();
        let why = why.expect_err("no snapshot").to_string();
        assert!(why.contains("does not say what snapshot it is"), "{why}");
    }
}
