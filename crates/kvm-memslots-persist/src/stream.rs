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

/// The stream format's version; a stream of another version is refused.
pub const STREAM_VERSION: u32 = 2;

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

/// Writes a stream: [`hello`](Self::hello) first, then rounds of pages, state, and
/// [`done`](Self::done).
#[derive(Debug)]
pub struct StreamWriter<W: Write> {
    out: W,
    layout: Option<MemoryLayout>,
    round: u32,
    round_pages: u64,
    buf: Vec<u8>,
    /// Regions handed over (by layout index): their pages are never sent.
    handed: Vec<bool>,
}

impl<W: Write> StreamWriter<W> {
    /// A writer on `out` (a socket, say); nothing is written yet.
    pub fn new(out: W) -> Self {
        StreamWriter {
            out,
            layout: None,
            round: 1,
            round_pages: 0,
            buf: Vec::new(),
            handed: Vec::new(),
        }
    }

    /// The connection.
    pub fn get_ref(&self) -> &W {
        &self.out
    }

    fn record(&mut self, kind: u8, parts: &[&[u8]]) -> Result<(), StreamError> {
        write_record(&mut self.out, kind, parts)
    }

    /// Sends the Hello record with `layout`, which every later page refers to.
    pub fn hello(&mut self, layout: &MemoryLayout) -> Result<(), StreamError> {
        self.hello_with(layout, 0)
    }

    /// As [`hello`](Self::hello), saying that Handover records follow at once
    /// ([`handover`](Self::handover)): the sender hands every shared region over instead of
    /// sending its pages.
    pub fn hello_handing_over(&mut self, layout: &MemoryLayout) -> Result<(), StreamError> {
        self.hello_with(layout, HANDS_OVER)
    }

    fn hello_with(&mut self, layout: &MemoryLayout, flags: u32) -> Result<(), StreamError> {
        if self.layout.is_some() {
            return Err(StreamError::Format("a second Hello".into()));
        }
        self.record(
            HELLO,
            &[
                MAGIC,
                &STREAM_VERSION.to_le_bytes(),
                &flags.to_le_bytes(),
                &layout.to_bytes(),
            ],
        )?;
        self.layout = Some(layout.clone());
        Ok(())
    }

    /// Sends a Handover record for `regions` (index in the layout, offset in its file; at most
    /// [`MAX_HANDOVER`]). The files must travel beside this record's bytes: the caller's
    /// writer attaches them to its next write (on a Unix socket, `SCM_RIGHTS`).
    pub fn handover(&mut self, regions: &[(u32, u64)]) -> Result<(), StreamError> {
        let layout = self.layout()?;
        if regions.is_empty() || regions.len() > MAX_HANDOVER {
            return Err(StreamError::Format(format!(
                "a Handover record holds 1 to {MAX_HANDOVER} regions, not {}",
                regions.len()
            )));
        }
        if let Some((index, _)) = regions.iter().find(|(i, _)| {
            layout
                .regions
                .get(*i as usize)
                .is_none_or(|r| r.backing != LayoutBacking::Shared)
        }) {
            return Err(StreamError::Format(format!(
                "region {index} of the layout is not a shared region"
            )));
        }
        let mut payload = Vec::with_capacity(regions.len() * 12);
        for (index, offset) in regions {
            payload.extend_from_slice(&index.to_le_bytes());
            payload.extend_from_slice(&offset.to_le_bytes());
        }
        let count = layout.regions.len();
        self.record(HANDOVER, &[&payload])?;
        self.handed.resize(count, false);
        for (index, _) in regions {
            self.handed[*index as usize] = true;
        }
        Ok(())
    }

    fn is_handed(&self, index: usize) -> bool {
        self.handed.get(index).copied().unwrap_or(false)
    }

    /// The writer, to attach what travels beside a record (files on a Unix socket).
    pub fn get_mut(&mut self) -> &mut W {
        &mut self.out
    }

