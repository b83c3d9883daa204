//! How the project's integration tests use `/dev/kvm`.
//!
//! A test calls [`require_kvm`] first. Without a usable `/dev/kvm` it prints a loud SKIPPED
//! line and the test returns early; with one, the test's name is appended to the file named by
//! `$KVM_TEST_LOG`, which `tests/run.sh` counts so that CI reports how many KVM tests ran.

use std::fs::OpenOptions;
use std::io::Write;

/// Whether `/dev/kvm` can be opened for reading and writing. When it cannot, prints why the test
/// `name` is skipped; when it can, records that `name` ran on KVM.
pub fn require_kvm(name: &str) -> bool {
    if let Err(e) = OpenOptions::new().read(true).write(true).open("/dev/kvm") {
        eprintln!("SKIPPED {name}: cannot open /dev/kvm ({e}): this KVM test did not run");
        return false;
    }
    if let Ok(path) = std::env::var("KVM_TEST_LOG") {
        let mut log = OpenOptions::new()
            .append(true)
            .create(true)
            .open(&path)
            .unwrap_or_else(|e| panic!("cannot open $KVM_TEST_LOG ({path}): {e}"));
        // One write per line: tests run in parallel, and an O_APPEND write this small lands whole,
        // where `writeln!` may split the name and the newline into two writes that interleave.
        log.write_all(format!("{name}\n").as_bytes())
            .unwrap_or_else(|e| panic!("cannot write $KVM_TEST_LOG: {e}"));
    }
    true
}

/// A page-aligned page of memory, for probe slots.
#[repr(align(4096))]
#[derive(Debug)]
pub struct ProbePage(pub [u8; 4096]);

/// Whether KVM itself has a memory slot covering `gpa` in `vm`: creating a one-page slot there
/// (as slot number `probe_slot`, which the code under test must not use) is refused with
/// `EEXIST` exactly when one does. The probe slot is deleted again at once.
pub fn kvm_has_slot_at(vm: &kvm_ioctls::VmFd, probe_slot: u32, gpa: u64) -> bool {
    let probe = ProbePage([0; 4096]);
    let slot = kvm_bindings::kvm_userspace_memory_region {
        slot: probe_slot,
        flags: 0,
        guest_phys_addr: gpa & !0xfff,
        memory_size: 4096,
        userspace_addr: probe.0.as_ptr() as u64,
    };
    // SAFETY: the probe slot maps `probe`, a page-aligned page that outlives the slot: it is
    // deleted again below, before `probe` goes; the caller keeps `probe_slot` free of its own.
    match unsafe { vm.set_user_memory_region(slot) } {
        Ok(()) => {
            // SAFETY: deleting a slot (size 0) maps no memory.
            unsafe {
                vm.set_user_memory_region(kvm_bindings::kvm_userspace_memory_region {
                    memory_size: 0,
                    ..slot
                })
            }
            .expect("delete the probe slot");
            false
        }
        Err(e) if e.errno() == libc::EEXIST => true,
        Err(e) => panic!("probe at {gpa:#x}: {e}"),
    }
}

/// Real-mode code for a test that changes memory under a running vCPU: from a count of 0, it
/// adds one and writes the count (a 16-bit word) at offset 0x10 of each segment of
/// `segments` in turn (segment `s` is guest address `s << 4`), over and over, until the byte
/// at `stop` (in segment 0) is not zero; then it writes the count's low and high bytes to
/// `port` and halts. Every segment then holds the count the guest reported, unless a write
/// was lost.
pub fn counting_guest(segments: &[u16], stop: u16, port: u8) -> Vec<u8> {
    let mut code = vec![0x31, 0xd2]; // xor dx, dx
    let top = code.len();
    code.push(0x42); // inc dx
    for segment in segments {
        code.push(0xb8); // mov ax, segment
        code.extend(segment.to_le_bytes());
        code.extend([0x8e, 0xd8]); // mov ds, ax
        code.extend([0x89, 0x16, 0x10, 0x00]); // mov [0x10], dx
    }
    code.extend([0x31, 0xc0, 0x8e, 0xd8]); // xor ax, ax; mov ds, ax
    code.extend([0x80, 0x3e]); // cmp byte [stop], 0
    code.extend(stop.to_le_bytes());
    code.push(0x00);
    code.extend([0x75, 0x03]); // jne past the jump
    let back = top as i64 - (code.len() as i64 + 3);
    code.push(0xe9); // jmp top
    code.extend((back as i16).to_le_bytes());
    code.extend([0x89, 0xd0, 0xe6, port]); // mov ax, dx; out port, al
    code.extend([0x88, 0xe0, 0xe6, port]); // mov al, ah; out port, al
    code.push(0xf4); // hlt
    code
}

/// Points `vcpu` at real-mode code at guest address `rip` (below 64 KiB: code segment 0).
pub fn start_in_real_mode(vcpu: &kvm_ioctls::VcpuFd, rip: u64) {
    let mut sregs = vcpu.get_sregs().expect("get sregs");
    sregs.cs.base = 0;
    sregs.cs.selector = 0;
    vcpu.set_sregs(&sregs).expect("set sregs");
    let mut regs = vcpu.get_regs().expect("get regs");
    regs.rip = rip;
    regs.rflags = 2;
    vcpu.set_regs(&regs).expect("set regs");
}
