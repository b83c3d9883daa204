//! How the project's integration tests use `/dev/kvm` (and read a binary's `--help`:
//! [`cli`]; make scratch files and find the memfds a process maps: [`files`]).
//!
//! A test calls [`require_kvm`] first. Without a usable `/dev/kvm` it prints a loud SKIPPED
//! line and the test returns early; with one, the test's name is appended to the file named by
//! `$KVM_TEST_LOG`, which `tests/run.sh` counts so that CI reports how many KVM tests ran.

pub mod cli;
pub mod files;

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

/// How fast this host runs guest ring-0 code, in instructions per second, or `None` without a
/// usable `/dev/kvm`.
///
/// Measured with a real-mode guest (real mode is ring 0) that counts a register down and halts:
/// two instructions an iteration. A first short run sizes a second one of about a quarter of a
/// second, which gives the figure. With hardware virtualisation the loop runs natively (some
/// G instructions/s); on kvm_pvm it runs in KVM's instruction emulator, whose speed differs
/// 5–7× between machines of the same kind (0.3–2 M instructions/s), and halves again when the
/// core is shared. Tests scale their patience for a Linux guest's silent stretches with it
/// ([`patience_for`]).
pub fn ring0_speed() -> Option<f64> {
    // On a thread of its own, named as the `ring0-speed` binary is, so that
    // `tests/slow-emulator.py` caps the probe as it caps a slow machine's vCPUs.
    std::thread::Builder::new()
        .name("ring0-speed".into())
        .spawn(measure_ring0_speed)
        .ok()?
        .join()
        .ok()?
}

/// [`ring0_speed`]'s measurement, on the calling thread.
fn measure_ring0_speed() -> Option<f64> {
    let kvm = kvm_ioctls::Kvm::new().ok()?;
    let vm = kvm.create_vm().ok()?;
    const SIZE: usize = 0x10000;
    const CODE: u64 = 0x1000;
    // SAFETY: a fresh anonymous private mapping; nothing else refers to it.
    let memory = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            SIZE,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if memory == libc::MAP_FAILED {
        return None;
    }
    let region = kvm_bindings::kvm_userspace_memory_region {
        slot: 0,
        flags: 0,
        guest_phys_addr: 0,
        memory_size: SIZE as u64,
        userspace_addr: memory as u64,
    };
    // SAFETY: the slot maps `memory`, which stays mapped until after the VM is dropped below.
    let speed = if unsafe { vm.set_user_memory_region(region) }.is_ok() {
        // SAFETY: `memory` is a readable and writable mapping of SIZE bytes that nothing else
        // in this process refers to, and it outlives the slice (unmapped below, after it).
        let guest = unsafe { std::slice::from_raw_parts_mut(memory.cast::<u8>(), SIZE) };
        count_down(&vm, guest, CODE)
    } else {
        None
    };
    drop(vm);
    // SAFETY: `memory` is the mapping made above; the VM that mapped it is gone.
    unsafe { libc::munmap(memory, SIZE) };
    speed
}

/// Runs the count-down loop at guest address `code` of `memory` (guest address 0) twice; the
/// instructions per second of the second run.
fn count_down(vm: &kvm_ioctls::VmFd, memory: &mut [u8], code: u64) -> Option<f64> {
    let mut vcpu = vm.create_vcpu(0).ok()?;
    let mut run = |iterations: u32| -> Option<f64> {
        let mut loop_code = vec![0x66, 0xb9]; // mov ecx, iterations
        loop_code.extend(iterations.to_le_bytes());
        loop_code.extend([0x66, 0x49]); // dec ecx
        loop_code.extend([0x75, 0xfc]); // jnz back to the dec
        loop_code.push(0xf4); // hlt
        let at = code as usize;
        memory[at..at + loop_code.len()].copy_from_slice(&loop_code);
        start_in_real_mode(&vcpu, code);
        let started = std::time::Instant::now();
        loop {
            match vcpu.run().ok()? {
                kvm_ioctls::VcpuExit::Hlt => break,
                kvm_ioctls::VcpuExit::IoOut(..) | kvm_ioctls::VcpuExit::IoIn(..) => {}
                _ => return None,
            }
        }
        let took = started.elapsed().as_secs_f64().max(1e-6);
        Some(2.0 * f64::from(iterations) / took)
    };
    let first = run(20_000)?;
    // A quarter of a second at the first run's speed; at least as long as the first run.
    let iterations = (first * 0.25 / 2.0).clamp(20_000.0, f64::from(u32::MAX)) as u32;
    run(iterations)
}

/// How long a test may wait for a sign of progress (a console line, an exit) from a guest whose
/// ring 0 does `instructions` instructions between two such signs, at `speed` instructions per
/// second ([`ring0_speed`]): four times the time it should take, and never under a minute. A
/// hang guard that follows the machine's speed, not a timing check.
pub fn patience_for(instructions: f64, speed: Option<f64>) -> std::time::Duration {
    let speed = speed.unwrap_or(2e6).max(1.0);
    std::time::Duration::from_secs_f64((4.0 * instructions / speed).max(60.0))
}
