//! `tinyvmm-bench snapshot-bench`: what snapshots and restores cost, at several slot counts, next to
//! the file system's sequential bandwidth and a cold start, in one run.
//!
//! Per slot count: a VM with the test area split over the slots; the guest writes half the
//! pages (every other one); a Full snapshot (timed: logging on, harvest, memory file, vCPU
//! state, state file) and its size on disk; the guest writes one page in 16; a Diff (timed) and
//! its size. Then, per restore backend, a new VM from the Full files: time to its first guest
//! command done (the guest has run) and to the guest having verified every page it wrote (its
//! working set); the uffd restore records the pages the guest touches first, and one more uffd
//! restore prefetches that list, timed the same way.
//! A cold start (new VM, test area, vCPUs, first command) of the same slot count, and the
//! bandwidth of writing and reading a file as large as the area in the same folder, for scale.
//!
//! Each slot count runs once per page size asked for (`--page-sizes 4k,2m,thp`), the rows of
//! one slot count side by side, with the `UFFDIO_COPY` calls of each lazy restore; with
//! `--touch all` the guest writes (and verifies) every page rather than every other one. A
//! row of huge pages has no `file` restore (the memory file is on no hugetlbfs, and transparent
//! huge pages do not back a private file mapping), and a row is skipped, saying why, where the
//! area cannot be split into that many slots of whole 2 MiB pages or the hugetlb pool cannot
//! hold it.

use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvm_memslots::{hugetlb_pages_available, Backing, MemoryLimits, PageSize, Target};
use kvm_memslots_persist::{
    write_dirty_pages, write_memory_file, LazyOptions, MemoryLayout, Recording, WorkingSet,
};
use serde::Serialize;
use vmm_sys_util::eventfd::EventFd;

use tinyvmm::control::memory::RegionPageSize;
use tinyvmm::jobs::args::{slot_count, LimitArgs};
use tinyvmm::jobs::process::{job_report, print_report, write_json};
use tinyvmm::lifecycle::run_job;
use tinyvmm::test_guest::area::{AreaError, TestArea, AREA_GPA};
use tinyvmm::test_guest::snapshot::{MemoryCheck, SnapshotInfo, SnapshotState, TestGuestPart};
use tinyvmm::test_guest::vcpus::{check_slot_count, GuestError, MemBackend, TestVm, Vcpus};
use tinyvmm::test_guest::{Command, Op};
use tinyvmm::vm::VmOptions;

/// What to measure.
#[derive(Debug, Clone)]
pub struct SnapshotBenchConfig {
    /// Slot counts (each 2 to KVM's maximum).
    pub slots: Vec<usize>,
    /// Bytes of test area.
    pub area_size: u64,
    /// Where the files go (removed at the end).
    pub dir: PathBuf,
    /// What guest memory is admitted against; `None`: this host's defaults
    /// ([`MemoryLimits::for_this_host`]).
    pub limits: Option<MemoryLimits>,
    /// The page sizes of the test area, a row each per slot count.
    pub page_sizes: Vec<PageSize>,
    /// The guest writes every page, not every other one.
    pub touch_all: bool,
}

impl SnapshotBenchConfig {
    /// What each VM of the bench is made with.
    fn vm_options(&self) -> VmOptions {
        VmOptions {
            limits: self.limits,
            ..VmOptions::default()
        }
    }
}

