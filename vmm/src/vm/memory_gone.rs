//! Guest memory gone under the VM: a `SIGBUS` handler that keeps the process alive when the
//! file behind a file-backed restore is truncated or replaced, and says where it happened.
//!
//! It acts only on a bus error the kernel raised for an access (`BUS_ADRERR`, `BUS_OBJERR`)
//! inside guest memory mapped from a file ([`guard`]); any other `SIGBUS` (one another process
//! sent with kill(2), an access elsewhere) does what the signal does by default.
//!
//! It also names where memory went for the vCPU loop: the guest address, the region and the
//! file of the access the handler patched over, and of a file-backed region whose file is
//! shorter than the VM maps it, where KVM failed to map a page of it.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;

use kvm_memslots::{KvmMemory, KvmVm, MemoryManager, RegionInfo};

/// How many file-backed ranges the table holds one by one; past that, one range spans the
/// rest.
const RANGES: usize = 64;

/// The file-backed guest memory the handler acts on: `[start, end)` pairs, read lock-free by
/// the handler (a pair is written before [`GUARDED`] counts it).
static STARTS: [AtomicU64; RANGES] = [const { AtomicU64::new(0) }; RANGES];
static ENDS: [AtomicU64; RANGES] = [const { AtomicU64::new(0) }; RANGES];
static GUARDED: AtomicUsize = AtomicUsize::new(0);
/// Serialises [`guard`]'s writers (never taken by the handler).
static WRITER: Mutex<()> = Mutex::new(());

/// Registers `[start, start + len)` host ranges as guest memory mapped from a file, which the
/// handler may patch with a zero page when the file is cut under it.
pub(super) fn guard(ranges: impl IntoIterator<Item = (u64, u64)>) {
    let _writer = WRITER.lock().unwrap_or_else(|e| e.into_inner());
    for (start, len) in ranges {
        let end = start.saturating_add(len);
        let used = GUARDED.load(Ordering::Acquire);
        if used < RANGES {
            STARTS[used].store(start, Ordering::Relaxed);
            ENDS[used].store(end, Ordering::Relaxed);
            GUARDED.store(used + 1, Ordering::Release);
        } else {
            // The last entry grows to span this one too.
            let last = RANGES - 1;
            STARTS[last].fetch_min(start, Ordering::AcqRel);
            ENDS[last].fetch_max(end, Ordering::AcqRel);
        }
    }
}

/// Whether `addr` lies in a range [`guard`] registered (async-signal-safe: atomics only).
fn guarded(addr: u64) -> bool {
    let used = GUARDED.load(Ordering::Acquire);
    (0..used).any(|i| {
        STARTS[i].load(Ordering::Acquire) <= addr && addr < ENDS[i].load(Ordering::Acquire)
    })
}

/// Whether a bus error with `code` at `addr` is the kernel's, for an access inside guarded
/// guest memory: the only kind the handler patches over.
fn ours(code: libc::c_int, addr: u64) -> bool {
    // BUS_ADRERR (2): a page past the end of its file; BUS_OBJERR (3): the object's error. A
    // signal sent by kill(2), tkill(2) or sigqueue(3) has a code of 0 or below.
    matches!(code, 2 | 3) && addr != 0 && guarded(addr)
}

/// Installs the `SIGBUS` handler (once per process; [`Vm::new`](super::Vm::new) does).
pub(super) fn install() {
    static HANDLER: std::sync::Once = std::sync::Once::new();
    HANDLER.call_once(|| {
        vmm_sys_util::signal::register_signal_handler(libc::SIGBUS, on_bus_error)
            .expect("SIGBUS is a valid signal for a handler");
    });
}

/// The host address of the first access that found guest memory gone (0: none yet).
static MEMORY_GONE: AtomicU64 = AtomicU64::new(0);

/// The host address of the first access to guest memory whose backing file page was gone
/// (the memory file of a file-backed restore truncated or replaced under the VM: `SIGBUS`),
/// once one happened. The access went on against a zero page put in its place; the VM must
/// stop (its vCPUs do, at their next exit) and nothing may be saved from it.
pub(super) fn memory_gone() -> Option<u64> {
    match MEMORY_GONE.load(Ordering::Acquire) {
        0 => None,
        hva => Some(hva),
    }
}

