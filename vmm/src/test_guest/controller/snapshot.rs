//! The test guest's snapshots: Full and Diff memory files and the state file, on a paused VM.
//! Each state file says what snapshot it is (`SnapshotInfo`): a Full starts a chain, each Diff
//! follows the last snapshot taken.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::Arc;

use kvm_memslots::{DirtyConsumer, DirtyPages, Target};
use kvm_memslots_persist::{write_dirty_pages, write_memory_file, MemoryLayout};

use super::Controller;
use crate::control::snapshot::{SnapshotCreate, SnapshotType};
use crate::control::vm::RunState;
use crate::control::{ControllerError, ErrorKind};
use crate::test_guest::hotplug::HotplugArea;
use crate::test_guest::snapshot::{MemoryCheck, SnapshotInfo, SnapshotState, STATE_VERSION};

/// The last snapshot of the chain: what the next Diff follows.
#[derive(Debug)]
pub(super) struct SnapshotBase {
    /// What it was.
    info: SnapshotInfo,
    /// The pages a Diff that failed since harvested (kept for the next one).
    carried: Vec<DirtyPages>,
}

impl Controller {
    pub(super) fn create_snapshot(
        &mut self,
        create: SnapshotCreate,
    ) -> Result<(), ControllerError> {
        if self.state != RunState::Paused {
            return Err(ControllerError::bad(
                "the VM is running: pause it first with PATCH /vm {\"state\": \"Paused\"}",
            ));
        }
        let memory = Arc::clone(self.vm.memory());
        if create.snapshot_type == SnapshotType::Diff && self.snapshot_base.is_none() {
            return Err(ControllerError::bad(
                "no snapshot to diff against: take a Full snapshot first",
            ));
        }
        let files = new_files(&[&create.snapshot_path, &create.mem_file_path])?;
        let (state_file, mem_file) = (&files[0].1, &files[1].1);
        let written = self.write_snapshot(&memory, create.snapshot_type, state_file, mem_file);
        if written.is_err() {
            // A failed snapshot leaves no file behind.
            for (path, _) in &files {
                let _ = std::fs::remove_file(path);
            }
        }
        written
    }

    fn write_snapshot(
        &mut self,
        memory: &kvm_memslots::MemoryManager<kvm_memslots::KvmVm>,
        kind: SnapshotType,
        state_file: &File,
        mem_file: &File,
    ) -> Result<(), ControllerError> {
        let failed = |e: &dyn std::fmt::Display| {
            ControllerError::internal(format!("the snapshot failed: {e}"))
        };
        // What a Diff harvested, until the whole snapshot is written: if any step fails, every
        // page of it goes into the next Diff.
        let mut harvested = None;
        let mut layout = MemoryLayout::of(memory);
        match kind {
            SnapshotType::Full => {
                // The harvest below takes the dirty bits a Diff against an earlier base would
                // need: until this Full is written whole, there is no base.
                self.snapshot_base = None;
                // The chain reads the dirty log as a consumer of its own: a client's harvests
                // and its logging switches take nothing from it. It logs every region, those
                // added later too, so that a Diff can follow; what was dirty before is in the
                // full image.
                let chain = self.chain_consumer(memory)?;
                let full = memory
                    .start_dirty_log_for(chain, Target::All)
                    .and_then(|()| memory.harvest_dirty_for(chain, Target::All))
                    .map_err(ControllerError::from)
                    .and_then(|_| {
                        // The regions log now: the layout says so.
                        layout = MemoryLayout::of(memory);
                        write_memory_file(memory, &layout, mem_file).map_err(|e| failed(&e))
                    });
                if let Err(e) = full {
                    // No chain: its logging ends where nobody else logs.
                    self.end_chain(memory);
                    return Err(e);
                }
            }
            SnapshotType::Diff => {
                // The layout may have changed since the last snapshot (regions added, removed,
                // moved): this Diff is laid out as memory is now, and merging follows region
                // ids (`snapshot-merge`).
                let chain = self.chain.expect("a snapshot base has a chain");
                let carried = &mut self
                    .snapshot_base
                    .as_mut()
                    .expect("checked by the caller")
                    .carried;
                let mut dirty = std::mem::take(carried);
                match memory.harvest_dirty_for(chain, Target::All) {
                    Ok(now) => dirty.extend(now),
                    Err(e) => {
                        *carried = dirty;
                        return Err(e.into());
                    }
                }
                let written = write_dirty_pages(memory, &layout, &dirty, mem_file);
                harvested = Some(dirty);
                if let Err(e) = written {
                    self.keep_for_next_diff(harvested);
                    return Err(failed(&e));
                }
            }
        }
        // What this snapshot is, with the check of its point's memory (the VM is paused).
        let info = MemoryCheck::of_memory(&*memory.current(), &layout)
            .map_err(|e| failed(&format!("reading guest memory: {e}")))
            .and_then(|check| {
                match &self.snapshot_base {
                    Some(base) if kind == SnapshotType::Diff => base.info.next_diff(check),
                    _ => SnapshotInfo::full(check),
                }
                .map_err(|e| failed(&format!("a snapshot id: {e}")))
            });
        let saved = info.and_then(|info| {
            self.write_state(info, &layout, state_file)
                .map_err(|e| failed(&e))
                .map(|()| info)
        });
        let info = match saved {
            Ok(info) => info,
            Err(e) => {
                if kind == SnapshotType::Full {
                    self.end_chain(memory);
                }
                self.keep_for_next_diff(harvested);
                return Err(e);
            }
        };
        self.snapshot_base = Some(SnapshotBase {
            info,
            carried: Vec::new(),
        });
        Ok(())
    }

