//! `tinyvmm snapshot-merge`: a chain of snapshots, its Full first and then each Diff in order,
//! merged into the memory file of its last point, to restore with the last state file. Every
//! input is checked before anything is written: each state file (read as `restore` reads it),
//! each memory file's kind and size (and the Full's first bytes), and the links: a Full first,
//! then each snapshot the child of the one before, all of one VM, none twice. The merged file
//! is then checked against what the last state file recorded of its memory, and removed if it
//! does not match.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use kvm_memslots_persist::{merge_snapshots, MemoryLayout};

use crate::lifecycle::{log, LogLevel};
use crate::linux::state::LinuxState;
use crate::snapshot::{GuestKind, StateFile};
use crate::test_guest::snapshot::{open_input, SnapshotInfo, SnapshotKind, SnapshotState};

/// What a merge did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct MergeReport {
    /// Snapshots merged.
    snapshots: usize,
    /// Bytes copied into the merged file.
    bytes: u64,
}

/// Why a chain was not merged (nothing is left behind).
#[derive(Debug, thiserror::Error)]
enum MergeError {
    /// The files are not pairs.
    #[error("the chain is pairs of a state file and a memory file")]
    Pairs,
    /// An input file is not what it must be.
    #[error("{}: {reason}", path.display())]
    Input {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// The state files are not a chain.
    #[error("{0}")]
    Chain(String),
    /// The merged file could not be created.
    #[error("cannot create {}: {source}", path.display())]
    Create {
        /// Where it was to go.
        path: PathBuf,
        /// Why not.
        source: std::io::Error,
    },
    /// Merging failed.
    #[error(transparent)]
    Merge(#[from] kvm_memslots_persist::SnapshotError),
}

/// One snapshot of the chain, checked.
struct Link {
    state: PathBuf,
    info: SnapshotInfo,
    layout: MemoryLayout,
    mem: File,
}

/// Reads and checks the snapshot of `state` and `mem`.
fn link(state: &Path, mem: &Path) -> Result<Link, MergeError> {
    let input = |path: &Path, reason: String| MergeError::Input {
        path: path.to_path_buf(),
        reason,
    };
    let (info, layout) = snapshot_of(state).map_err(|e| input(state, e))?;
    let file = open_input(mem).map_err(|e| input(mem, e))?;
    // A Diff's own file has only its pages: its size is all there is to check.
    let checked = match info.kind {
        SnapshotKind::Full => info.memory.check(&file),
        SnapshotKind::Diff => info.memory.check_size(&file),
    };
    checked.map_err(|e| {
        input(
            mem,
            format!("not the memory file of {}: {e}", state.display()),
        )
    })?;
    Ok(Link {
        state: state.to_path_buf(),
        info,
        layout,
        mem: file,
    })
}

/// What snapshot the state file at `path` is, and its layout, whatever its guest kind (the
/// file, read once, says).
fn snapshot_of(path: &Path) -> Result<(SnapshotInfo, MemoryLayout), String> {
    let unnamed = || "it does not say what snapshot it is".to_owned();
    let read = StateFile::read(path).map_err(|e| e.to_string())?;
    if matches!(read.kind(), Ok(GuestKind::Linux)) {
        let state: LinuxState = read.state().map_err(|e| e.to_string())?;
        return Ok((state.snapshot.ok_or_else(unnamed)?, state.layout));
    }
    // Any other file: the test guest's reader says why it is none.
    let state: SnapshotState = read.state().map_err(|e| e.to_string())?;
    Ok((state.snapshot.ok_or_else(unnamed)?, state.layout))
}

/// Checks that `links` are a chain: a Full first, then each the child of the one before, of
/// one VM, none twice; names the first file that breaks it.
fn check_chain(links: &[Link]) -> Result<(), MergeError> {
    let Some(first) = links.first() else {
        return Err(MergeError::Pairs);
    };
    if first.info.kind != SnapshotKind::Full {
        return Err(MergeError::Chain(format!(
            "{} is a Diff (snapshot {} of the chain of {}): a chain starts with its Full snapshot",
            first.state.display(),
            first.info.position,
            first.info.vm
        )));
    }
    for (i, link) in links.iter().enumerate().skip(1) {
        let before = &links[i - 1];
        if let Some(same) = links[..i].iter().find(|l| l.info.id == link.info.id) {
            return Err(MergeError::Chain(format!(
                "{} repeats {} (snapshot {})",
                link.state.display(),
                same.state.display(),
                link.info.id
            )));
        }
        link.info
            .check_follows(&link.state, &before.info, &before.state)
            .map_err(MergeError::Chain)?;
    }
    Ok(())
}

/// Merges the chain `files` (state, memory, state, memory..., oldest first) into a new file
/// at `out`, after checking every input; checks the result against the last state file.
fn merge_chain(files: &[PathBuf], out: &Path) -> Result<MergeReport, MergeError> {
    if files.is_empty() || !files.len().is_multiple_of(2) {
        return Err(MergeError::Pairs);
    }
    let links = files
        .chunks(2)
        .map(|pair| link(&pair[0], &pair[1]))
        .collect::<Result<Vec<_>, _>>()?;
    check_chain(&links)?;
    let last = links.last().ok_or(MergeError::Pairs)?;
    let merged = File::options()
        .read(true)
        .write(true)
        .create_new(true)
        .open(out)
        .map_err(|source| MergeError::Create {
            path: out.to_path_buf(),
            source,
        })?;
    let chain: Vec<_> = links.iter().map(|l| (&l.layout, &l.mem)).collect();
    let result = merge_snapshots(&chain, &merged)
        .map_err(MergeError::from)
        .and_then(|bytes| {
            last.info.memory.check(&merged).map_err(|e| {
                MergeError::Chain(format!(
                    "the merged memory is not the memory {} recorded: {e}; is each memory file \
                     its state file's?",
                    last.state.display()
                ))
            })?;
            Ok(bytes)
        });
    match result {
        Ok(bytes) => Ok(MergeReport {
            snapshots: links.len(),
            bytes,
        }),
        Err(e) => {
            drop(merged);
            let _ = std::fs::remove_file(out);
            Err(e)
        }
    }
}

/// `tinyvmm snapshot-merge`'s arguments: the chain, and where the merged memory goes.
#[derive(Debug, clap::Args)]
pub struct MergeArgs {
    /// Where the merged memory file goes (it must not exist); restore it with the last state
    /// file.
    #[arg(long)]
    out: PathBuf,
    /// The chain, oldest first: the Full snapshot's state and memory files, then each Diff's,
    /// as pairs: STATE MEM STATE MEM ...
    #[arg(required = true, num_args = 2..)]
    files: Vec<PathBuf>,
}

impl MergeArgs {
    /// Runs `tinyvmm snapshot-merge`; gives the exit status.
    pub fn run(self) -> ExitCode {
        match merge_chain(&self.files, &self.out) {
            Ok(report) => {
                log(
                    LogLevel::Info,
                    format_args!(
                        "{} snapshot(s), {} bytes, merged into {}",
                        report.snapshots,
                        report.bytes,
                        self.out.display()
                    ),
                );
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("tinyvmm: {e}");
                ExitCode::FAILURE
            }
        }
    }
}
