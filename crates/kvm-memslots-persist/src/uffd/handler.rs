//! The handler thread of a loader: it waits for faults, discards and the loader's stop, fills
//! each faulting block once (from the memory file, or zeros for a hole or a discarded page),
//! records first touches, and between faults prefetches a working set.

use std::fs::File;
use std::ops::Range;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::sync::atomic::Ordering;
use std::sync::{Arc, PoisonError};
use std::time::Instant;

use vmm_sys_util::eventfd::EventFd;

use kvm_memslots::{HUGE_PAGE_SIZE, PAGE_SIZE};

use super::recording::{finish_recording, RecorderSlot};
use super::region::Lazy;
use super::stats::LoaderStats;
use super::sys::{read_event, uffd_copy, uffd_wake, uffd_zeropage, Event, Filled};
use crate::sparse::range_has_data;
use crate::working_set::WorkingSet;

/// Copies (`UFFDIO_COPY`, one per run of neighbouring pages) a prefetch window makes at most.
const WINDOW_COPIES: usize = 64;

/// A working set being prefetched: the list, where the next page is in it, and the buffer one
/// window is read into.
struct Prefetch {
    runs: Vec<Range<u64>>,
    run: usize,
    page: u64,
    buffer: Vec<u8>,
}

/// Says why the handler could not fill the page at `hva`; false (the handler stops, and the
/// loader reports it failed).
fn fill_failed(hva: u64, e: std::io::Error) -> bool {
    eprintln!("kvm-memslots-persist: the userfaultfd handler could not fill {hva:#x}: {e}");
    false
}

/// How [`Handler::fill_run`] ended.
enum RunEnd {
    /// Every unit of the run is filled (by it, or by someone else before).
    Done,
    /// The kernel asked to try again (`EAGAIN`: a discard is under way); the units from there
    /// on are not filled.
    Later,
    /// The region was removed meanwhile: nothing more to fill.
    Gone,
    /// It could not fill (said on stderr): the handler stops.
    Failed,
}

/// The handler thread's state.
pub(super) struct Handler {
    uffd: Arc<OwnedFd>,
    stats: Arc<LoaderStats>,
    lazies: Vec<Arc<Lazy>>,
    file: Arc<File>,
    /// One block read for a fault (the largest a region's fault fills).
    buffer: Vec<u8>,
    /// Zeros for hugetlb pages (empty without hugetlb regions).
    zeros: Vec<u8>,
    /// Faulting addresses whose fill the kernel asked to try again (`EAGAIN`; recorded
    /// already).
    deferred: Vec<u64>,
    recording: RecorderSlot,
    /// When a timed recording ends (`None` once it has, or without one).
    deadline: Option<Instant>,
    prefetch: Option<Prefetch>,
}

impl Handler {
    /// The handler of `lazies` (registered with `uffd`), filling them from `file`: it
    /// prefetches `prefetch` (checked against the layout), and records first touches into
    /// `recording` until `deadline`, if given.
    pub(super) fn new(
        uffd: Arc<OwnedFd>,
        stats: Arc<LoaderStats>,
        lazies: Vec<Arc<Lazy>>,
        file: Arc<File>,
        recording: RecorderSlot,
        deadline: Option<Instant>,
        prefetch: Option<WorkingSet>,
    ) -> Self {
        let window = lazies.iter().map(|l| l.window()).max().unwrap_or(0);
        let prefetch = prefetch
            .filter(|list| !list.runs.is_empty())
            .map(|list| Prefetch {
                page: list.runs[0].start,
                runs: list.runs,
                run: 0,
                buffer: vec![0u8; window as usize],
            });
        let block = lazies.iter().map(|l| l.block).max().unwrap_or(PAGE_SIZE);
        // Zeros to copy into hugetlb pages (calloc'd: untouched until copied from).
        let zeros = if lazies.iter().any(|l| l.hugetlb) {
            vec![0u8; HUGE_PAGE_SIZE as usize]
        } else {
            Vec::new()
        };
        Handler {
            uffd,
            stats,
            lazies,
            file,
            buffer: vec![0u8; block as usize],
            zeros,
            deferred: Vec::new(),
            recording,
            deadline,
            prefetch,
        }
    }