extern "C" fn on_bus_error(_: libc::c_int, info: *mut libc::siginfo_t, _: *mut libc::c_void) {
    // SAFETY: the kernel hands an SA_SIGINFO handler a valid siginfo for this signal.
    let info = unsafe { &*info };
    // SAFETY: for SIGBUS the kernel fills the siginfo's fault address field.
    let addr = unsafe { info.si_addr() } as u64;
    let page = addr & !(kvm_memslots::PAGE_SIZE - 1);
    let mapped = if !ours(info.si_code, addr) {
        libc::MAP_FAILED
    } else {
        // SAFETY: mmap(2) is a system call (no lock, no allocation). It puts a private zero
        // page over the one page whose file page is gone, in a mapping of guest memory the
        // manager keeps (a bus error past a file's end happens only in file mappings, and
        // guest memory is this process's only file mapping written through pointers); the
        // access that faulted then completes, against zeros, and the VM is stopped.
        unsafe {
            libc::mmap(
                page as *mut libc::c_void,
                kvm_memslots::PAGE_SIZE as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
                -1,
                0,
            )
        }
    };
    if mapped == libc::MAP_FAILED {
        // Nothing to do but what the signal does by default: the faulting access comes again
        // and ends the process; a signal sent from outside is raised again, and ends it too.
        // SAFETY: signal(2) with SIG_DFL and raise(3) are async-signal-safe.
        unsafe {
            libc::signal(libc::SIGBUS, libc::SIG_DFL);
        }
        if info.si_code <= 0 {
            // SAFETY: as above.
            unsafe { libc::raise(libc::SIGBUS) };
        }
        return;
    }
    let _ = MEMORY_GONE.compare_exchange(0, addr, Ordering::AcqRel, Ordering::Acquire);
}

/// Host address `hva` as the guest and the operator know it: the guest address, its region,
/// and the file behind it.
pub(crate) fn gone_place(memory: &MemoryManager<KvmVm>, hva: u64) -> String {
    let Some(found) = memory
        .find_by_hva(kvm_memslots::HostAddress(hva))
        .into_iter()
        .next()
    else {
        return format!("host address {hva:#x}");
    };
    let file = memory
        .load()
        .get(found.slot)
        .and_then(|slot| slot.payload().memory().file_offset().cloned())
        .and_then(|fo| {
            std::fs::read_link(format!(
                "/proc/self/fd/{}",
                std::os::fd::AsRawFd::as_raw_fd(fo.file())
            ))
            .ok()
        })
        .map_or_else(String::new, |path| format!(", file {}", path.display()));
    format!(
        "guest address {:#x} (region {}{file})",
        found.gpa.0, found.region
    )
}

/// Guest memory whose file is shorter than the VM maps it (a file-backed restore's memory
/// file truncated or replaced under the VM): where, for the first such region. Asked when the
/// guest stops on an error a missing page would cause (KVM_RUN's `EFAULT`, a triple fault:
/// KVM found no page to map, and the guest, not the VMM, touched it).
pub(crate) fn cut_memory<K: KvmMemory>(memory: &MemoryManager<K>) -> Option<String> {
    memory.regions().into_iter().find_map(|region| {
        let cut = Cut::of(memory, &region)?;
        // The first guest address past the file's end.
        let first = region.gpa.0 + cut.len.saturating_sub(cut.start).min(region.size);
        Some(format!(
            "guest address {first:#x} and on ({})",
            cut.describe(&region)
        ))
    })
}

/// Where the guest touched memory KVM could not map (`KVM_EXIT_MEMORY_FAULT` at `gpa`), if it
/// is a file-backed region's page past its file's end: the exact guest address, the region and
/// the file.
pub(crate) fn cut_at<K: KvmMemory>(memory: &MemoryManager<K>, gpa: u64) -> Option<String> {
    let region = memory
        .regions()
        .into_iter()
        .find(|r| (r.gpa.0..r.gpa.0 + r.size).contains(&gpa))?;
    let cut = Cut::of(memory, &region)?;
    (cut.start + (gpa - region.gpa.0) >= cut.len)
        .then(|| format!("guest address {gpa:#x} ({})", cut.describe(&region)))
}

/// A file-backed region whose file is shorter than the VM maps it.
struct Cut {
    /// The file, as `/proc/self/fd` names it.
    path: String,
    /// Where the region starts in it.
    start: u64,
    /// The file's size now.
    len: u64,
}

