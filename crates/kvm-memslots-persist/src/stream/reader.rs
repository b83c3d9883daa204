//! The receiving side of a stream: [`StreamReader`].

use super::*;

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
    /// The State record came: only Digest and Done may follow.
    state: bool,
    /// The sender's digest: only Done may follow.
    digest: Option<MemoryDigest>,
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
            digest: None,
        }
    }

    /// The sender's digest, once its record came.
    pub fn digest(&self) -> Option<&MemoryDigest> {
        self.digest.as_ref()
    }

    /// Once Done came: checks that `memory` (built from the Hello's layout, every page of the
    /// stream applied to it) holds what the sender sent, by computing the digest of its guest
    /// memory ([`MemoryDigest::of_memory`]: never from the stream's bytes) and comparing it
    /// with the sender's; regions handed over are not compared (their memory is the sender's
    /// own). Nothing may change `memory` meanwhile: call it before any vCPU runs. The error
    /// ([`StreamError::Mismatch`]) names the first region that differs. Returns the digest
    /// computed here.
    pub fn verify<K: KvmMemory>(
        &self,
        memory: &MemoryManager<K>,
    ) -> Result<MemoryDigest, StreamError> {
        let (Some(layout), Some(sent), true) = (&self.layout, &self.digest, self.done) else {
            return Err(StreamError::Format(
                "the memory can be checked only once the whole stream, Done included, came".into(),
            ));
        };
        let here = MemoryDigest::of_memory(memory, layout, &self.handed)?;
        here.check(sent, layout)?;
        Ok(here)
    }

    /// The next record, checked: its checksum, its kind, and its place in the stream (Hello
    /// first and once, Handovers of page-aligned file offsets right after a Hello that
    /// announced them, pages inside the layout and page-aligned, round numbers and page counts
    /// as sent, State once and between rounds, then the Digest of the layout's size between
    /// rounds, Done only right after the Digest, and nothing after Done). `Ok(None)` after
    /// Done; then [`verify`](Self::verify) the memory.
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
        if self.digest.is_some() && kind != DONE {
            return Err(StreamError::Format(format!(
                "a record of kind {kind} after the Digest record (only Done may follow it)"
            )));
        }
        if self.state && !matches!(kind, DIGEST | DONE) {
            return Err(StreamError::Format(format!(
                "a record of kind {kind} after the State record (only the Digest and Done may \
                 follow it)"
            )));
        }
        if matches!(kind, STATE | DIGEST | DONE) && self.round_pages != 0 {
            return Err(StreamError::Format(format!(
                "a {} record inside round {}: {} pages came after the last RoundEnd",
                match kind {
                    STATE => "State",
                    DIGEST => "Digest",
                    _ => "Done",
                },
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
                if version == 2 {
                    return Err(StreamError::Format(format!(
                        "stream version 2, from an older sender whose streams carry no memory \
                         digest; this build reads version {STREAM_VERSION} only, so that the \
                         memory that arrives is checked end-to-end: send from a build of this \
                         version"
                    )));
                }
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
            DIGEST => {
                let layout = self.layout.as_ref().expect("checked above");
                if payload.len() != 16 * layout.regions.len() {
                    return Err(StreamError::Format(format!(
                        "a Digest record of {} bytes for a layout of {} regions (16 bytes each)",
                        payload.len(),
                        layout.regions.len()
                    )));
                }
                let digest = MemoryDigest::from_bytes(&payload);
                if let Some(index) = (0..digest.regions.len()).find(|&i| {
                    self.handed.get(i).copied().unwrap_or(false)
                        && digest.regions[i] != RegionDigest::default()
                }) {
                    return Err(StreamError::Format(format!(
                        "the Digest record counts pages in region {index}, which was handed over"
                    )));
                }
                self.digest = Some(digest.clone());
                Ok(Record::Digest(digest))
            }
            DONE => {
                if self.digest.is_none() {
                    return Err(StreamError::Format(
                        "Done without the Digest record before it: the memory that arrived \
                         cannot be checked"
                            .into(),
                    ));
                }
                self.done = true;
                Ok(Record::Done)
            }
            other => Err(StreamError::Format(format!("unknown record kind {other}"))),
        }
    }
}