/// Why the benchmark failed.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotBenchError {
    /// The VM or its guest failed.
    #[error(transparent)]
    Guest(#[from] GuestError),
    /// The test area could not be made.
    #[error(transparent)]
    Area(#[from] AreaError),
    /// The manager refused.
    #[error(transparent)]
    Memory(#[from] kvm_memslots::Error),
    /// Writing or reading a snapshot failed.
    #[error(transparent)]
    Snapshot(#[from] kvm_memslots_persist::SnapshotError),
    /// A file operation failed.
    #[error("{0}: {1}")]
    Io(String, std::io::Error),
    /// A restored guest found other data than it wrote.
    #[error("{backend:?} restore at {slots} slots: the guest's verify failed")]
    Verify {
        /// The backend.
        backend: MemBackend,
        /// The slot count.
        slots: usize,
    },
    /// A signal stopped the run.
    #[error("interrupted")]
    Interrupted,
}

/// One restore.
#[derive(Debug, Clone, Serialize)]
pub struct RestoreRow {
    /// `copy`, `file` or `uffd`.
    pub backend: String,
    /// To the first guest command done, milliseconds.
    pub first_command_ms: f64,
    /// To the guest having verified every page it wrote, milliseconds.
    pub verified_ms: f64,
    /// `UFFDIO_COPY` calls the lazy loader made (faults and prefetch); `None` for a restore
    /// without one.
    pub copy_calls: Option<u64>,
}

/// One slot count and page size.
#[derive(Debug, Clone, Serialize)]
pub struct SnapshotRow {
    /// KVM slots in all.
    pub slots: usize,
    /// The test area's page size: `4k`, `2m` or `thp`.
    pub page_size: &'static str,
    /// Full snapshot, milliseconds.
    pub full_ms: f64,
    /// Its memory file on disk, bytes.
    pub full_bytes: u64,
    /// Diff snapshot (1 page in 16 dirtied), milliseconds.
    pub diff_ms: f64,
    /// Its memory file on disk, bytes.
    pub diff_bytes: u64,
    /// A cold start to the first guest command done, milliseconds.
    pub cold_start_ms: f64,
    /// Each restore backend (the uffd one records the pages the guest touches first).
    pub restores: Vec<RestoreRow>,
    /// Pages in the working set the uffd restore recorded.
    pub working_set_pages: u64,
    /// A uffd restore that prefetches that working set.
    pub prefetch: RestoreRow,
    /// Pages the guest still faulted in during it (the prefetch had not reached them yet, or
    /// the list did not name them).
    pub prefetch_faults: u64,
    /// A uffd restore whose pages the VMM itself reads, one byte a written page, with no guest
    /// running: the loader's own cost, without the guest's first touches (which, under
    /// shadow paging, cost as much whatever the restore).
    pub host_touch: RestoreRow,
}

/// The benchmark's result.
#[derive(Debug, Clone, Serialize)]
pub struct SnapshotBenchReport {
    /// Bytes of test area.
    pub area_size: u64,
    /// Sequential write of a file of that size in the same folder (with fsync), MiB/s.
    pub write_mib_s: f64,
    /// Sequential read of it back (from the page cache, as a restore right after a snapshot
    /// reads), MiB/s.
    pub read_mib_s: f64,
    /// Whether the guest wrote every page (else every other one).
    pub touch_all: bool,
    /// One row per slot count and page size.
    pub rows: Vec<SnapshotRow>,
    /// Rows not measured, with why.
    pub skipped: Vec<String>,
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> SnapshotBenchError {
    let what = what.into();
    move |e| SnapshotBenchError::Io(what, e)
}

/// The stride of the guest's writes and verifies: every page, or every other one.
fn stride(config: &SnapshotBenchConfig) -> u64 {
    if config.touch_all {
        4096
    } else {
        2 * 4096
    }
}

fn command(op: Op, area: &TestArea, stride: u64, seed: u64) -> Command {
    Command {
        op,
        start: area.gpa,
        end: area.end(),
        stride,
        seed,
    }
}

/// A VM with the test area over `slots - 1` slots in pages of `page_size`, and one vCPU.
fn new_vm(
    slots: usize,
    page_size: PageSize,
    config: &SnapshotBenchConfig,
    stopped: &Arc<EventFd>,
) -> Result<(TestVm, TestArea, Vcpus), SnapshotBenchError> {
    let area_size = config.area_size;
    let vm = TestVm::with_options(config.vm_options())?;
    vm.check_slot_count(slots)?;
    let area = TestArea::add_paged(
        vm.memory(),
        AREA_GPA,
        area_size,
        slots as u64 - 1,
        Backing::Anonymous,
        page_size,
    )?;
    let mut vcpus = vm.start_vcpus(1, stopped)?;
    vcpus.set_timeout(Duration::from_secs(600));
    Ok((vm, area, vcpus))
}

fn new_file(path: &Path) -> Result<File, SnapshotBenchError> {
    File::options()
        .read(true)
        .write(true)
        .create_new(true)
        .open(path)
        .map_err(io(format!("creating {}", path.display())))
}

fn disk_bytes(file: &File) -> u64 {
    use std::os::unix::fs::MetadataExt;
    file.metadata().map_or(0, |m| m.blocks() * 512)
}

/// Saves `vm`'s vCPUs and layout into a new state file at `path`: a Full snapshot's, or the
/// Diff's that follows `parent`. Returns what snapshot it is.
fn save_state(
    vm: &TestVm,
    vcpus: &mut Vcpus,
    path: &Path,
    parent: Option<&SnapshotInfo>,
) -> Result<SnapshotInfo, SnapshotBenchError> {
    let layout = MemoryLayout::of(vm.memory());
    let check = MemoryCheck::of_memory(&*vm.memory().current(), &layout)
        .map_err(|e| io("reading guest memory")(std::io::Error::other(e)))?;
    let info = match parent {
        Some(parent) => parent.next_diff(check),
        None => SnapshotInfo::full(check),
    }
    .map_err(io("a snapshot id"))?;
    let mut state = SnapshotState::new(
        layout,
        vcpus.save_states()?,
        None,
        true,
        TestGuestPart::default(),
    );
    state.snapshot = Some(info);
    new_file(path)?
        .write_all(&state.to_bytes())
        .map_err(io("writing the state file"))?;
    Ok(info)
}

/// Sequential write (with fsync) and read of `size` bytes at `path`, in MiB/s.
fn bandwidth(path: &Path, size: u64) -> Result<(f64, f64), SnapshotBenchError> {
    let chunk = vec![0x5au8; 1 << 20];
    let mut file = new_file(path)?;
    let start = Instant::now();
    for _ in 0..size.div_ceil(chunk.len() as u64) {
        file.write_all(&chunk).map_err(io("the bandwidth file"))?;
    }
    file.sync_all().map_err(io("fsync"))?;
    let write = start.elapsed();
    let mut file = File::open(path).map_err(io("the bandwidth file"))?;
    let mut buf = vec![0u8; 1 << 20];
    let start = Instant::now();
    while file.read(&mut buf).map_err(io("reading"))? > 0 {}
    let read = start.elapsed();
    let _ = std::fs::remove_file(path);
    let mib = size as f64 / (1 << 20) as f64;
    Ok((mib / write.as_secs_f64(), mib / read.as_secs_f64()))
}

/// The Full snapshot at `path("full.*")`: its state, and its memory file open.
fn read_full(path: &dyn Fn(&str) -> PathBuf) -> Result<(SnapshotState, File), SnapshotBenchError> {
    let bytes = std::fs::read(path("full.state")).map_err(io("reading the state"))?;
    let state = SnapshotState::from_bytes(&bytes).map_err(|e| {
        SnapshotBenchError::Io(e.to_string(), std::io::ErrorKind::InvalidData.into())
    })?;
    let mem = File::open(path("full.mem")).map_err(io("the memory file"))?;
    Ok((state, mem))
}

/// A restore of the Full snapshot at `path("full.*")` with `backend` and the loader options
/// `lazy` gives for the snapshot's id and layout, timed to its first guest command done and
/// to the guest having verified every page it wrote; with the pages the loader filled on
/// fault. `Err(None)` if the guest's verify failed.
fn timed_restore(
    config: &SnapshotBenchConfig,
    stopped: &Arc<EventFd>,
    area: &TestArea,
    path: &dyn Fn(&str) -> PathBuf,
    backend: MemBackend,
    lazy: impl FnOnce(u128, &MemoryLayout) -> Result<LazyOptions, SnapshotBenchError>,
) -> Result<(RestoreRow, u64), Option<SnapshotBenchError>> {
    let start = Instant::now();
    let (state, mem) = read_full(path)?;
    let id = state.snapshot.map_or(0, |info| info.id.0);
    let lazy = lazy(id, &state.layout)?;
    let vm = TestVm::restore_with(&state.layout, &mem, backend, lazy, config.vm_options())
        .map_err(SnapshotBenchError::from)?;
    let mut vcpus = vm
        .start_restored_vcpus(&state.vcpus, stopped)
        .map_err(SnapshotBenchError::from)?;
    vcpus.set_timeout(Duration::from_secs(600));
    let one = Command {
        end: area.gpa + 8,
        ..command(Op::Verify, area, 8, 1)
    };
    vcpus.run(0, one).map_err(SnapshotBenchError::from)?;
    let first_command_ms = ms(start.elapsed());
    let verified = vcpus.run(0, command(Op::Verify, area, stride(config), 1));
    let verified_ms = ms(start.elapsed());
    vcpus.shut_down().map_err(SnapshotBenchError::from)?;
    if verified.is_err() {
        return Err(None);
    }
    let faults = vm.loader().map_or(0, |loader| {
        let stats = loader.stats();
        stats.copied.load(Ordering::Acquire) + stats.zeroed.load(Ordering::Acquire)
    });
    let copy_calls = vm
        .loader()
        .map(|loader| loader.stats().copy_calls.load(Ordering::Acquire));
    Ok((
        RestoreRow {
            backend: format!("{backend:?}").to_lowercase(),
            first_command_ms,
            verified_ms,
            copy_calls,
        },
        faults,
    ))
}

/// A uffd restore of the Full snapshot at `path("full.*")` whose written pages the VMM reads
/// (one byte each, through the manager's memory), timed from the start of the restore to the
/// last read; no vCPU runs.
fn host_touch_restore(
    config: &SnapshotBenchConfig,
    area: &TestArea,
    path: &dyn Fn(&str) -> PathBuf,
) -> Result<RestoreRow, SnapshotBenchError> {
    use vm_memory::{Bytes, GuestAddress, GuestAddressSpace};
    let start = Instant::now();
    let (state, mem) = read_full(path)?;
    let vm = TestVm::restore_with(
        &state.layout,
        &mem,
        MemBackend::Uffd,
        LazyOptions::default(),
        config.vm_options(),
    )?;
    let first_command_ms = ms(start.elapsed());
    let memory = vm.memory().handle().memory();
    for gpa in (area.gpa..area.end()).step_by(stride(config) as usize) {
        memory
            .read_obj::<u8>(GuestAddress(gpa))
            .map_err(|e| io("reading guest memory")(std::io::Error::other(e)))?;
    }
    let verified_ms = ms(start.elapsed());
    let copy_calls = vm
        .loader()
        .map(|loader| loader.stats().copy_calls.load(Ordering::Acquire));
    Ok(RestoreRow {
        backend: "uffd, VMM reads".into(),
        first_command_ms,
        verified_ms,
        copy_calls,
    })
}

/// Runs the benchmark; `stop` ends it between steps.
pub fn run_snapshot_bench(
    config: &SnapshotBenchConfig,
    stop: &AtomicBool,
    stopped: &Arc<EventFd>,
) -> Result<SnapshotBenchReport, SnapshotBenchError> {
    let max = tinyvmm::vm::max_slots().map_err(GuestError::Vm)?;
    for &slots in &config.slots {
        check_slot_count(slots, max)?;
    }
    std::fs::create_dir_all(&config.dir).map_err(io("creating the bench folder"))?;
    let (write_mib_s, read_mib_s) = bandwidth(&config.dir.join("bandwidth"), config.area_size)?;
    let check = || {
        if stop.load(Ordering::Acquire) {
            Err(SnapshotBenchError::Interrupted)
        } else {
            Ok(())
        }
    };
    let mut rows = Vec::new();
    let mut skipped = Vec::new();
    for &slots in &config.slots {
        for &page_size in &config.page_sizes {
            check()?;
            match bench_row(config, stopped, slots, page_size, &check)? {
                Ok(row) => rows.push(row),
                Err(why) => {
                    eprintln!("SKIPPED {slots} slots, {} pages: {why}", page_size.name());
                    skipped.push(format!("{slots} slots, {} pages: {why}", page_size.name()));
                }
            }
        }
    }
    Ok(SnapshotBenchReport {
        area_size: config.area_size,
        write_mib_s,
        read_mib_s,
        touch_all: config.touch_all,
        rows,
        skipped,
    })
}

/// Why a row cannot be measured on this host, if it cannot.
fn cannot(config: &SnapshotBenchConfig, slots: usize, page_size: PageSize) -> Option<String> {
    let page = page_size.alignment();
    if config.area_size / (slots as u64 - 1) < page {
        return Some(format!(
            "{} MiB cannot be split into {} slots of whole {} KiB pages",
            config.area_size >> 20,
            slots - 1,
            page >> 10
        ));
    }
    let needed = config.area_size / page;
    let available = hugetlb_pages_available();
    if page_size == PageSize::Huge2M && available < needed {
        return Some(format!(
            "the hugetlb pool has {available} free 2 MiB pages, the area needs {needed}"
        ));
    }
    None
}

/// One row: the snapshots and restores of a VM of `slots` slots in pages of `page_size`;
/// `Ok(Err(why))` if this host cannot have it.
fn bench_row(
    config: &SnapshotBenchConfig,
    stopped: &Arc<EventFd>,
    slots: usize,
    page_size: PageSize,
    check: &dyn Fn() -> Result<(), SnapshotBenchError>,
) -> Result<Result<SnapshotRow, String>, SnapshotBenchError> {
    if let Some(why) = cannot(config, slots, page_size) {
        return Ok(Err(why));
    }
    {
        let path = |name: &str| {
            config
                .dir
                .join(format!("{slots}-{}-{name}", page_size.name()))
        };
        let (vm, area, mut vcpus) = new_vm(slots, page_size, config, stopped)?;
        // Half the pages hold data (or all).
        vcpus.run(0, command(Op::Write, &area, stride(config), 1))?;
        let start = Instant::now();
        let memory = vm.memory();
        memory.start_dirty_log(Target::All)?;
        memory.harvest_dirty(Target::All)?;
        let full = new_file(&path("full.mem"))?;
        write_memory_file(memory, &MemoryLayout::of(memory), &full)?;
        let full_info = save_state(&vm, &mut vcpus, &path("full.state"), None)?;
        let full_ms = ms(start.elapsed());
        // One page in 16 dirtied since.
        vcpus.run(0, command(Op::Write, &area, 16 * 4096, 2))?;
        let start = Instant::now();
        let dirty = memory.harvest_dirty(Target::All)?;
        let diff = new_file(&path("diff.mem"))?;
        write_dirty_pages(memory, &MemoryLayout::of(memory), &dirty, &diff)?;
        save_state(&vm, &mut vcpus, &path("diff.state"), Some(&full_info))?;
        let diff_ms = ms(start.elapsed());
        vcpus.shut_down()?;
        drop(vm);

        let mut restores = Vec::new();
        let (tx, recorded) = std::sync::mpsc::channel();
        for backend in [MemBackend::Copy, MemBackend::File, MemBackend::Uffd] {
            if backend == MemBackend::File && page_size != PageSize::Base {
                // A file restore of huge pages is refused: the memory file is on no hugetlbfs,
                // and transparent huge pages are for anonymous memory and memfds.
                continue;
            }
            check()?;
            // The lazy restore records the pages the guest touches first, for the next.
            let (row, _) = timed_restore(config, stopped, &area, &path, backend, |id, _| {
                let tx = tx.clone();
                Ok(LazyOptions {
                    record: (backend == MemBackend::Uffd).then(|| {
                        Recording::new(id, None, move |set| {
                            let _ = tx.send(set);
                        })
                    }),
                    ..LazyOptions::default()
                })
            })
            .map_err(|e| e.unwrap_or(SnapshotBenchError::Verify { backend, slots }))?;
            restores.push(row);
        }
        check()?;
        let set = recorded
            .try_recv()
            .map_err(|_| io("the recorded working set")(std::io::ErrorKind::NotFound.into()))?;
        let list = path("full.wset");
        std::fs::write(&list, set.to_bytes()).map_err(io("writing the working set"))?;
        // Read back and checked against the snapshot, as `tinyvmm restore --prefetch` does.
        let (mut prefetch, faults) = timed_restore(
            config,
            stopped,
            &area,
            &path,
            MemBackend::Uffd,
            |id, layout| {
                let bytes = std::fs::read(&list).map_err(io("reading the working set"))?;
                let set = WorkingSet::from_bytes(&bytes)?;
                set.check(id, layout)?;
                Ok(LazyOptions {
                    prefetch: Some(set),
                    ..LazyOptions::default()
                })
            },
        )
        .map_err(|e| {
            e.unwrap_or(SnapshotBenchError::Verify {
                backend: MemBackend::Uffd,
                slots,
            })
        })?;
        prefetch.backend = "uffd+prefetch".into();
        check()?;
        let host_touch = host_touch_restore(config, &area, &path)?;
        check()?;
        let start = Instant::now();
        let (_vm, area, mut vcpus) = new_vm(slots, page_size, config, stopped)?;
        vcpus.run(
            0,
            Command {
                end: area.gpa + 8,
                ..command(Op::Write, &area, 8, 3)
            },
        )?;
        let cold_start_ms = ms(start.elapsed());
        vcpus.shut_down()?;
        let row = SnapshotRow {
            slots,
            page_size: page_size.name(),
            full_ms,
            full_bytes: disk_bytes(&full),
            diff_ms,
            diff_bytes: disk_bytes(&diff),
            cold_start_ms,
            restores,
            working_set_pages: set.pages(),
            prefetch,
            prefetch_faults: faults,
            host_touch,
        };
        for name in [
            "full.mem",
            "full.state",
            "diff.mem",
            "diff.state",
            "full.wset",
        ] {
            let _ = std::fs::remove_file(path(name));
        }
        Ok(Ok(row))
    }
}

impl std::fmt::Display for SnapshotBenchReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "snapshots of {} MiB ({} the pages written), file system: write {:.0} MiB/s (fsync), read {:.0} MiB/s",
            self.area_size >> 20,
            if self.touch_all { "all" } else { "half" },
            self.write_mib_s,
            self.read_mib_s
        )?;
        writeln!(
            f,
            "| slots | pages | Full | Full on disk | Diff (1/16) | Diff on disk | cold start | restore copy: first / verified | file | uffd | uffd copies | uffd+prefetch | prefetch copies | prefetch / file (verified) |"
        )?;
        writeln!(
            f,
            "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
        )?;
        let times = |x: &RestoreRow| format!("{:.0} / {:.0} ms", x.first_command_ms, x.verified_ms);
        for r in &self.rows {
            let restore = |b: &str| {
                r.restores
                    .iter()
                    .find(|x| x.backend == b)
                    .map_or(String::new(), times)
            };
            let file = r.restores.iter().find(|x| x.backend == "file");
            let copies = |x: Option<&RestoreRow>| {
                x.and_then(|x| x.copy_calls)
                    .map_or(String::new(), |c| c.to_string())
            };
            writeln!(
                f,
                "| {} | {} | {:.0} ms | {} MiB | {:.0} ms | {} MiB | {:.0} ms | {} | {} | {} | {} | {} | {} | {} |",
                r.slots,
                r.page_size,
                r.full_ms,
                r.full_bytes >> 20,
                r.diff_ms,
                r.diff_bytes >> 20,
                r.cold_start_ms,
                restore("copy"),
                restore("file"),
                restore("uffd"),
                copies(r.restores.iter().find(|x| x.backend == "uffd")),
                times(&r.prefetch),
                copies(Some(&r.prefetch)),
                file.map_or(String::new(), |file| format!(
                    "{:.2}×",
                    r.prefetch.verified_ms / file.verified_ms
                ))
            )?;
        }
        for r in &self.rows {
            writeln!(
                f,
                "{} slots, {} pages: working set of {} pages recorded by the uffd restore; {} \
                 pages still faulted in with it prefetched; a uffd restore whose written pages \
                 the VMM reads (no guest): {:.0} ms, {} copies",
                r.slots,
                r.page_size,
                r.working_set_pages,
                r.prefetch_faults,
                r.host_touch.verified_ms,
                r.host_touch.copy_calls.unwrap_or(0)
            )?;
        }
        // Each page size's lazy restore against the 4 KiB one of the same slot count.
        let uffd = |r: &SnapshotRow| r.restores.iter().find(|x| x.backend == "uffd").cloned();
        for base in self.rows.iter().filter(|r| r.page_size == "4k") {
            for other in self
                .rows
                .iter()
                .filter(|r| r.slots == base.slots && r.page_size != "4k")
            {
                if let (Some(b), Some(o)) = (uffd(base), uffd(other)) {
                    writeln!(
                        f,
                        "{} slots: uffd to verified {:.1}× faster in {} pages than in 4k \
                         ({:.0} / {:.0} ms; {} / {} copies); with the working set prefetched \
                         {:.1}×",
                        base.slots,
                        b.verified_ms / o.verified_ms,
                        other.page_size,
                        b.verified_ms,
                        o.verified_ms,
                        b.copy_calls.unwrap_or(0),
                        o.copy_calls.unwrap_or(0),
                        base.prefetch.verified_ms / other.prefetch.verified_ms
                    )?;
                    writeln!(
                        f,
                        "{} slots: the VMM reading every written page of a uffd restore (no \
                         guest) {:.1}× faster in {} pages than in 4k ({:.0} / {:.0} ms)",
                        base.slots,
                        base.host_touch.verified_ms / other.host_touch.verified_ms,
                        other.page_size,
                        base.host_touch.verified_ms,
                        other.host_touch.verified_ms
                    )?;
                }
            }
        }
        for why in &self.skipped {
            writeln!(f, "skipped: {why}")?;
        }
        Ok(())
    }
}

/// `tinyvmm-bench snapshot-bench`'s arguments.
#[derive(Debug, clap::Args)]
pub struct SnapshotBenchArgs {
    /// KVM slot counts, comma-separated (each 2 to KVM's maximum) [default: 2, 4096 and
    /// KVM's maximum]
    #[arg(long, value_delimiter = ',', value_parser = slot_count(2))]
    pub slots: Vec<usize>,
    /// MiB of test memory.
    #[arg(long, alias = "area-mib", default_value_t = 512)]
    pub mem_mib: u64,
    /// The folder for the snapshot files (on the file system to measure).
    #[arg(long, default_value = "target/bench/snapshots")]
    pub dir: PathBuf,
    /// Where to write the results as JSON.
    #[arg(long, default_value = "target/bench/tinyvmm-snapshot.json")]
    pub out: PathBuf,
    /// Print the results as JSON alone on stdout (the table goes to stderr).
    #[arg(long)]
    pub json: bool,
    /// Page sizes of the test memory, comma-separated: a row each per slot count.
    #[arg(long, value_delimiter = ',', value_enum, default_value = "4k")]
    pub page_sizes: Vec<RegionPageSize>,
    /// Which pages the guest writes (and verifies after each restore): every other one, or
    /// all.
    #[arg(long, value_enum, default_value_t = Touch::Half)]
    pub touch: Touch,
    /// The memory limits of the VMs it creates.
    #[command(flatten)]
    pub limits: LimitArgs,
}

/// Which pages `snapshot-bench`'s guest writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Touch {
    /// Every other page.
    Half,
    /// Every page.
    All,
}

impl SnapshotBenchArgs {
    /// Runs the snapshot bench on a job thread, prints its table and writes its JSON; gives
    /// the exit status.
    pub fn run(self) -> ExitCode {
        let slots = if self.slots.is_empty() {
            match tinyvmm::vm::max_slots() {
                Ok(max) => vec![2, 4096, max],
                Err(e) => {
                    eprintln!("tinyvmm: {e}");
                    return ExitCode::FAILURE;
                }
            }
        } else {
            self.slots
        };
        let config = SnapshotBenchConfig {
            slots,
            area_size: self.mem_mib.saturating_mul(1 << 20),
            dir: self.dir,
            limits: Some(self.limits.resolve()),
            page_sizes: self.page_sizes.into_iter().map(Into::into).collect(),
            touch_all: self.touch == Touch::All,
        };
        let outcome = run_job(move |ctx| run_snapshot_bench(&config, &ctx.stop, &ctx.vcpu_stopped));
        let report = match job_report(outcome, "", self.json) {
            Ok(report) => report,
            Err(code) => return code,
        };
        print_report(&report, self.json, true, "");
        write_json(&self.out, &report)
    }
}
