//! Guest memory gone under the VM: a `SIGBUS` handler that keeps the process alive when the
//! file behind a file-backed restore is truncated or replaced, and says where it happened.
//!
//! It acts only on a bus error the kernel raised for an access (`BUS_ADRERR`, `BUS_OBJERR`)
//! inside guest memory mapped from a file ([`guard`]); any other `SIGBUS` (one another process
//! sent with kill(2), an access elsewhere) does what the signal does by default.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;

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
pub fn guard(ranges: impl IntoIterator<Item = (u64, u64)>) {
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
pub fn install() {
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
pub fn memory_gone() -> Option<u64> {
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
}
