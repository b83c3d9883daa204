//! What the crate's integration tests share.

use std::fs::File;
use std::path::PathBuf;

/// A new file in the temporary directory, removed when this is dropped.
pub struct TempFile(pub PathBuf);

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
