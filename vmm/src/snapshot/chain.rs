//! The chain of snapshots a controller takes of a paused VM, whatever its guest kind: a Full
//! starts it, each Diff follows the last snapshot taken. The chain reads the dirty log as a
//! consumer of its own (a client's harvests and logging switches take nothing from it), and
//! each state file says what snapshot it is ([`SnapshotInfo`]). The guest kind writes only its
//! state file's contents, given the snapshot's info and layout.

use std::fs::File;
use std::path::{Path, PathBuf};

use kvm_memslots::{DirtyConsumer, DirtyPages, KvmVm, MemoryManager, Target};
use kvm_memslots_persist::{write_dirty_pages, write_memory_file, MemoryLayout};

use super::info::{MemoryCheck, SnapshotInfo};
use crate::control::snapshot::{SnapshotCreate, SnapshotType};
use crate::control::ControllerError;

/// The last snapshot of the chain: what the next Diff follows.
#[derive(Debug)]
struct SnapshotBase {
    /// What it was.
    info: SnapshotInfo,
    /// The pages a Diff that failed since harvested (kept for the next one).
    carried: Vec<DirtyPages>,
}

/// A VM's chain of snapshots: its dirty-log consumer (from the first Full on) and its last
/// snapshot.
#[derive(Debug, Default)]
pub struct SnapshotChain {
    base: Option<SnapshotBase>,
    consumer: Option<DirtyConsumer>,
}

type Memory = MemoryManager<KvmVm>;

impl SnapshotChain {
    /// A VM without snapshots.
    pub fn new() -> Self {
        Self::default()
    }

    /// The chain's reader of the dirty log, once a Full snapshot made one.
    pub fn consumer(&self) -> Option<DirtyConsumer> {
        self.consumer
    }

    /// Takes the snapshot `create` asks for of `memory` (its VM paused by the caller): creates
    /// both files (neither may exist), writes the memory file, then has `write_state` write
    /// the state file with the snapshot's info and layout. A failed snapshot leaves no file
    /// behind and the chain as it was (a Diff's harvested pages go into the next Diff; a Full
    /// that failed leaves no base to diff against).
    pub fn create(
        &mut self,
        memory: &Memory,
        create: &SnapshotCreate,
        write_state: impl FnOnce(SnapshotInfo, &MemoryLayout, &File) -> Result<(), ControllerError>,
    ) -> Result<SnapshotInfo, ControllerError> {
        if create.snapshot_type == SnapshotType::Diff && self.base.is_none() {
            return Err(ControllerError::bad(
                "no snapshot to diff against: take a Full snapshot first",
            ));
        }
        let files = new_files(&[&create.snapshot_path, &create.mem_file_path])?;
        let (state_file, mem_file) = (&files[0].1, &files[1].1);
        let written = self.write(
            memory,
            create.snapshot_type,
            state_file,
            mem_file,
            write_state,
        );
        if written.is_err() {
            // A failed snapshot leaves no file behind.
            for (path, _) in &files {
                let _ = std::fs::remove_file(path);
            }
        }
        written
    }

    fn write(
        &mut self,
        memory: &Memory,
        kind: SnapshotType,
        state_file: &File,
        mem_file: &File,
        write_state: impl FnOnce(SnapshotInfo, &MemoryLayout, &File) -> Result<(), ControllerError>,
    ) -> Result<SnapshotInfo, ControllerError> {
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
                self.base = None;
                // The chain logs every region, those added later too, so that a Diff can
                // follow; what was dirty before is in the full image.
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
                    self.end(memory);
                    return Err(e);
                }
            }
            SnapshotType::Diff => {
                // The layout may have changed since the last snapshot (regions added, removed,
                // moved): this Diff is laid out as memory is now, and merging follows region
                // ids (`snapshot-merge`).
                let chain = self.consumer.expect("a snapshot base has a chain");
                let carried = &mut self.base.as_mut().expect("checked by create").carried;
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
                match &self.base {
                    Some(base) if kind == SnapshotType::Diff => base.info.next_diff(check),
                    _ => SnapshotInfo::full(check),
                }
                .map_err(|e| failed(&format!("a snapshot id: {e}")))
            });
        let saved = info.and_then(|info| write_state(info, &layout, state_file).map(|()| info));
        let info = match saved {
            Ok(info) => info,
            Err(e) => {
                if kind == SnapshotType::Full {
                    self.end(memory);
                }
                self.keep_for_next_diff(harvested);
                return Err(e);
            }
        };
        self.base = Some(SnapshotBase {
            info,
            carried: Vec::new(),
        });
        Ok(info)
    }

    /// The chain's dirty-log consumer, made (logging every new region) if there is none.
    fn chain_consumer(&mut self, memory: &Memory) -> Result<DirtyConsumer, ControllerError> {
        if let Some(chain) = self.consumer {
            return Ok(chain);
        }
        let chain = memory.add_dirty_consumer()?;
        if let Err(e) = memory.log_new_regions_for(chain, true) {
            let _ = memory.remove_dirty_consumer(chain);
            return Err(e.into());
        }
        self.consumer = Some(chain);
        Ok(chain)
    }

    /// Ends the chain's consumer (a Full failed: there is no base to diff against).
    fn end(&mut self, memory: &Memory) {
        if let Some(chain) = self.consumer.take() {
            if memory.remove_dirty_consumer(chain).is_err() {
                // Its logging could not be stopped: keep it for the next Full.
                self.consumer = Some(chain);
            }
        }
    }

    /// Puts the pages a failed Diff harvested back for the next one.
    fn keep_for_next_diff(&mut self, harvested: Option<Vec<DirtyPages>>) {
        if let (Some(pages), Some(base)) = (harvested, self.base.as_mut()) {
            base.carried = pages;
        }
    }
}

/// Creates each of `paths` (which must not exist), or none of them.
fn new_files(paths: &[&Path]) -> Result<Vec<(PathBuf, File)>, ControllerError> {
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