    /// The snapshot chain's dirty-log consumer, made (logging every new region) if there is
    /// none.
    fn chain_consumer(
        &mut self,
        memory: &kvm_memslots::MemoryManager<kvm_memslots::KvmVm>,
    ) -> Result<DirtyConsumer, ControllerError> {
        if let Some(chain) = self.chain {
            return Ok(chain);
        }
        let chain = memory.add_dirty_consumer()?;
        if let Err(e) = memory.log_new_regions_for(chain, true) {
            let _ = memory.remove_dirty_consumer(chain);
            return Err(e.into());
        }
        self.chain = Some(chain);
        Ok(chain)
    }

    /// Ends the snapshot chain's consumer (a Full failed: there is no base to diff against).
    fn end_chain(&mut self, memory: &kvm_memslots::MemoryManager<kvm_memslots::KvmVm>) {
        if let Some(chain) = self.chain.take() {
            if memory.remove_dirty_consumer(chain).is_err() {
                // Its logging could not be stopped: keep it for the next Full.
                self.chain = Some(chain);
            }
        }
    }

    /// Puts the pages a failed Diff harvested back for the next one.
    fn keep_for_next_diff(&mut self, harvested: Option<Vec<DirtyPages>>) {
        if let (Some(pages), Some(base)) = (harvested, self.snapshot_base.as_mut()) {
            base.carried = pages;
        }
    }

    /// Writes what the snapshot is, every vCPU's state, the layout and the hotplug area into
    /// the state file.
    fn write_state(
        &mut self,
        info: SnapshotInfo,
        layout: &MemoryLayout,
        state_file: &File,
    ) -> Result<(), ControllerError> {
        let vcpus = self.vcpus.as_mut().ok_or_else(|| {
            ControllerError::new(ErrorKind::Unavailable, "the VM is shutting down")
        })?;
        let states = vcpus
            .save_states()
            .map_err(|e| ControllerError::internal(e.to_string()))?;
        let layout = layout.clone();
        let state = SnapshotState {
            version: STATE_VERSION,
            snapshot: Some(info),
            layout,
            vcpus: states,
            hotplug: self.hotplug.as_ref().map(HotplugArea::state),
        };
        state_file
            .write_all_at(&state.to_bytes(), 0)
            .map_err(|e| ControllerError::internal(e.to_string()))
    }
}

/// Creates each of `paths` (which must not exist), or none of them.
fn new_files(
    paths: &[&std::path::Path],
) -> Result<Vec<(std::path::PathBuf, File)>, ControllerError> {
    let mut files = Vec::with_capacity(paths.len());
    for path in paths {
        match File::options()
            .read(true)
            .write(true)
            .create_new(true)
            .open(path)
        {
            Ok(file) => files.push((path.to_path_buf(), file)),
            Err(e) => {
                for (made, _) in &files {
                    let _ = std::fs::remove_file(made);
                }
                return Err(ControllerError::bad(format!(
                    "cannot create {}: {e} (snapshot files must not exist)",
                    path.display()
                )));
            }
        }
    }
    Ok(files)
}
