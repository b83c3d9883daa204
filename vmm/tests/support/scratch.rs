//! A scratch folder that the tests of one test binary share while they run, removed with what
//! it holds once the last of them ends, whether it passed or failed.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// How many [`Scratch`]es hold each folder. One lock for creating, counting and removing, so
/// that a test starting as the last one ends never loses its folder.
static HOLDERS: Mutex<BTreeMap<PathBuf, usize>> = Mutex::new(BTreeMap::new());

/// A hold on the scratch folder `$TMPDIR/tinyvmm-TAG-PID` (created if need be): each test that
/// puts files there holds one while it runs (its first local, so that it is dropped after the
/// VMM processes writing there). The tests of a binary run at the same time and share the
/// folder: the last hold dropped, as its test passes or unwinds from a failure, removes it.
#[derive(Debug)]
pub struct Scratch {
    dir: PathBuf,
}

impl Scratch {
    /// Holds the folder for `tag`.
    pub fn hold(tag: &str) -> Scratch {
        let dir = folder(tag);
        let mut holders = HOLDERS.lock().unwrap_or_else(|p| p.into_inner());
        std::fs::create_dir_all(&dir).expect("a scratch directory");
        *holders.entry(dir.clone()).or_insert(0) += 1;
        Scratch { dir }
    }

    /// The folder.
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

/// The folder for `tag`: `$TMPDIR/tinyvmm-TAG-PID`.
pub fn folder(tag: &str) -> PathBuf {
    std::env::temp_dir().join(format!("tinyvmm-{tag}-{}", std::process::id()))
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let mut holders = HOLDERS.lock().unwrap_or_else(|p| p.into_inner());
        let Some(count) = holders.get_mut(&self.dir) else {
            return;
        };
        *count -= 1;
        if *count == 0 {
            holders.remove(&self.dir);
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}