    /// Waits for faults (or the stop eventfd) and fills each faulting page once; in between,
    /// prefetches.
    pub(super) fn serve(mut self, stop: &EventFd) {
        loop {
            let timeout = if !self.deferred.is_empty() {
                1
            } else if self.prefetch.is_some() {
                0
            } else if let Some(deadline) = self.deadline {
                let left = deadline.saturating_duration_since(Instant::now());
                left.as_millis().min(i32::MAX as u128) as i32 + 1
            } else {
                -1
            };
            let mut fds = [
                libc::pollfd {
                    fd: self.uffd.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                },
                libc::pollfd {
                    fd: stop.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                },
            ];
            // SAFETY: poll(2) on two valid pollfds in a local array.
            let ready = unsafe { libc::poll(fds.as_mut_ptr(), 2, timeout) };
            if ready < 0 {
                if std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
                    continue;
                }
                break;
            }
            if fds[1].revents != 0 {
                return;
            }
            let served = if fds[0].revents != 0 {
                self.message()
            } else {
                self.prefetch_window();
                true
            };
            // A fill the kernel deferred goes again once the handler has read on.
            let ok = served
                && std::mem::take(&mut self.deferred)
                    .into_iter()
                    .all(|hva| self.fault(hva, false));
            if !ok {
                self.stats.failed.store(true, Ordering::Release);
                return;
            }
            if self.deadline.is_some_and(|d| Instant::now() >= d) {
                self.deadline = None;
                finish_recording(&self.recording);
            }
        }
    }

    /// Reads and serves one message; false if a fault could not be served.
    fn message(&mut self) -> bool {
        match read_event(&self.uffd) {
            // Nothing to read: another wake-up took it.
            None | Some(Event::Other) => true,
            Some(Event::Remove { start, end }) => {
                for lazy in &self.lazies {
                    lazy.discarded(start, end);
                }
                true
            }
            Some(Event::PageFault { address }) => self.fault(address & !(PAGE_SIZE - 1), true),
        }
    }

    /// Fills the faulting page at `hva`: on its first fill, the units of its block not filled
    /// yet, from the file (zeros for a block that is a hole there); after a discard, its unit
    /// with zeros. Records a first fill if `record`. False if it could not.
    fn fault(&mut self, hva: u64, record: bool) -> bool {
        let Some(lazy) = self.lazies.iter().find(|l| l.holds(hva)).map(Arc::clone) else {
            return true;
        };
        let unit = (hva - lazy.base) / lazy.unit;
        // Marked filled once the fill is done (below), so that a snapshot reading the marks
        // meanwhile takes the page for one that still holds the file's data.
        if lazy.is_filled(unit) {
            // Filled before, then discarded: zeros.
            let at = unit * lazy.unit;
            return match self.fill_run(&lazy, at..at + lazy.unit, None) {
                RunEnd::Done | RunEnd::Gone => true,
                RunEnd::Later => {
                    self.deferred.push(hva);
                    true
                }
                RunEnd::Failed => false,
            };
        }
        let block = lazy.block_of(hva);
        let runs = lazy.unfilled_runs(block.start / lazy.unit * lazy.unit..block.end);
        // Recorded before the ioctl wakes the faulting thread, so that what it does next
        // (end the recording, say) comes after.
        if record {
            let first = lazy.file_offset / PAGE_SIZE;
            for run in &runs {
                self.record(first + run.start / PAGE_SIZE..first + run.end / PAGE_SIZE);
            }
        }
        let at = lazy.file_offset + block.start;
        let len = block.end - block.start;
        let data = match range_has_data(&self.file, at, len) {
            Ok(data) => data,
            Err(e) => return fill_failed(hva, e),
        };
        let mut buffer = std::mem::take(&mut self.buffer);
        let read = if data {
            // Holes inside the block read zeros.
            self.file.read_exact_at(&mut buffer[..len as usize], at)
        } else {
            Ok(())
        };
        if let Err(e) = read {
            self.buffer = buffer;
            return fill_failed(hva, e);
        }
        let mut ok = true;
        for run in runs {
            let src = data.then(|| {
                &buffer[(run.start - block.start) as usize..(run.end - block.start) as usize]
            });
            match self.fill_run(&lazy, run, src) {
                RunEnd::Done => continue,
                // The faulting thread retries its access (its page may lie in another run).
                RunEnd::Gone => uffd_wake(&self.uffd, lazy.base + unit * lazy.unit, lazy.unit),
                RunEnd::Later => {
                    // Tried again after the handler has read the discard under way (a discard
                    // of the page by then makes the fill zeros), unless this fill reached the
                    // faulting page (the rest of its block then faults on its own).
                    if !lazy.is_filled(unit) {
                        self.deferred.push(hva);
                    }
                }
                RunEnd::Failed => ok = false,
            }
            break;
        }
        self.buffer = buffer;
        ok
    }

    /// Fills `run` (offsets in `lazy`'s region, whole units) with `src` (as long), or zeros,
    /// and marks what it filled; a unit filled meanwhile is left as it is, and its waiters
    /// woken.
    fn fill_run(&self, lazy: &Lazy, run: Range<u64>, src: Option<&[u8]>) -> RunEnd {
        let mut at = run.start;
        while at < run.end {
            let dst = lazy.base + at;
            let left = run.end - at;
            let (result, count) = match src {
                Some(src) => {
                    let from = &src[(at - run.start) as usize..];
                    self.stats
                        .copied
                        .fetch_add(left / PAGE_SIZE, Ordering::AcqRel);
                    self.stats.copy_calls.fetch_add(1, Ordering::AcqRel);
                    (uffd_copy(&self.uffd, dst, from), &self.stats.copied)
                }
                None if lazy.hugetlb => {
                    // hugetlb pages take no UFFDIO_ZEROPAGE: zeros are copied, a page at a time.
                    let len = left.min(self.zeros.len() as u64);
                    self.stats
                        .zeroed
                        .fetch_add(len / PAGE_SIZE, Ordering::AcqRel);
                    self.stats.copy_calls.fetch_add(1, Ordering::AcqRel);
                    let zeros = &self.zeros[..len as usize];
                    (uffd_copy(&self.uffd, dst, zeros), &self.stats.zeroed)
                }
                None => {
                    self.stats
                        .zeroed
                        .fetch_add(left / PAGE_SIZE, Ordering::AcqRel);
                    (uffd_zeropage(&self.uffd, dst, left), &self.stats.zeroed)
                }
            };
            // Counted before the ioctl wakes the faulting thread, so that it sees the count;
            // what was not filled is taken back.
            let asked = match src {
                None if lazy.hugetlb => left.min(self.zeros.len() as u64),
                _ => left,
            };
            let done = match result {
                Filled::Bytes(bytes) => bytes,
                _ => 0,
            };
            count.fetch_sub((asked - done) / PAGE_SIZE, Ordering::AcqRel);
            match result {
                Filled::Bytes(bytes) => {
                    for unit in at / lazy.unit..(at + bytes) / lazy.unit {
                        lazy.fill(unit);
                    }
                    at += bytes;
                }
                // Filled meanwhile (another fault, or the prefetch): the waiters are woken.
                Filled::Exists => {
                    lazy.fill(at / lazy.unit);
                    uffd_wake(&self.uffd, dst, lazy.unit);
                    at += lazy.unit;
                }
                Filled::Later => return RunEnd::Later,
                // The region was removed (and so unregistered) after the fault was queued:
                // there is nothing to fill; a thread still waiting there retries its access.
                Filled::Failed(_) if lazy.gone() => {
                    uffd_wake(&self.uffd, dst, left);
                    return RunEnd::Gone;
                }
                Filled::Failed(e) => {
                    fill_failed(dst, e);
                    return RunEnd::Failed;
                }
            }
        }
        RunEnd::Done
    }

    /// Notes pages `pages` of the memory file in the recording, if one is under way.
    fn record(&self, pages: Range<u64>) {
        let mut recording = self
            .recording
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(recorder) = recording.as_mut() {
            for page in pages {
                recorder.set.push(page);
            }
        }
    }

    /// Fills the next window of the working set (up to [`Lazy::window`] bytes of one region
    /// from the unit of the next page of the list on, as far as the list stays inside it): one
    /// read, one copy per run of units not filled yet. A list's page of a region of 2 MiB
    /// hugetlb pages fills its whole page.
    fn prefetch_window(&mut self) {
        let Some(p) = self.prefetch.as_mut() else {
            return;
        };
        let first = p.page;
        let at = self.lazies.partition_point(|l| l.file_pages().end <= first);
        let Some(lazy) = self
            .lazies
            .get(at)
            .filter(|l| l.file_pages().contains(&first))
        else {
            // The list was checked against the layout: not reached.
            self.end_prefetch();
            return;
        };
        if lazy.gone() {
            // The region was removed: the list goes on past its pages.
            let end = lazy.file_pages().end;
            while p.runs.get(p.run).is_some_and(|r| r.end <= end) {
                p.run += 1;
            }
            let next = p.runs.get(p.run).map(|r| r.start.max(end));
            match next {
                Some(page) => p.page = page,
                None => self.end_prefetch(),
            }
            return;
        }
        // In units of the region (`ratio` pages of the list each), from the one `first` is in.
        let ratio = lazy.unit / PAGE_SIZE;
        let region_first = lazy.file_pages().start;
        let first_unit = (first - region_first) / ratio;
        let limit_unit = (first_unit + lazy.window() / lazy.unit).min(lazy.size / lazy.unit);
        let (low, limit) = (
            region_first + first_unit * ratio,
            region_first + limit_unit * ratio,
        );
        // The list's pages from `first` on while they stay in the window's units, as many runs
        // as the window copies (so that it reads no further than it fills): (the list's run,
        // its first page here, the units it covers).
        let mut segments = Vec::new();
        let (mut run, mut page) = (p.run, p.page);
        while run < p.runs.len() && (low..limit).contains(&page) && segments.len() < WINDOW_COPIES {
            let end = p.runs[run].end.min(limit);
            let units = (page - region_first) / ratio..(end - region_first).div_ceil(ratio);
            segments.push((run, page, units));
            if end < p.runs[run].end {
                page = end;
                break;
            }
            run += 1;
            page = p.runs.get(run).map_or(0, |r| r.start);
        }
        let span = segments
            .iter()
            .map(|(_, _, units)| units.end)
            .max()
            .unwrap_or(first_unit)
            - first_unit;
        let buffer = &mut p.buffer[..(span * lazy.unit) as usize];
        if let Err(e) = self.file.read_exact_at(buffer, low * PAGE_SIZE) {
            eprintln!("kvm-memslots-persist: the prefetch stopped: reading the memory file: {e}");
            self.end_prefetch();
            return;
        }
        let (base, unit) = (lazy.base, lazy.unit);
        // Where the list goes on from unit `next` of a segment that starts at page `from`.
        let resume = |from: u64, next: u64| from.max(region_first + next * ratio);
        let mut copies = 0;
        for (segment_run, segment_page, units) in segments {
            let mut next = units.start;
            while next < units.end {
                if lazy.is_filled(next) {
                    next += 1;
                    continue;
                }
                let mut end = next + 1;
                while end < units.end && !lazy.is_filled(end) {
                    end += 1;
                }
                if copies == WINDOW_COPIES {
                    // The window's share: faults first, then on from here.
                    (p.run, p.page) = (segment_run, resume(segment_page, next));
                    return;
                }
                copies += 1;
                let src = &p.buffer
                    [((next - first_unit) * unit) as usize..((end - first_unit) * unit) as usize];
                self.stats.copy_calls.fetch_add(1, Ordering::AcqRel);
                match uffd_copy(&self.uffd, base + next * unit, src) {
                    Filled::Bytes(bytes) => {
                        let units = bytes / unit;
                        for filled in next..next + units {
                            lazy.fill(filled);
                        }
                        self.stats
                            .prefetched
                            .fetch_add(bytes / PAGE_SIZE, Ordering::AcqRel);
                        next += units;
                    }
                    // Filled some other way: leave it.
                    Filled::Exists => next += 1,
                    // A discard is under way: this window again once it has been read.
                    Filled::Later => {
                        (p.run, p.page) = (segment_run, resume(segment_page, next));
                        return;
                    }
                    // Removed meanwhile: the next window skips it.
                    Filled::Failed(_) if lazy.gone() => {
                        (p.run, p.page) = (segment_run, resume(segment_page, next));
                        return;
                    }
                    Filled::Failed(e) => {
                        eprintln!("kvm-memslots-persist: the prefetch stopped: {e}");
                        self.end_prefetch();
                        return;
                    }
                }
            }
        }
        (p.run, p.page) = (run, page);
        if run == p.runs.len() {
            self.end_prefetch();
        }
    }

    /// The prefetch is over (its list done, or stopped at an error).
    fn end_prefetch(&mut self) {
        self.prefetch = None;
        self.stats.prefetch_done.store(true, Ordering::Release);
    }
}
