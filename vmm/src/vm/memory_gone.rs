//! Guest memory gone under the VM: a `SIGBUS` handler that keeps the process alive when the
//! file behind a file-backed restore is truncated or replaced, and says where it happened.

use std::sync::atomic::{AtomicU64, Ordering};

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
    let mapped = if addr == 0 {
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
        // and ends the process.
        // SAFETY: signal(2) with SIG_DFL is async-signal-safe.
        unsafe { libc::signal(libc::SIGBUS, libc::SIG_DFL) };
        return;
    }
    let _ = MEMORY_GONE.compare_exchange(0, addr, Ordering::AcqRel, Ordering::Acquire);
}
