//! A stream of guest memory between two VMM processes: the reusable part of a migration.
//!
//! A stream is a sequence of records, each a header (kind, payload length, CRC-32 of kind,
//! length and payload; little-endian) and its payload:
//!
//! - **Hello**: the stream's magic and [`STREAM_VERSION`], flags, then the sender's
//!   [`MemoryLayout`] (its own framed, checksummed bytes). Always first. The receiver checks the
//!   layout against its own before any memory moves ([`check_layout`]) and refuses a mismatch
//!   with the first difference. A flag says the sender hands its shared memory over.
//! - **Handover** (only right after a Hello that says so): which of the layout's shared
//!   regions (memfd or file) the sender hands over, each as the layout's index and the
//!   (page-aligned) offset in a file that travels beside the record (`SCM_RIGHTS` on a Unix
//!   socket: the transport's part, and the receiver's to check that each file is a regular
//!   file that holds the region); at most [`MAX_HANDOVER`] per record. Every shared region is
//!   handed over; their pages never travel.
//! - **Pages**: a run of whole pages at an offset of the layout's memory file (so each page
//!   lands in the region with the same place in both layouts, wherever the region sits in the
//!   guest), at most [`MAX_RUN`] bytes.
//! - **State**: opaque bytes of the VMM's (vCPU and device state), once, between rounds;
//!   only Done may follow it.
//! - **RoundEnd**: the end of a round of pages, with the round's number and page count; the
//!   receiver checks the count.
//! - **Digest**: each region's [`MemoryDigest`] of the pages sent (the last copy of each), made
//!   while they were sent; the last record before Done, which needs it. Once Done came the
//!   receiver checks its guest memory against it ([`StreamReader::verify`]), before it runs
//!   anything on that memory.
//! - **Done**: the end of the stream (between rounds: every page was counted).
//!
//! The receiver answers on the same connection ([`send_answer`], [`read_answer`]): once after
//! Hello (it could lay its memory out the same way, or why not) so that no memory moves to a
//! receiver that will refuse it, and once after Done (its VM runs).
//!
//! # Example
//!
//! Two rounds from one manager to another (here through a `Vec`; a VMM writes to a socket and
//! reads on the other end), the receiver building the sender's layout from the Hello:
//!
//! ```
//! use kvm_memslots::testing::FakeKvm;
//! use kvm_memslots::{MemoryManager, RegionSpec, Target};
//! use kvm_memslots_persist::stream::{apply_pages, Record, StreamReader, StreamWriter};
//! use kvm_memslots_persist::MemoryLayout;
//! use vm_memory::{Bytes, GuestAddress, GuestAddressSpace};
//!
//! let source = MemoryManager::new(FakeKvm::new(64, true));
//! source.add_region(RegionSpec::new(GuestAddress(0), 1 << 20))?;
//! let ram = source.handle().memory();
//! ram.write_obj(1u64, GuestAddress(0x1000))?;
//!
//! let mut writer = StreamWriter::new(Vec::new());
//! writer.hello(&MemoryLayout::of(&source))?;
//! source.start_dirty_log(Target::All)?;
//! source.harvest_dirty(Target::All)?; // from here on, writes are logged
//! writer.send_all(&source)?; // round 1: every page that holds data
//! writer.end_round()?;
//! ram.write_obj(2u64, GuestAddress(0x8000))?; // the VM runs on and writes
//! let dirty = source.harvest_dirty(Target::All)?;
//! writer.send_dirty(&source, &dirty)?; // round 2: what changed
//! writer.end_round()?;
//! writer.state(b"vcpu state")?;
//! writer.done()?;
//!
//! let destination = MemoryManager::new(FakeKvm::new(64, true));
//! let mut reader = StreamReader::new(writer.get_ref().as_slice());
//! let Some(Record::Hello { layout, .. }) = reader.next_record()? else { unreachable!() };
//! layout.build(&destination)?;
//! while let Some(record) = reader.next_record()? {
//!     match record {
//!         Record::Pages { offset, data } => apply_pages(&destination, &layout, offset, &data)?,
//!         Record::State(state) => assert_eq!(state, b"vcpu state"),
//!         _ => {}
//!     }
//! }
//! reader.verify(&destination)?; // the memory here is what was sent
//! let there = destination.handle().memory();
//! assert_eq!(there.read_obj::<u64>(GuestAddress(0x1000))?, 1);
//! assert_eq!(there.read_obj::<u64>(GuestAddress(0x8000))?, 2);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! A record that is truncated, corrupted, of an unknown kind, too long, or not where the
//! stream's order allows is refused with the reason ([`StreamError`]): a receiver never applies
//! a page it could not check. Writing pages a harvest reported ([`StreamWriter::send_dirty`])
//! or every page that holds data ([`StreamWriter::send_all`]) reads guest memory with volatile
//! copies, so the guest may keep running during a round.

