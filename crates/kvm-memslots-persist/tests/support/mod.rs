//! What the crate's integration tests share.

use std::fs::File;
use std::path::PathBuf;

/// A new file in the temporary directory, removed when this is dropped.
#[allow(dead_code)] // Every test binary but working_set.rs uses it.
pub struct TempFile(pub PathBuf);

#[allow(dead_code)] // As TempFile.
impl TempFile {
    /// A new, empty file named after `name`, the test binary and the process (a file a run
    /// left is removed first), and the file open for reading and writing.
    pub fn new(name: &str) -> (Self, File) {
        let binary = std::env::current_exe()
            .ok()
            .and_then(|exe| exe.file_stem().map(|s| s.to_string_lossy().into_owned()))
            .unwrap_or_default();
        let path = std::env::temp_dir().join(format!(
            "kvm-memslots-persist-{binary}-{}-{name}",
            std::process::id()
        ));
        let file = kvm_test_support::files::new_file_at(&path);
        (TempFile(path), file)
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Whether the host's hugetlb pool has `pages` free pages; if not, a loud line saying the test
/// did not run.
#[allow(dead_code)] // The huge-page tests use it; the others do not.
pub fn pool_has(test: &str, pages: u64) -> bool {
    let available = kvm_memslots::hugetlb_pages_available();
    if available < pages {
        eprintln!(
            "SKIPPED kvm-memslots-persist::{test}: the hugetlb pool has {available} free 2 MiB \
             pages, the test needs {pages} (resources/setup-host.sh reserves a pool)"
        );
        return false;
    }
    true
}

/// Lazy restores onto a fake KVM, recording or prefetching a working set.
#[allow(dead_code)] // The lazy restore tests use it; the others do not.
pub mod lazy {
    use std::fs::File;
    use std::sync::atomic::Ordering;
    use std::time::{Duration, Instant};

    use kvm_memslots::testing::FakeKvm;
    use kvm_memslots::MemoryManager;
    use kvm_memslots_persist::{LazyLoader, LazyOptions, MemoryLayout, WorkingSet};

    /// A new VM (a fake KVM of 64 slots) built to `layout` and restored lazily from `file`
    /// with `options`.
    pub fn restored(
        layout: &MemoryLayout,
        file: &File,
        options: LazyOptions,
    ) -> (MemoryManager<FakeKvm>, LazyLoader) {
        let b = MemoryManager::new(FakeKvm::new(64, true));
        layout.build(&b).expect("built");
        let loader = LazyLoader::start_with(&b, layout, file, options).expect("userfaultfd");
        (b, loader)
    }

    /// Loader options that prefetch `set`.
    pub fn prefetching(set: WorkingSet) -> LazyOptions {
        LazyOptions {
            prefetch: Some(set),
            ..LazyOptions::default()
        }
    }

    /// Waits (a deadline only guards a hang) until the loader's prefetch is done.
    pub fn wait_prefetched(loader: &LazyLoader) {
        let deadline = Instant::now() + Duration::from_secs(60);
        while !loader.stats().prefetch_done.load(Ordering::Acquire) {
            assert!(Instant::now() < deadline, "the prefetch never ended");
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}