    fn layout(&self) -> Result<&MemoryLayout, StreamError> {
        self.layout
            .as_ref()
            .ok_or_else(|| StreamError::Format("pages or state before Hello".into()))
    }

    /// Sends `len` bytes of `region` from `offset` (page-aligned) as records of at most
    /// [`MAX_RUN`] bytes, at `file_offset + offset` of the memory file.
    fn send_run(
        &mut self,
        region: &RegionMemory,
        file_offset: u64,
        offset: u64,
        len: u64,
        stats: &mut SendStats,
    ) -> Result<(), StreamError> {
        let mut done = 0;
        while done < len {
            let n = (len - done).min(MAX_RUN);
            let mut buf = std::mem::take(&mut self.buf);
            buf.resize(n as usize, 0);
            region
                .read_volatile(offset + done, &mut buf)
                .map_err(|e| StreamError::Format(format!("reading guest memory: {e}")))?;
            let at = (file_offset + offset + done).to_le_bytes();
            let sent = self.record(PAGES, &[&at, &buf]);
            self.buf = buf;
            sent?;
            done += n;
            stats.bytes += n;
            stats.records += 1;
        }
        self.round_pages += len / PAGE_SIZE;
        Ok(())
    }

    /// Sends every page of `memory` that holds data, as a full snapshot selects them (present
    /// or swapped out and not all zeros; the receiver's fresh memory reads the rest as zeros).
    /// A migration's first round.
    pub fn send_all<K: KvmMemory>(
        &mut self,
        memory: &MemoryManager<K>,
    ) -> Result<SendStats, StreamError> {
        let layout = self.layout()?.clone();
        let regions = layout.mappings(memory)?;
        let mut stats = SendStats::default();
        for (index, (r, region)) in layout.regions.iter().zip(&regions).enumerate() {
            if self.is_handed(index) {
                continue;
            }
            for run in content_runs(region)? {
                self.send_run(
                    region,
                    r.file_offset,
                    run.start,
                    run.end - run.start,
                    &mut stats,
                )?;
            }
        }
        Ok(stats)
    }

    /// Sends the pages of `dirty` (harvests of `memory`); regions are matched by id, as a diff
    /// snapshot matches them, and a harvested region the layout does not have is refused.
    pub fn send_dirty<K: KvmMemory>(
        &mut self,
        memory: &MemoryManager<K>,
        dirty: &[DirtyPages],
    ) -> Result<SendStats, StreamError> {
        let layout = self.layout()?.clone();
        let regions = layout.mappings(memory)?;
        let mut stats = SendStats::default();
        for d in dirty {
            let index = layout.harvested_region(d).ok_or_else(|| {
                StreamError::LayoutMismatch(format!(
                    "region {} was harvested but is not in the stream's layout",
                    d.region
                ))
            })?;
            if self.is_handed(index) {
                continue;
            }
            let file_offset = layout.regions[index].file_offset;
            for run in d.ranges() {
                let offset = run.start - d.gpa.0;
                self.send_run(
                    &regions[index],
                    file_offset,
                    offset,
                    run.end - run.start,
                    &mut stats,
                )?;
            }
        }
        Ok(stats)
    }

    /// Ends the current round (the receiver checks its page count) and starts the next.
    pub fn end_round(&mut self) -> Result<(), StreamError> {
        self.layout()?;
        let (round, pages) = (self.round, self.round_pages);
        self.record(ROUND_END, &[&round.to_le_bytes(), &pages.to_le_bytes()])?;
        self.round += 1;
        self.round_pages = 0;
        Ok(())
    }

    /// Sends the VMM's opaque state.
    pub fn state(&mut self, state: &[u8]) -> Result<(), StreamError> {
        self.layout()?;
        self.record(STATE, &[state])
    }