use std::io::{self, Read, Write};

use kvm_memslots::{DirtyPages, KvmMemory, MemoryManager, RegionMemory, PAGE_SIZE};

use crate::error::SnapshotError;
use crate::frame::{crc32, le_u32, le_u64};
use crate::layout::{LayoutBacking, MemoryLayout, RegionLayout};
use crate::memory_file::content_runs;

mod digest;
mod reader;
mod writer;

pub use digest::{page_hash, MemoryDigest, RegionDigest};
pub use reader::StreamReader;
pub use writer::StreamWriter;

/// The stream format's version; a stream of another version is refused. Version 3 added the
/// Digest record; a version 2 stream (which has none) is refused too, naming why: its
/// memory could not be checked end-to-end.
pub const STREAM_VERSION: u32 = 3;

/// The largest run of pages one record carries (bytes).
pub const MAX_RUN: u64 = 1 << 20;

/// The most regions one Handover record hands over: the kernel passes at most 253 file
/// descriptors in one message.
pub const MAX_HANDOVER: usize = 250;

const MAGIC: &[u8; 8] = b"KVMSMIG\0";
/// Hello flag: the sender hands its shared regions over (Handover records follow).
const HANDS_OVER: u32 = 1;
/// Kind (1), reserved (3), payload length (4), CRC-32 (4).
const HEADER: usize = 12;
/// The largest payload any record may announce: a run and its offset, or a layout or state of
/// up to 64 MiB.
const MAX_PAYLOAD: u32 = 64 << 20;

const HELLO: u8 = 1;
const PAGES: u8 = 2;
const STATE: u8 = 3;
const ROUND_END: u8 = 4;
const DONE: u8 = 5;
const ANSWER: u8 = 6;
const HANDOVER: u8 = 7;
const DIGEST: u8 = 8;

/// Why a stream could not be written or read.
#[derive(Debug, thiserror::Error)]
pub enum StreamError {
    /// Reading or writing the connection failed.
    #[error("{what} failed: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The system's error.
        source: io::Error,
    },
    /// The stream ended inside a record, or before its Done record.
    #[error("the stream ended early: {0}")]
    Truncated(String),
    /// A record is not what the format allows there.
    #[error("invalid stream: {0}")]
    Format(String),
    /// The sender's memory layout is not the receiver's.
    #[error("the memory layouts differ: {0}")]
    LayoutMismatch(String),
    /// The receiver's memory is not what the sender sent (the end-to-end check).
    #[error("the memory here is not what the source sent: {0}")]
    Mismatch(String),
    /// Reading guest memory or the layout's regions failed.
    #[error(transparent)]
    Snapshot(#[from] SnapshotError),
}

fn io_error(what: impl Into<String>) -> impl FnOnce(io::Error) -> StreamError {
    let what = what.into();
    move |source| {
        if source.kind() == io::ErrorKind::UnexpectedEof {
            StreamError::Truncated(what)
        } else {
            StreamError::Io { what, source }
        }
    }
}

