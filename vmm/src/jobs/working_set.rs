//! The working-set files of `tinyvmm restore` (`--prefetch`, `--record-working-set`): a list
//! recorded on one lazy restore of a snapshot, read, checked against the snapshot and fetched
//! ahead of the guest on the next; or the pages a restore touches first, written when the
//! recording ends (after `--record-secs`, or when the VMM stops). The recording and the
//! prefetch are the memory backend's (`crate::vm::restore::restore_memory_with`, for the
//! test guest and a Linux guest alike); this is their files.

use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use kvm_memslots_persist::{LazyOptions, MemoryLayout, Recording, WorkingSet};

use crate::test_guest::snapshot::open_input;

/// What a restore does with working sets.
#[derive(Debug, Clone, Default)]
pub struct WorkingSetFiles {
    /// Fetch this list (recorded on a restore of the same snapshot) ahead of the guest.
    pub prefetch: Option<PathBuf>,
    /// Record the pages the VM touches first, in that order, into this file (replaced when
    /// the recording ends).
    pub record: Option<PathBuf>,
    /// End the recording this long after the restore; otherwise when the VMM stops.
    pub record_for: Option<Duration>,
}

impl WorkingSetFiles {
    /// The loader's options for a restore of snapshot `snapshot`, whose layout is `layout`:
    /// the list read and checked (refused with the reason when it is another snapshot's or
    /// names pages the layout does not have), the recording set to write its file. Errors
    /// name the file and what is wrong.
    pub fn lazy_options(
        &self,
        snapshot: u128,
        layout: &MemoryLayout,
    ) -> Result<LazyOptions, (PathBuf, String)> {
        let mut options = LazyOptions::default();
        if let (Some(list), Some(_)) = (&self.prefetch, &self.record) {
            return Err((
                list.clone(),
                "a restore that prefetches a working set cannot record one (it would see only \
                 the pages the list missed): record on a restore without --prefetch"
                    .into(),
            ));
        }
        if let Some(path) = &self.prefetch {
            let refused = |reason: String| (path.clone(), reason);
            let list = read_list(path).map_err(refused)?;
            list.check(snapshot, layout)
                .map_err(|e| refused(e.to_string()))?;
            options.prefetch = Some(list);
        }
        if let Some(path) = &self.record {
            // The file is made now, so that a path that cannot be written is refused before
            // anything runs; it takes the list's name when the recording ends.
            let pending = PendingList::create(path).map_err(|e| (path.clone(), e))?;
            options.record = Some(Recording::new(snapshot, self.record_for, move |set| {
                pending.write(&set)
            }));
        }
        Ok(options)
    }
}

/// The largest list file read (16 bytes a run: 16 Mi runs).
const MAX_LIST_FILE: u64 = 256 << 20;

/// Reads the list file at `path`, refusing what is not a regular file (never waiting on a
/// FIFO), a file over [`MAX_LIST_FILE`], and what [`WorkingSet::from_bytes`] refuses. The
/// error does not name the path: the caller does.
fn read_list(path: &Path) -> Result<WorkingSet, String> {
    let mut file = open_input(path)?;
    let size = file
        .metadata()
        .map_err(|e| format!("reading its size: {e}"))?
        .len();
    if size > MAX_LIST_FILE {
        return Err(format!(
            "{size} bytes, over the {} MiB a working-set file may have",
            MAX_LIST_FILE >> 20
        ));
    }
    let mut bytes = Vec::with_capacity(size as usize);
    file.read_to_end(&mut bytes)
        .map_err(|e| format!("reading it: {e}"))?;
    WorkingSet::from_bytes(&bytes).map_err(|e| e.to_string())
}

/// Where a recording is written before it takes `path`'s name: a file of its own (the
/// process's id and a count), so that two restores recording into one path at once (two clones
/// of a snapshot) each write a whole list, and the last to end gives `path` its list. (A shared
/// name let the second restore truncate the first one's file under it: each then wrote over
/// the other's bytes, and `path` got a list that its own header refuses.)
fn partial_path(path: &Path) -> PathBuf {
    static RECORDINGS: AtomicU64 = AtomicU64::new(0);
    let mut name = path.as_os_str().to_owned();
    name.push(format!(
        ".{}-{}.partial",
        std::process::id(),
        RECORDINGS.fetch_add(1, Ordering::Relaxed)
    ));
    PathBuf::from(name)
}

/// A recording's file, made before the restore: written and renamed to its name when the
/// recording ends, removed if the recording never starts (a restore refused later on).
struct PendingList {
    file: Option<File>,
    partial: PathBuf,
    path: PathBuf,
}

impl PendingList {
    /// Makes the recording's file for `path`; the error says why it cannot be made.
    fn create(path: &Path) -> Result<Self, String> {
        let partial = partial_path(path);
        let file = File::create(&partial)
            .map_err(|e| format!("creating {} for the recording: {e}", partial.display()))?;
        Ok(PendingList {
            file: Some(file),
            partial,
            path: path.to_owned(),
        })
    }

    /// Writes `set` and gives the file its name, so that `path` is either the whole list or
    /// absent; says on stderr what was written, or why nothing was.
    fn write(mut self, set: &WorkingSet) {
        let Some(mut file) = self.file.take() else {
            return;
        };
        let written = file
            .write_all(&set.to_bytes())
            .and_then(|()| file.sync_all())
            .and_then(|()| std::fs::rename(&self.partial, &self.path));
        match written {
            Ok(()) => crate::lifecycle::log(
                crate::lifecycle::LogLevel::Info,
                format_args!(
                    "working set recorded: {} pages in {} runs, into {}",
                    set.pages(),
                    set.runs.len(),
                    self.path.display()
                ),
            ),
            Err(e) => {
                eprintln!(
                    "tinyvmm: writing the working set into {} failed: {e}",
                    self.path.display()
                );
                let _ = std::fs::remove_file(&self.partial);
            }
        }
    }
}

impl Drop for PendingList {
    fn drop(&mut self) {
        if self.file.is_some() {
            let _ = std::fs::remove_file(&self.partial);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(snapshot: u128, runs: &[std::ops::Range<u64>]) -> WorkingSet {
        WorkingSet {
            snapshot,
            layout_crc32: 7,
            runs: runs.to_vec(),
        }
    }

    /// Two restores of one snapshot recording into one path at once (the second made its file
    /// before the first wrote): each list is written whole, and the path holds the last one
    /// written, which reads back. (With one shared partial file the second truncated the
    /// first's under it, and the path got a list its own header refuses.)
    #[test]
    fn two_recordings_into_one_path_each_write_a_whole_list() {
        let dir = std::env::temp_dir().join(format!("tinyvmm-wset-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("a scratch folder");
        let path = dir.join("snap.wset");
        let (long, short) = (set(1, &[0..4, 9..12, 20..21]), set(1, &[5..6, 30..31]));
        let first = PendingList::create(&path).expect("the first recording's file");
        let second = PendingList::create(&path).expect("the second recording's file");
        first.write(&long);
        assert_eq!(read_list(&path), Ok(long), "the first list, whole");
        second.write(&short);
        assert_eq!(read_list(&path), Ok(short), "the last list, whole");
        let left: Vec<_> = std::fs::read_dir(&dir)
            .expect("the folder")
            .map(|e| e.expect("an entry").file_name())
            .collect();
        assert_eq!(left, ["snap.wset"], "no partial file is left");
        std::fs::remove_dir_all(&dir).ok();
    }
}