    /// Ends the stream and flushes the connection.
    pub fn done(&mut self) -> Result<(), StreamError> {
        self.layout()?;
        self.record(DONE, &[])?;
        self.out.flush().map_err(io_error("flushing the stream"))
    }
}

/// Reads a stream and applies its pages to a manager built from the same layout.
#[derive(Debug)]
pub struct StreamReader<R: Read> {
    input: R,
    layout: Option<MemoryLayout>,
    round: u32,
    round_pages: u64,
    done: bool,
    /// With a handover: which of the layout's regions still wait for theirs.
    unhanded: Vec<bool>,
    /// Which were handed over: no page may come for them.
    handed: Vec<bool>,
    /// The State record came: only Done may follow.
    state: bool,
}

impl<R: Read> StreamReader<R> {
    /// A reader on `input`.
    pub fn new(input: R) -> Self {
        StreamReader {
            input,
            layout: None,
            round: 1,
            round_pages: 0,
            done: false,
            unhanded: Vec::new(),
            handed: Vec::new(),
            state: false,
        }
    }

    /// The next record, checked: its checksum, its kind, and its place in the stream (Hello
    /// first and once, Handovers of page-aligned file offsets right after a Hello that
    /// announced them, pages inside the layout and page-aligned, round numbers and page counts
    /// as sent, State once and between rounds, nothing but Done after it and nothing after
    /// Done). `Ok(None)` after Done.
    pub fn next_record(&mut self) -> Result<Option<Record>, StreamError> {
        if self.done {
            return Ok(None);
        }
        let (kind, payload) = read_record(
            &mut self.input,
            "a record header (the sender stopped before Done)",
        )?;
        let record = self.parse(kind, payload)?;
        Ok(Some(record))
    }