/// One record as read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Record {
    /// The sender's memory layout (the version was checked).
    Hello {
        /// The layout.
        layout: MemoryLayout,
        /// The sender hands its shared regions over: Handover records come next, until
        /// every shared region has its file.
        hands_over: bool,
    },
    /// Shared regions handed over: (index in the layout, offset in its file), in the order
    /// their files travel beside the record.
    Handover(Vec<(u32, u64)>),
    /// Pages at an offset of the layout's memory file.
    Pages {
        /// Offset in the layout's memory file.
        offset: u64,
        /// Whole pages.
        data: Vec<u8>,
    },
    /// The VMM's opaque state.
    State(Vec<u8>),
    /// The end of a round of pages.
    RoundEnd {
        /// The round's number, from 1.
        round: u32,
        /// The pages sent in it.
        pages: u64,
    },
    /// The sender's digest of every page it sent: the last record before Done.
    Digest(MemoryDigest),
    /// The end of the stream.
    Done,
}

/// What [`StreamWriter`] sent in one call.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SendStats {
    /// Bytes of pages.
    pub bytes: u64,
    /// Page records.
    pub records: u64,
}

/// Writes one record: its header (kind, length, CRC-32) and the payload made of `parts`.
fn write_record(out: &mut impl Write, kind: u8, parts: &[&[u8]]) -> Result<(), StreamError> {
    let len: usize = parts.iter().map(|p| p.len()).sum();
    let len = u32::try_from(len)
        .ok()
        .filter(|l| *l <= MAX_PAYLOAD)
        .ok_or_else(|| StreamError::Format(format!("a record of {len} bytes is too long")))?;
    let header_fields = [&[kind][..], &len.to_le_bytes()[..]];
    let crc = crc32(header_fields.into_iter().chain(parts.iter().copied()));
    let mut header = [0u8; HEADER];
    header[0] = kind;
    header[4..8].copy_from_slice(&len.to_le_bytes());
    header[8..12].copy_from_slice(&crc.to_le_bytes());
    out.write_all(&header)
        .map_err(io_error("writing a record header"))?;
    for p in parts {
        out.write_all(p).map_err(io_error("writing a record"))?;
    }
    Ok(())
}

/// Reads one record's kind and payload, checking its length and checksum; `what` names
/// the record for an error (the stream's next record, or an answer).
fn read_record(input: &mut impl Read, what: &str) -> Result<(u8, Vec<u8>), StreamError> {
    let mut header = [0u8; HEADER];
    input
        .read_exact(&mut header)
        .map_err(io_error(format!("reading {what}")))?;
    let kind = header[0];
    let len = le_u32(&header, 4);
    let stored = le_u32(&header, 8);
    if len > MAX_PAYLOAD {
        return Err(StreamError::Format(format!(
            "a record announces {len} bytes, over the limit of {MAX_PAYLOAD} (corrupted)"
        )));
    }
    let mut payload = vec![0u8; len as usize];
    input
        .read_exact(&mut payload)
        .map_err(io_error(format!("reading a record of {len} bytes")))?;
    let computed = crc32([&[kind][..], &len.to_le_bytes()[..], &payload[..]]);
    if computed != stored {
        return Err(StreamError::Format(format!(
            "record checksum {computed:#010x} does not match the stored {stored:#010x} (corrupted)"
        )));
    }
    Ok((kind, payload))
}

/// Sends the receiver's answer back to the sender, on the same connection in the other
/// direction: `Ok` (the layout was built, or the VM runs here now) or the reason it refused.
/// A migration needs two: after Hello, before any memory moves, and after Done, once the
/// receiver's VM runs (the sender may stop its own only then).
pub fn send_answer(out: &mut impl Write, answer: Result<(), &str>) -> Result<(), StreamError> {
    let (status, message) = match answer {
        Ok(()) => (0u8, ""),
        Err(reason) => (1u8, reason),
    };
    write_record(out, ANSWER, &[&[status], message.as_bytes()])?;
    out.flush().map_err(io_error("flushing an answer"))
}

