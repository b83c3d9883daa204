//! The sending side of a stream: [`StreamWriter`].

use super::*;

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
    /// What each page sent contributed to the digest.
    sent: digest::SentPages,
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
            sent: digest::SentPages::default(),
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
        self.sent = digest::SentPages::new(layout);
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

    /// Sends `len` bytes of `region` (layout region `index`) from `offset` (page-aligned) as
    /// records of at most [`MAX_RUN`] bytes, at the region's memory-file offset + `offset`,
    /// adding each page to the digest as sent.
    fn send_run(
        &mut self,
        region: &RegionMemory,
        index: usize,
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
            let r = &self.layout()?.regions[index];
            let (gpa, size) = (r.gpa, r.size);
            let at = (r.file_offset + offset + done).to_le_bytes();
            let sent = self.record(PAGES, &[&at, &buf]);
            if sent.is_ok() {
                self.sent.sent(index, gpa, size, offset + done, &buf);
            }
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
        for (index, region) in regions.iter().enumerate() {
            if self.is_handed(index) {
                continue;
            }
            for run in content_runs(region)? {
                self.send_run(region, index, run.start, run.end - run.start, &mut stats)?;
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
            for run in d.ranges() {
                let offset = run.start - d.gpa.0;
                self.send_run(
                    &regions[index],
                    index,
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

    /// The digest of every page sent so far (the last copy of each): what the Digest record
    /// carries.
    pub fn digest(&self) -> MemoryDigest {
        self.sent.digest()
    }

    /// Ends the stream: the Digest record (every page's last copy), then Done; flushes the
    /// connection.
    pub fn done(&mut self) -> Result<(), StreamError> {
        self.layout()?;
        let digest = self.sent.digest().to_bytes();
        self.record(DIGEST, &[&digest])?;
        self.record(DONE, &[])?;
        self.out.flush().map_err(io_error("flushing the stream"))
    }
}