    fn parse(&mut self, kind: u8, payload: Vec<u8>) -> Result<Record, StreamError> {
        let short = |what: &str| StreamError::Format(format!("a {what} record is too short"));
        if kind != HELLO && self.layout.is_none() {
            return Err(StreamError::Format(format!(
                "a record of kind {kind} before Hello"
            )));
        }
        if kind != HANDOVER && self.unhanded.iter().any(|&u| u) {
            return Err(StreamError::Format(format!(
                "a record of kind {kind} before every shared region was handed over"
            )));
        }
        if self.state && kind != DONE {
            return Err(StreamError::Format(format!(
                "a record of kind {kind} after the State record (only Done may follow it)"
            )));
        }
        if matches!(kind, STATE | DONE) && self.round_pages != 0 {
            return Err(StreamError::Format(format!(
                "a {} record inside round {}: {} pages came after the last RoundEnd",
                if kind == STATE { "State" } else { "Done" },
                self.round,
                self.round_pages
            )));
        }
        match kind {
            HELLO => {
                if self.layout.is_some() {
                    return Err(StreamError::Format("a second Hello".into()));
                }
                if payload.len() < 12 || &payload[..8] != MAGIC {
                    return Err(StreamError::Format(
                        "not a kvm-memslots memory stream (no KVMSMIG magic)".into(),
                    ));
                }
                let version = le_u32(&payload, 8);
                if version != STREAM_VERSION {
                    return Err(StreamError::Format(format!(
                        "stream version {version}; this build reads version {STREAM_VERSION}"
                    )));
                }
                if payload.len() < 16 {
                    return Err(short("Hello"));
                }
                let flags = le_u32(&payload, 12);
                if flags & !HANDS_OVER != 0 {
                    return Err(StreamError::Format(format!(
                        "unknown Hello flags {flags:#x}"
                    )));
                }
                let layout = MemoryLayout::from_bytes(&payload[16..])?;
                let hands_over = flags & HANDS_OVER != 0;
                self.handed = vec![false; layout.regions.len()];
                self.unhanded = if hands_over {
                    layout
                        .regions
                        .iter()
                        .map(|r| r.backing == LayoutBacking::Shared)
                        .collect()
                } else {
                    Vec::new()
                };
                self.layout = Some(layout.clone());
                Ok(Record::Hello { layout, hands_over })
            }
            HANDOVER => {
                if payload.is_empty() || !payload.len().is_multiple_of(12) {
                    return Err(short("Handover"));
                }
                if !self.unhanded.iter().any(|&u| u) {
                    return Err(StreamError::Format(
                        "a Handover record where the Hello announced none, or after every \
                         shared region was handed over"
                            .into(),
                    ));
                }
                if payload.len() / 12 > MAX_HANDOVER {
                    return Err(StreamError::Format(format!(
                        "a Handover record of {} regions; at most {MAX_HANDOVER}",
                        payload.len() / 12
                    )));
                }
                let layout = self.layout.as_ref().expect("checked above");
                let mut regions = Vec::with_capacity(payload.len() / 12);
                for entry in payload.chunks_exact(12) {
                    let index = le_u32(entry, 0);
                    let offset = le_u64(entry, 4);
                    let size = layout.regions.get(index as usize).map_or(0, |r| r.size);
                    if !offset.is_multiple_of(PAGE_SIZE) || offset.checked_add(size).is_none() {
                        return Err(StreamError::Format(format!(
                            "region {index} is handed over at file offset {offset:#x}, which is \
                             not page-aligned or leaves no room for its {size:#x} bytes"
                        )));
                    }
                    match self.unhanded.get_mut(index as usize) {
                        Some(owed) if *owed => {
                            *owed = false;
                            self.handed[index as usize] = true;
                        }
                        _ => {
                            return Err(StreamError::Format(format!(
                                "region {index} is not a shared region still to hand over"
                            )))
                        }
                    }
                    regions.push((index, offset));
                }
                Ok(Record::Handover(regions))
            }
            PAGES => {
                if payload.len() < 8 {
                    return Err(short("Pages"));
                }
                let offset = le_u64(&payload, 0);
                let len = (payload.len() - 8) as u64;
                let layout = self.layout.as_ref().expect("checked above");
                let region = layout.regions.iter().position(|r| {
                    offset >= r.file_offset
                        && offset
                            .checked_add(len)
                            .is_some_and(|end| end <= r.file_offset + r.size)
                });
                if region.is_some_and(|i| self.handed.get(i).copied().unwrap_or(false)) {
                    return Err(StreamError::Format(format!(
                        "pages at offset {offset:#x} are in a region that was handed over"
                    )));
                }
                let inside = region.is_some();
                if len == 0
                    || !len.is_multiple_of(PAGE_SIZE)
                    || !offset.is_multiple_of(PAGE_SIZE)
                    || !inside
                {
                    return Err(StreamError::Format(format!(
                        "pages at offset {offset:#x} of length {len:#x} are not whole pages \
                         inside one region of the layout"
                    )));
                }
                self.round_pages += len / PAGE_SIZE;
                let mut data = payload;
                data.drain(..8);
                Ok(Record::Pages { offset, data })
            }
            STATE => {
                self.state = true;
                Ok(Record::State(payload))
            }
            ROUND_END => {
                if payload.len() != 12 {
                    return Err(short("RoundEnd"));
                }
                let round = le_u32(&payload, 0);
                let pages = le_u64(&payload, 4);
                if round != self.round || pages != self.round_pages {
                    return Err(StreamError::Format(format!(
                        "round {round} ends with {pages} pages sent, but this is round {} and \
                         {} pages arrived",
                        self.round, self.round_pages
                    )));
                }
                self.round += 1;
                self.round_pages = 0;
                Ok(Record::RoundEnd { round, pages })
            }
            DONE => {
                self.done = true;
                Ok(Record::Done)
            }
            other => Err(StreamError::Format(format!("unknown record kind {other}"))),
        }
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
/// `memory`, by layout index: what a sender hands over ([`StreamWriter::handover`]).
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
        files.push((index as u32, file.clone()));
    }
    Ok(files)
}