/// Reads the receiver's answer ([`send_answer`]): `Ok(Ok(()))` for yes, `Ok(Err(reason))` for
/// a refusal, `Err` if no valid answer came.
pub fn read_answer(input: &mut impl Read) -> Result<Result<(), String>, StreamError> {
    let (kind, payload) = read_record(input, "the receiver's answer")?;
    if kind != ANSWER || payload.is_empty() {
        return Err(StreamError::Format(format!(
            "expected the receiver's answer, got a record of kind {kind}"
        )));
    }
    let message = String::from_utf8_lossy(&payload[1..]).into_owned();
    match payload[0] {
        0 => Ok(Ok(())),
        1 => Ok(Err(message)),
        other => Err(StreamError::Format(format!("answer status {other}"))),
    }
}

/// Checks that `sent` (a sender's layout) and `local` have the same regions (guest base, size,
/// slot size, read-only) at the same memory-file offsets, so that every page lands where the
/// sender had it. The first difference is the error.
pub fn check_layout(sent: &MemoryLayout, local: &MemoryLayout) -> Result<(), StreamError> {
    if sent.regions.len() != local.regions.len() {
        return Err(StreamError::LayoutMismatch(format!(
            "the sender has {} regions, this VM {}",
            sent.regions.len(),
            local.regions.len()
        )));
    }
    for (s, l) in sent.regions.iter().zip(&local.regions) {
        let key = |r: &RegionLayout| (r.gpa, r.size, r.slot_size, r.read_only, r.file_offset);
        if key(s) != key(l) {
            return Err(StreamError::LayoutMismatch(format!(
                "the sender's region at guest {:#x} ({:#x} bytes, slots of {:#x}{}) is here \
                 a region at guest {:#x} ({:#x} bytes, slots of {:#x}{})",
                s.gpa,
                s.size,
                s.slot_size,
                if s.read_only { ", read-only" } else { "" },
                l.gpa,
                l.size,
                l.slot_size,
                if l.read_only { ", read-only" } else { "" },
            )));
        }
    }
    Ok(())
}

/// Writes a Pages record's `data` into `memory` (built from `layout`, the stream's) at memory
/// file `offset`, through vm-memory (the receiver's VMM write bitmap records it).
pub fn apply_pages<K: KvmMemory>(
    memory: &MemoryManager<K>,
    layout: &MemoryLayout,
    offset: u64,
    data: &[u8],
) -> Result<(), StreamError> {
    use vm_memory::{Bytes, GuestAddress, GuestAddressSpace};
    let r = layout
        .regions
        .iter()
        .find(|r| offset >= r.file_offset && offset - r.file_offset < r.size)
        .ok_or_else(|| {
            StreamError::Format(format!("offset {offset:#x} is in no region of the layout"))
        })?;
    let gpa = GuestAddress(r.gpa + (offset - r.file_offset));
    memory
        .handle()
        .memory()
        .write_slice(data, gpa)
        .map_err(|e| {
            StreamError::Format(format!(
                "writing {} bytes at guest {:#x}: {e}",
                data.len(),
                gpa.0
            ))
        })
}

/// The file (memfd or the caller's) and offset behind each shared region of `layout` in
/// `memory`, by layout index: what a sender hands over ([`StreamWriter::handover`]). A shared
/// region under a lazy restore ([`LazyLoader`](crate::LazyLoader)) is filled first: the pages
/// its loader has not filled yet are not in the file, and the receiver has no loader.
pub fn shared_files<K: KvmMemory>(
    memory: &MemoryManager<K>,
    layout: &MemoryLayout,
) -> Result<Vec<(u32, vm_memory::FileOffset)>, StreamError> {
    let regions = layout.mappings(memory)?;
    let mut files = Vec::new();
    for (index, (r, region)) in layout.regions.iter().zip(&regions).enumerate() {
        if r.backing != LayoutBacking::Shared {
            continue;
        }
        let file = region.file_offset().ok_or_else(|| {
            StreamError::Format(format!(
                "region at guest {:#x} is shared but has no file",
                r.gpa
            ))
        })?;
        crate::uffd::fill_owed(region)?;
        files.push((index as u32, file.clone()));
    }
    Ok(files)
}