impl Cut {
    fn of<K: KvmMemory>(memory: &MemoryManager<K>, region: &RegionInfo) -> Option<Cut> {
        let mapping = memory.region_memory(region.id)?;
        let file = mapping.file_offset()?;
        let len = file.file().metadata().ok()?.len();
        (len < file.start().saturating_add(region.size)).then(|| Cut {
            path: std::fs::read_link(format!(
                "/proc/self/fd/{}",
                std::os::fd::AsRawFd::as_raw_fd(file.file())
            ))
            .map_or_else(
                |_| "its file".to_owned(),
                |p| format!("file {}", p.display()),
            ),
            start: file.start(),
            len,
        })
    }

    /// The region, the file and how much of it is left.
    fn describe(&self, region: &RegionInfo) -> String {
        format!(
            "region {} [{:#x}, {:#x}), {}, now {} bytes where the VM maps {}",
            region.id,
            region.gpa.0,
            region.gpa.0 + region.size,
            self.path,
            self.len,
            self.start.saturating_add(region.size)
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_kernels_bus_errors_in_guarded_memory_are_ours() {
        guard([(0x7000_0000_0000, 0x20_0000)]);
        let inside = 0x7000_0000_1008;
        assert!(ours(2, inside), "BUS_ADRERR inside a guarded range");
        assert!(ours(3, inside), "BUS_OBJERR inside a guarded range");
        assert!(!ours(0, inside), "SI_USER: kill(2) from anyone");
        assert!(!ours(-6, inside), "SI_TKILL");
        assert!(!ours(1, inside), "BUS_ADRALN is no file's doing");
        assert!(!ours(2, 0x7000_0020_0000), "just past the range");
        assert!(!ours(2, 0x6fff_ffff_f000), "just below it");
        assert!(!ours(2, 0), "no address");
    }

    #[test]
    fn past_the_table_one_range_spans_the_rest() {
        // Fills the table (the other test's range may be in it already).
        let base = 0x6000_0000_0000u64;
        guard((0..RANGES as u64 + 2).map(|i| (base + i * 0x100_0000, 0x1000)));
        let last = base + (RANGES as u64 + 1) * 0x100_0000;
        assert!(ours(2, last), "the last range is still guarded");
        assert!(ours(2, base), "and the first");
    }

    /// A memory fault on a page of a file cut under the VM names that guest address, the
    /// region and the file; a page the file still has, or memory with no file, is not taken
    /// for cut memory.
    #[test]
    fn a_memory_fault_past_a_cut_files_end_names_the_guest_address_and_the_file() {
        use kvm_memslots::testing::FakeKvm;
        use kvm_memslots::{Backing, RegionSpec};
        use vm_memory::{FileOffset, GuestAddress};
        const BASE: u64 = 0x10_0000;
        let path = std::env::temp_dir().join(format!("tinyvmm-cut-at-{}", std::process::id()));
        let file = kvm_test_support::files::new_file_at(&path);
        file.set_len(0x8000).expect("sized");
        let memory = MemoryManager::new(FakeKvm::new(8, false));
        let backing = Backing::PrivateFile(FileOffset::new(file.try_clone().expect("dup"), 0));
        memory
            .add_region(RegionSpec::new(GuestAddress(BASE), 0x8000).with_backing(backing))
            .expect("a file region");
        memory
            .add_region(RegionSpec::new(GuestAddress(0x20_0000), 0x1000))
            .expect("an anonymous region");
        assert_eq!(cut_at(&memory, BASE + 0x6000), None, "the file is whole");
        file.set_len(0x3000).expect("cut");
        let place = cut_at(&memory, BASE + 0x6010).expect("a page past the end");
        let _ = std::fs::remove_file(&path);
        assert!(
            place.starts_with("guest address 0x106010 (region 0 [0x100000, 0x108000), file "),
            "{place}"
        );
        assert!(
            place.contains(&path.display().to_string())
                && place.ends_with("now 12288 bytes where the VM maps 32768)"),
            "{place}"
        );
        assert_eq!(cut_at(&memory, BASE + 0x2fff), None, "a page the file has");
        assert_eq!(cut_at(&memory, 0x20_0000), None, "memory with no file");
        assert_eq!(cut_at(&memory, 0x30_0000), None, "no memory");
        // Without KVM's address, the first address past the end, as before.
        let first = cut_memory(&memory).expect("cut memory");
        assert!(
            first.starts_with("guest address 0x103000 and on (region 0 "),
            "{first}"
        );
    }
}
