//! Why a snapshot could not be written, read or restored.

use kvm_memslots::Error;

/// Why a snapshot could not be written, read or restored.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    /// A file operation failed.
    #[error("{what} failed: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The system's error.
        source: std::io::Error,
    },
    /// A layout (or its file) is not one this version reads, or does not fit the manager.
    #[error("invalid memory layout: {0}")]
    Format(String),
    /// The memory file does not fit the layout.
    #[error("the memory file is {found} bytes; the layout needs {expected}")]
    FileSize {
        /// The file's size.
        found: u64,
        /// The layout's.
        expected: u64,
    },
    /// A working set (list file or recording) is not one this snapshot can use.
    #[error("working set refused: {0}")]
    WorkingSet(String),
    /// The manager refused a region.
    #[error(transparent)]
    Memory(#[from] Error),
    /// A write in slices was stopped between two slices by its caller ([`Slices`]), with
    /// the caller's reason; the file holds part of what it was to hold.
    ///
    /// [`Slices`]: crate::memory_file::Slices
    #[error("stopped: {0}")]
    Stopped(String),
    /// What was asked is valid but not something this version does, with why and what to do
    /// instead.
    #[error("not supported: {0}")]
    Unsupported(String),
}

/// A map from an I/O error to [`SnapshotError::Io`] saying `what` was being done.
pub(crate) fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> SnapshotError {
    let what = what.into();
    move |source| SnapshotError::Io { what, source }
}
