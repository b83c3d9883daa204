//! Boots Debian's stock kernel (fetched by `resources/fetch-kernel.sh`, which `tests/run.sh`
//! runs first) and lets the kernel check the VMM's work: the `BIOS-e820` map it prints, the
//! `extended` and `reserve setup_data` maps past 128 ranges, its command line and where it
//! found the initramfs must be exactly what the VMM built from the kvm-memslots map, for RAM in
//! 256 slots with holes (a map that needs `SETUP_E820_EXT`) entered through the 64-bit Linux
//! boot protocol with an initramfs: one boot checks it all. (RAM in 4096 slots entered through
//! PVH, the ACPI tables, the MADT and a virtio-mem area are checked on `linux_snapshot.rs`'s
//! uninterrupted boot, which runs past them anyway: every Linux boot costs minutes on a slow
//! machine of this kind, so no test boots for what another boot shows.)
//!
//! On this project's host (`/dev/kvm` is kvm_pvm, no VT-x/AMD-V) guest ring 0 runs in KVM's
//! instruction emulator, whose speed differs 5-7x between machines: the kernel reaches its e820
//! print after some 8 s on a fast one and a minute on a slow one, and stops later on the `int3`
//! of its self-test (that ending is checked by `linux_snapshot.rs`, whose uninterrupted boot
//! runs to it anyway). The tests boot the ELF vmlinux from the same package (PVH or the 64-bit
//! entry; the bzImage's decompressor alone takes minutes in the emulator) and stop the VM once
//! the kernel printed what they check. No boot has a deadline: a guest that prints nothing for
//! [`support::linux_patience`] (scaled to the host's measured ring-0 speed) is stopped and the
//! test fails with its last lines. With hardware virtualisation, further tests boot the bzImage
//! to a busybox shell.

use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use serde_json::Value;
use tinyvmm::api::client::Client;
use tinyvmm::jobs::boot::boot;
use tinyvmm::linux::e820::{kernel_lines, lines_in_log};
use tinyvmm::linux::{
    BootConfig, BootEnding, BootProtocol, BootReport, Console, E820Entry, E820Kind, GuestStop,
    KernelFormat,
};

mod support;
use support::{
    cache, cpio, debian_kernel, hardware_virtualisation, last_mem_total, ready, virtio_initramfs,
    CMDLINE,
};

/// The most a boot with hardware virtualisation (the gated tests) may take: the guest's ring 0
/// runs natively there, so no emulator's speed is in it. The tests that run here have no
/// deadline for the whole boot: they stop a guest that printed nothing for
/// [`support::linux_patience`].
const HW_TIMEOUT_SECS: f64 = 120.0;

/// Says, line by line, whether the console has shown what a test waits for.
type Until = Box<dyn FnMut(&str) -> bool + Send>;

/// The serial console's output, kept; raises `stop` once `until` says a line is the last one
/// needed (set once, when the VMM has built what the lines must show).
#[derive(Clone)]
struct Capture {
    log: Arc<Mutex<Vec<u8>>>,
    line_start: Arc<Mutex<usize>>,
    until: Arc<Mutex<Option<Until>>>,
    stop: Arc<AtomicBool>,
}

impl Capture {
    fn new() -> Self {
        Capture {
            log: Arc::default(),
            line_start: Arc::default(),
            until: Arc::default(),
            stop: Arc::default(),
        }
    }

    fn text(&self) -> String {
        String::from_utf8_lossy(&self.log.lock().expect("the console log lock")).into_owned()
    }
}

impl Write for Capture {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let mut log = self.log.lock().expect("the console log lock");
        log.extend_from_slice(buf);
        let mut start = self.line_start.lock().expect("the line lock");
        if let Some(last) = log[*start..].iter().rposition(|&b| b == b'\n') {
            let mut until = self.until.lock().expect("the until lock");
            if let Some(until) = until.as_mut() {
                for line in log[*start..*start + last].split(|&b| b == b'\n') {
                    if until(&String::from_utf8_lossy(line)) {
                        self.stop.store(true, Ordering::Release);
                    }
                }
            }
            *start += last + 1;
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Boots `config` with its console captured, stopping once the check `until` makes from the
/// VMM's report (asked before the guest starts; `None`: run to the end) says a line was the
/// last one needed.
fn run(
    config: &BootConfig,
    until: impl FnOnce(&BootReport) -> Option<Until>,
) -> (BootReport, String) {
    let capture = Capture::new();
    let console = Console {
        output: Box::new(capture.clone()),
        stdin: false,
        stop: Some(Arc::clone(&capture.stop)),
    };
    let started = std::time::Instant::now();
    // Stops a guest that makes no progress (no console output) for the host's patience.
    let ended = Arc::new(AtomicBool::new(false));
    let watchdog = {
        let (capture, ended) = (capture.clone(), Arc::clone(&ended));
        std::thread::spawn(move || {
            let mut progress = support::Progress::default();
            while !ended.load(Ordering::Acquire) {
                let len = capture.log.lock().expect("the console log lock").len();
                if progress.stalled(len) {
                    capture.stop.store(true, Ordering::Release);
                    return Some(progress.patience());
                }
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
            None
        })
    };
    let report = boot(config, console, |report| {
        *capture.until.lock().expect("the until lock") = until(report);
    })
    .expect("the VMM sets the guest up");
    ended.store(true, Ordering::Release);
    let log = capture.text();
    if let Some(patience) = watchdog.join().expect("the watchdog") {
        panic!(
            "the guest printed nothing for {patience:?} and was stopped ({}); its last lines:\n{}",
            report.ending,
            support::tail(&log, 20)
        );
    }
    eprintln!(
        "boot with {} slots, {} e820 ranges ended after {:.1} s: {}",
        report.slots,
        report.e820.len(),
        started.elapsed().as_secs_f64(),
        report.ending
    );
    (report, log)
}

/// The map the kernel prints after it reserved the setup_data: the range holding it is split off
/// (as E820_TYPE_RESERVED_KERN, which prints as "usable").
fn split_at_setup_data(map: &[E820Entry], (addr, len): (u64, u64)) -> Vec<E820Entry> {
    let mut out = Vec::new();
    for e in map {
        let end = addr + len;
        if addr >= e.addr && end <= e.end() {
            for (from, to) in [(e.addr, addr), (addr, end), (end, e.end())] {
                if to > from {
                    out.push(E820Entry {
                        addr: from,
                        size: to - from,
                        kind: e.kind,
                    });
                }
            }
        } else {
            out.push(*e);
        }
    }
    out
}

/// Fails with the log unless the guest was stopped by the test after the e820 print, or
/// stopped on the host's limitation after it (never a VMM error).
fn check_ending(report: &BootReport, log: &str) {
    match &report.ending {
        BootEnding::Stopped | BootEnding::Reset => {}
        BootEnding::GuestStopped(stop @ GuestStop::HostLimitation { .. }) => {
            let message = stop.to_string();
            assert!(message.contains("limitation of the host"), "{message}");
        }
        other => panic!("the boot ended with: {other}\n--- console ---\n{log}"),
    }
}

/// The kernel printed exactly the command line the VMM built, once.
fn check_command_line(report: &BootReport, log: &str) {
    let command_line: Vec<&str> = log
        .lines()
        .filter_map(|l| l.split_once("] Command line: ").map(|(_, c)| c.trim_end()))
        .collect();
    assert_eq!(
        command_line,
        [report.cmdline.as_str()],
        "the kernel's command line\n{log}"
    );
}

/// The memblock dump's line for a range the kernel reserved (`memblock=debug`, printed by
/// `memblock_dump_all` at the end of `e820__memblock_setup`): ` reserved[0x5]\t[0x…-0x…],
/// 0x… bytes flags: 0x0`, as `(start, last byte, size)`.
fn memblock_reserved(log: &str) -> Vec<(u64, u64, u64)> {
    let hex = |s: &str| u64::from_str_radix(s.trim().trim_start_matches("0x"), 16).ok();
    log.lines()
        .filter_map(|line| {
            let (_, rest) = line.split_once(" reserved[")?;
            let (_, rest) = rest.split_once("]\t[")?;
            let (range, rest) = rest.split_once("], ")?;
            let (start, last) = range.split_once('-')?;
            let (size, _) = rest.split_once(" bytes")?;
            Some((hex(start)?, hex(last)?, hex(size)?))
        })
        .collect()
}

/// The pages the kernel reserves for an initramfs of `size` bytes at `addr` (it reserves
/// whole pages), as [`memblock_reserved`] reads them.
fn initramfs_pages((addr, size): (u64, u64)) -> (u64, u64, u64) {
    let end = (addr + size).next_multiple_of(4096);
    (addr, end - 1, end - addr)
}

/// One boot checks all of it, through the 64-bit Linux boot protocol (the zero page): a map
/// too big for the zero page, 256 MiB in 256 slots of 1 MiB, 128 MiB contiguous (128 slots,
/// one range: the map follows regions, not slots), then 128 slots each followed by a hole (the
/// first touches the contiguous part): 130 ranges, 2 past the zero page's 128, in a
/// `SETUP_E820_EXT` setup_data (no more: the kernel prints every range about five times here, and
/// each line is emulated work); and an initramfs, which the kernel must find where the zero
/// page says. Linux prints the zero page's 128 ranges as `BIOS-e820`, then the whole map as
/// `extended` and, once it reserved our setup_data, as `reserve setup_data` with the
/// setup_data's range split off; all three must match, and so must its command line.
///
/// The kernel says where it found the initramfs in two places: `RAMDISK: [mem …]` after it
/// mapped all RAM (`init_mem_mapping`), and, with `memblock=debug`, in the dump of what it
/// reserved before that (`early_reserve_initrd` reserves the zero page's `ramdisk_image` and
/// `ramdisk_size` in whole pages). The boot stops at the dump's line: mapping RAM in 129
/// ranges cut by holes takes the kernel minutes of emulated ring 0 here, silent, far past the
/// Linux tests' patience (`x86/PAT` is its last line before), because for every range it maps,
/// `kernel_physical_mapping_init` walks every page-table entry after the range in each level
/// (up to 512 PUDs, PMDs and PTEs) and looks each up in the whole e820 table
/// (`e820__mapped_any`, twice): ranges × entries × e820 ranges. That, not the initramfs, is
/// what stalled a boot of this layout run on to `RAMDISK` (docs/BOOT.md).
#[test]
fn boot_debian_kernel_with_holes_setup_e820_ext_and_an_initramfs_through_the_64_bit_entry() {
    let test = "tinyvmm::boot_debian_kernel_with_holes_setup_e820_ext_and_an_initramfs_through_the_64_bit_entry";
    if !ready(test) {
        return;
    }
    let Some((_, vmlinux)) = debian_kernel(test) else {
        return;
    };
    let dir = std::env::temp_dir().join(format!("tinyvmm-boot-64-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let initramfs = dir.join("initramfs.cpio");
    std::fs::write(
        &initramfs,
        cpio(&[("init", 0o100755, b"#!/bin/sh\necho hello\n", (0, 0))]),
    )
    .unwrap();
    let config = BootConfig {
        kernel: vmlinux,
        initramfs: Some(initramfs),
        cmdline: format!("{CMDLINE} memblock=debug"),
        mem_mib: 256,
        mem_slots: 256,
        mem_holes: true,
        protocol: BootProtocol::Linux,
        ..BootConfig::default()
    };
    // Until the kernel lists the initramfs's pages among what it reserved, or ends that list
    // without them (the check below then says what it reserved).
    let (report, log) = run(&config, |report| {
        let (start, last, size) = initramfs_pages(report.initramfs?);
        let pages = format!("[{start:#018x}-{last:#018x}], {size:#018x} bytes");
        let mut in_list = false;
        Some(Box::new(move |line: &str| {
            let listed = line.contains(" reserved.cnt") || line.contains(" reserved[");
            let ended = in_list && !listed;
            in_list |= listed;
            ended || (listed && line.contains(&pages))
        }))
    });
    std::fs::remove_dir_all(&dir).ok();
    check_ending(&report, &log);
    assert_eq!(report.format, KernelFormat::Elf);
    assert_eq!(report.slots as u64, config.mem_slots, "KVM slots of RAM");
    check_command_line(&report, &log);

    // The map: 130 ranges, the first 128 in the zero page (the 64-bit entry's: PVH has none).
    assert_eq!(report.e820.len(), 130);
    assert_eq!(report.zero_page_entries, 128);
    // The 128 MiB of the boot area (128 slots) and the first slot after it are one range.
    let slot = (256u64 << 20) / 256;
    assert_eq!(
        report.e820[2],
        E820Entry {
            addr: 1 << 20,
            size: (128 << 20) + slot - (1 << 20),
            kind: E820Kind::Usable,
        }
    );
    assert_eq!(
        lines_in_log(&log, "BIOS-e820"),
        kernel_lines(&report.e820[..128], "BIOS-e820"),
        "the kernel's BIOS-e820 map\n{log}"
    );
    assert_eq!(
        lines_in_log(&log, "extended"),
        kernel_lines(&report.e820, "extended"),
        "the kernel's map with SETUP_E820_EXT\n{log}"
    );
    let setup_data = report
        .setup_data
        .expect("the map past 128 ranges is in setup_data");
    assert_eq!(
        lines_in_log(&log, "reserve setup_data"),
        kernel_lines(
            &split_at_setup_data(&report.e820, setup_data),
            "reserve setup_data"
        ),
        "the kernel's map after reserving our setup_data\n{log}"
    );

    // The initramfs: in RAM the map gives, and found by the kernel where the zero page says.
    let (addr, size) = report.initramfs.expect("an initramfs was loaded");
    assert!(
        report
            .e820
            .iter()
            .any(|e| e.kind == E820Kind::Usable && e.addr <= addr && addr + size <= e.end()),
        "the initramfs at {addr:#x} is in no usable range"
    );
    assert!(
        memblock_reserved(&log).contains(&initramfs_pages((addr, size))),
        "the kernel did not reserve the initramfs's pages at {addr:#x} ({size} bytes)\n{log}"
    );
    eprintln!(
        "kernel's e820 ({} ranges), command line and initramfs match the VMM's",
        report.e820.len()
    );
}

/// The memblock dump is read as Debian's 6.1 kernel prints it; other lines are passed over.
#[test]
fn the_kernels_memblock_dump_is_read() {
    let log = "[   16.049413]  reserved.cnt  = 0x6\r\n\
        [   16.058598]  reserved[0x0]\t[0x0000000000000000-0x000000000000ffff], 0x0000000000010000 bytes flags: 0x0\r\n\
        [   16.060000]  memory[0x2]\t[0x0000000000100000-0x000000000807ffff], 0x0000000007f80000 bytes flags: 0x0\r\n\
        [   16.225760]  reserved[0x5]\t[0x0000000017f7f000-0x0000000017f7ffff], 0x0000000000001000 bytes flags: 0x0\r\n\
        [   16.346839] memblock_reserve: [0x0000000000093000-0x0000000000099fff] memblock_alloc_range_nid+0xb0/0x13d\r\n";
    assert_eq!(
        memblock_reserved(log),
        [(0, 0xffff, 0x10000), (0x17f7f000, 0x17f7ffff, 0x1000)]
    );
    // An initramfs of 264 bytes takes its page; one of a page and a byte, two.
    assert_eq!(
        initramfs_pages((0x17f7f000, 264)),
        (0x17f7f000, 0x17f7ffff, 0x1000)
    );
    assert_eq!(
        initramfs_pages((0x17f7e000, 4097)),
        (0x17f7e000, 0x17f7ffff, 0x2000)
    );
}

#[test]
fn cpio_archives_are_newc() {
    let archive = cpio(&[("init", 0o100755, b"#!/bin/sh\n", (0, 0))]);
    assert!(archive.starts_with(b"070701"));
    assert_eq!(archive.len() % 4, 0);
    let text = String::from_utf8_lossy(&archive);
    assert!(text.contains("init\0"));
    assert!(text.contains("TRAILER!!!"));
    // The first header: magic, inode 1, mode 0o100755, ..., size 10, ..., name size 5.
    assert_eq!(&archive[..22], b"07070100000001000081ed");
    assert_eq!(&archive[54..62], b"0000000a");
    assert_eq!(&archive[94..102], b"00000005");
}

#[test]
fn boot_bzimage_to_a_busybox_shell_with_hardware_virtualisation() {
    let test = "tinyvmm::boot_bzimage_to_a_busybox_shell_with_hardware_virtualisation";
    // Checked before require_kvm, so that a skipped test is not counted as one that ran.
    if !hardware_virtualisation() {
        eprintln!(
            "SKIPPED {test}: /proc/cpuinfo has neither vmx nor svm: this host's KVM (kvm_pvm) \
             emulates guest ring 0, and a stock kernel stops on an instruction its emulator lacks \
             long before userspace (see docs/BOOT.md)"
        );
        return;
    }
    let Some((vmlinuz, _)) = debian_kernel(test) else {
        return;
    };
    if !kvm_test_support::require_kvm(test) {
        return;
    }
    let busybox = cache().join("busybox");
    let Ok(busybox_bytes) = std::fs::read(&busybox) else {
        eprintln!(
            "SKIPPED {test}: {} is missing (resources/fetch-kernel.sh fetches busybox-static)",
            busybox.display()
        );
        return;
    };
    let init = b"#!/bin/busybox sh\n\
        /bin/busybox mkdir -p /proc /sys\n\
        /bin/busybox mount -t proc proc /proc\n\
        /bin/busybox sh -c 'echo \"busybox shell: 6*7=$((6*7))\"'\n\
        /bin/busybox reboot -f\n";
    let archive = cpio(&[
        ("bin", 0o040755, b"", (0, 0)),
        ("bin/busybox", 0o100755, &busybox_bytes, (0, 0)),
        ("dev", 0o040755, b"", (0, 0)),
        ("dev/console", 0o020600, b"", (5, 1)),
        ("init", 0o100755, init, (0, 0)),
    ]);
    let dir = std::env::temp_dir().join(format!("tinyvmm-boot-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let initramfs = dir.join("initramfs.cpio");
    std::fs::write(&initramfs, archive).unwrap();
    let config = BootConfig {
        kernel: vmlinuz,
        initramfs: Some(initramfs),
        cmdline: "console=ttyS0 reboot=k panic=-1 rdinit=/init".to_owned(),
        timeout_secs: Some(HW_TIMEOUT_SECS),
        ..BootConfig::default()
    };
    let (report, log) = run(&config, |_| None);
    std::fs::remove_dir_all(&dir).ok();
    assert!(
        log.contains("busybox shell: 6*7=42"),
        "no shell output\n{log}"
    );
    assert!(
        matches!(report.ending, BootEnding::Reset),
        "the guest's reboot should end the VM through the i8042: {}\n{log}",
        report.ending
    );
}

/// Boots `config` on a thread of its own, its console captured (raise the capture's `stop` to
/// stop the VM); the thread gives the boot's report.
fn boot_in_background(config: BootConfig) -> (Capture, std::thread::JoinHandle<BootReport>) {
    let capture = Capture::new();
    let console = Console {
        output: Box::new(capture.clone()),
        stdin: false,
        stop: Some(Arc::clone(&capture.stop)),
    };
    let vm = std::thread::spawn(move || boot(&config, console, |_| {}).expect("the boot"));
    (capture, vm)
}

/// One API request to the VMM at `socket`, and its answer.
fn api_call(
    socket: &std::path::Path,
    method: &str,
    path: &str,
    body: Option<Value>,
) -> (u16, Value) {
    Client::connect(socket)
        .expect("the API socket")
        .call(method, path, body.as_ref())
        .expect("an answer")
}

/// Polls `check` on the console log every 100 ms for up to `secs` seconds.
fn wait_for<T>(
    capture: &Capture,
    secs: u64,
    mut check: impl FnMut(&str) -> Option<T>,
) -> Option<T> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(secs);
    loop {
        if let Some(found) = check(&capture.text()) {
            return Some(found);
        }
        if std::time::Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

/// What the virtio-mem boots need: hardware virtualisation (`without` says what covers the
/// test where there is none), Debian's kernel, KVM and busybox. The kernel and busybox, or
/// `None` where `test` skips (loudly).
fn plug_prerequisites(test: &str, without: &str) -> Option<(std::path::PathBuf, Vec<u8>)> {
    if !hardware_virtualisation() {
        eprintln!(
            "SKIPPED {test}: /proc/cpuinfo has neither vmx nor svm: this host's KVM (kvm_pvm) \
             emulates guest ring 0, and a stock kernel stops long before it could load \
             virtio_mem (see docs/BOOT.md); {without}"
        );
        return None;
    }
    let (vmlinuz, _) = debian_kernel(test)?;
    if !kvm_test_support::require_kvm(test) {
        return None;
    }
    let Ok(busybox) = std::fs::read(cache().join("busybox")) else {
        eprintln!("SKIPPED {test}: busybox is missing (resources/fetch-kernel.sh fetches it)");
        return None;
    };
    Some((vmlinuz, busybox))
}

/// A Linux guest with a virtio-mem device, booted in the background with its API socket in
/// the scratch folder `dir`, whose init script lists the driver's devices and loads its
/// modules.
struct PlugGuest {
    capture: Capture,
    vm: std::thread::JoinHandle<BootReport>,
    socket: std::path::PathBuf,
    dir: std::path::PathBuf,
}

impl PlugGuest {
    /// Boots `config` (its API socket in `dir`) and waits for the virtio-mem driver to bind:
    /// the guest's MemTotal then.
    fn boot(config: BootConfig, dir: &std::path::Path) -> (PlugGuest, String, u64) {
        let socket = config.api_sock.clone().expect("an API socket");
        let (capture, vm) = boot_in_background(config);
        let guest = PlugGuest {
            capture,
            vm,
            socket,
            dir: dir.to_owned(),
        };
        // The driver found the device in the DSDT and bound to it.
        let bound = wait_for(&guest.capture, 120, |log| {
            log.lines()
                .find_map(|l| l.strip_prefix("virtio devices: "))
                .map(str::to_owned)
        });
        let log = guest.capture.text();
        let Some(bound) = bound else {
            guest.finish();
            panic!("the init script never listed the virtio-mem driver's devices\n{log}");
        };
        assert!(bound.contains("virtio0"), "virtio_mem bound nothing\n{log}");
        assert!(!log.contains("insmod"), "a module did not load\n{log}");
        let base = wait_for(&guest.capture, 30, last_mem_total).expect("a MemTotal line");
        (guest, log, base)
    }

    /// One API request to the VMM, and its answer.
    fn call(&self, method: &str, path: &str, body: Option<Value>) -> (u16, Value) {
        api_call(&self.socket, method, path, body)
    }

    /// The device's state, as the API gives it.
    fn hotplug(&self) -> Value {
        self.call("GET", "/hotplug/memory", None).1
    }

    /// Asks for `mib` MiB plugged and waits (at most `secs` s) for the device to get there.
    fn request(&self, mib: u64, secs: u64) {
        let (status, answer) = self.call(
            "PATCH",
            "/hotplug/memory",
            Some(serde_json::json!({"requested_size_mib": mib})),
        );
        assert_eq!(status, 204, "{answer}");
        let there = wait_for(&self.capture, secs, |_| {
            (self.hotplug()["plugged_size_mib"] == serde_json::json!(mib)).then_some(())
        });
        assert!(
            there.is_some(),
            "{}\n{}",
            self.hotplug(),
            self.capture.text()
        );
    }

    /// Waits (at most 30 s) for the guest's MemTotal to be `mib` MiB above `base` kB.
    fn wait_mem_total(&self, base: u64, mib: u64) {
        let total = wait_for(&self.capture, 30, |log| {
            last_mem_total(log).filter(|&kib| kib.abs_diff(base + mib * 1024) <= 8 * 1024)
        });
        assert!(
            total.is_some(),
            "MemTotal is not {base} kB + {mib} MiB\n{}",
            self.capture.text()
        );
    }

    /// Stops the VM and removes the scratch folder: the boot's report.
    fn finish(self) -> BootReport {
        self.capture.stop.store(true, Ordering::Release);
        let report = self.vm.join().expect("the boot thread");
        std::fs::remove_dir_all(&self.dir).ok();
        report
    }

    /// [`finish`](Self::finish), checking that the VM ended by being stopped.
    fn finish_stopped(self) {
        let capture = self.capture.clone();
        let report = self.finish();
        assert!(
            matches!(report.ending, BootEnding::Stopped),
            "{}\n{}",
            report.ending,
            capture.text()
        );
    }
}

#[test]
fn linux_plugs_and_unplugs_virtio_mem_through_the_api_with_hardware_virtualisation() {
    linux_plugs_and_unplugs(
        "tinyvmm::linux_plugs_and_unplugs_virtio_mem_through_the_api_with_hardware_virtualisation",
        0,
    );
}

/// As above with the default shared slots (128 MiB pieces, Linux's memory block): the guest's
/// plugs share slots, at least one per plugged piece and never more than a slot per block.
#[test]
fn linux_plugs_into_shared_slots_with_hardware_virtualisation() {
    linux_plugs_and_unplugs(
        "tinyvmm::linux_plugs_into_shared_slots_with_hardware_virtualisation",
        128,
    );
}

/// Boots Debian's kernel with a 512 MiB virtio-mem area of 2 MiB blocks in slots of at most
/// `max_slot_mib` (0: a slot per block), plugs 256 MiB through the API and unplugs it all,
/// checking the guest's MemTotal and the KVM slots at each step.
fn linux_plugs_and_unplugs(test: &str, max_slot_mib: u64) {
    use serde_json::json;

    let Some((vmlinuz, busybox)) = plug_prerequisites(
        test,
        "the ACPI tables it would find are checked by the uninterrupted boot of \
         linux_snapshot.rs",
    ) else {
        return;
    };
    // Debian builds virtio, virtio_mmio and virtio_mem as modules: the initramfs loads them.
    let init = b"#!/bin/busybox sh\n\
        B=/bin/busybox\n\
        $B mkdir -p /proc /sys\n\
        $B mount -t proc proc /proc\n\
        $B mount -t sysfs sysfs /sys\n\
        for m in virtio_ring virtio virtio_mmio virtio_mem; do\n\
        \x20   $B insmod /lib/$m.ko || echo \"insmod $m failed\"\n\
        done\n\
        echo \"virtio devices: $($B ls /sys/bus/virtio/drivers/virtio_mem)\"\n\
        while true; do\n\
        \x20   echo \"guest MemTotal: $($B awk '/MemTotal/ {print $2}' /proc/meminfo) kB\"\n\
        \x20   $B sleep 1\n\
        done\n";
    let dir = std::env::temp_dir().join(format!(
        "tinyvmm-virtio-mem-boot-{}-{max_slot_mib}",
        std::process::id()
    ));
    std::fs::create_dir_all(&dir).expect("a folder");
    let initramfs = dir.join("initramfs.cpio");
    std::fs::write(&initramfs, virtio_initramfs(&vmlinuz, &busybox, init)).expect("written");
    let config = BootConfig {
        kernel: vmlinuz,
        initramfs: Some(initramfs),
        cmdline: "console=ttyS0 reboot=k panic=-1 rdinit=/init".to_owned(),
        mem_mib: 512,
        // 256 slots at most: fits even a host with KVM's old 509 user slots.
        hotplug_mib: 512,
        hotplug_block_mib: 2,
        hotplug_max_slot_mib: max_slot_mib,
        api_sock: Some(dir.join("api.sock")),
        timeout_secs: Some(300.0),
        ..BootConfig::default()
    };

    let (guest, _, base) = PlugGuest::boot(config, &dir);
    let slots_used = || guest.call("GET", "/memory", None).1["slots"]["used"].clone();
    assert_eq!(slots_used(), json!(1), "RAM's one slot, nothing plugged");

    // Asks for `mib` MiB and waits (at most `secs` s) for the guest to get there: beside RAM's
    // slot, one KVM slot per plugged 2 MiB block, or with shared slots one per run of plugged
    // blocks in each piece (at least one per piece plugged); and the guest's MemTotal as much
    // above `base`.
    let resize = |mib: u64, secs: u64| {
        guest.request(mib, secs);
        let used = slots_used().as_u64().expect("slots used");
        let plugged = guest.hotplug()["mapped_slots"]
            .as_u64()
            .expect("the device's slots");
        assert_eq!(used, 1 + plugged, "RAM's slot and the device's");
        if max_slot_mib == 0 {
            assert_eq!(plugged, mib / 2, "a slot per block");
        } else {
            assert!(
                (mib.div_ceil(max_slot_mib)..=mib / 2).contains(&plugged),
                "{plugged} slots for {mib} MiB in pieces of {max_slot_mib} MiB"
            );
        }
        guest.wait_mem_total(base, mib);
    };
    // Plug 256 MiB: the guest plugs 128 blocks and onlines the memory.
    resize(256, 60);
    // Unplug it all: the slots go, MemTotal shrinks back. Linux retries an unplug that found
    // its memory busy after 50 s: allow for one retry.
    resize(0, 180);

    guest.finish_stopped();
}

/// The guest's AVX copy loop, a static x86-64 Linux program of its own (no libc): it maps 64
/// MiB of anonymous memory and, 16 times, fills the first half with a pattern (the u64 at
/// offset `o` holds `o ^ pass`), copies it to the second half with 32-byte `vmovdqu` loads and
/// stores, and checks every copied u64 against the pattern with plain loads and every 32 bytes
/// against the source with `vmovdqu`, `vxorps` and `vptest` (AVX, no AVX2). Exits 0, or 1 with
/// a line on stderr at the first difference; an instruction the guest cannot run would be
/// `SIGILL`.
const AVX_LOOP: &str = "\
.intel_syntax noprefix
.set SIZE, 32 << 20
.set PASSES, 16
    mov eax, 9                          # mmap(0, 2 * SIZE, RW, PRIVATE | ANONYMOUS, -1, 0)
    xor edi, edi
    mov esi, 2 * SIZE
    mov edx, 3
    mov r10d, 0x22
    mov r8, -1
    xor r9d, r9d
    syscall
    cmp rax, -4096
    ja fail
    mov rbx, rax                        # rbx: the source
    lea rbp, [rax + SIZE]               # rbp: the copy
    mov r12d, PASSES                    # r12: passes left, the pattern's seed
pass:
    xor ecx, ecx
fill:
    mov rax, rcx
    xor rax, r12
    mov [rbx + rcx], rax
    add rcx, 8
    cmp rcx, SIZE
    jb fill
    xor ecx, ecx
copy:
    vmovdqu ymm0, [rbx + rcx]
    vmovdqu [rbp + rcx], ymm0
    add rcx, 32
    cmp rcx, SIZE
    jb copy
    xor ecx, ecx
check:
    vmovdqu ymm1, [rbp + rcx]
    vxorps ymm1, ymm1, [rbx + rcx]
    vptest ymm1, ymm1
    jnz fail
    xor edx, edx
word:
    lea rsi, [rcx + rdx]
    mov rax, [rbp + rsi]
    xor rax, rsi
    cmp rax, r12
    jne fail
    add edx, 8
    cmp edx, 32
    jb word
    add rcx, 32
    cmp rcx, SIZE
    jb check
    dec r12
    jnz pass
    mov eax, 60                         # exit(0)
    xor edi, edi
    syscall
fail:
    mov eax, 1                          # write(2, message), exit(1)
    mov edi, 2
    lea rsi, [rip + message]
    mov edx, message_end - message
    syscall
    mov eax, 60
    mov edi, 1
    syscall
message:
    .ascii \"avxloop: a copy does not match\\n\"
message_end:
";

/// `source` (position-independent x86-64 code, entered at its first byte) as a static Linux
/// executable: assembled with GNU as and cut out with objcopy, as the build assembles the test
/// guest (so any host that built tinyvmm has both), behind an ELF header with one loadable
/// segment.
fn static_executable(source: &str, dir: &std::path::Path) -> Vec<u8> {
    const BASE: u64 = 0x40_0000;
    const HEADERS: u64 = 64 + 56;
    let (asm, object, code) = (dir.join("avx.S"), dir.join("avx.o"), dir.join("avx.bin"));
    std::fs::write(&asm, source).expect("the program's source");
    for (program, args) in [
        ("as", vec!["--64", "-o", path_str(&object), path_str(&asm)]),
        (
            "objcopy",
            vec![
                "-O",
                "binary",
                "-j",
                ".text",
                path_str(&object),
                path_str(&code),
            ],
        ),
    ] {
        let status = std::process::Command::new(program)
            .args(&args)
            .status()
            .unwrap_or_else(|e| panic!("{program} (binutils, which the build needs): {e}"));
        assert!(status.success(), "{program} {args:?}: {status}");
    }
    let code = std::fs::read(&code).expect("the program's code");
    let size = HEADERS + code.len() as u64;
    let mut elf = Vec::with_capacity(size as usize);
    // e_ident: ELF, 64-bit, little-endian, version 1, System V.
    elf.extend_from_slice(&[0x7f, b'E', b'L', b'F', 2, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
    // e_type EXEC, e_machine x86-64, e_version, e_entry, e_phoff, e_shoff, e_flags, e_ehsize,
    // e_phentsize, e_phnum 1, no sections.
    elf.extend_from_slice(&2u16.to_le_bytes());
    elf.extend_from_slice(&0x3eu16.to_le_bytes());
    elf.extend_from_slice(&1u32.to_le_bytes());
    elf.extend_from_slice(&(BASE + HEADERS).to_le_bytes());
    elf.extend_from_slice(&64u64.to_le_bytes());
    elf.extend_from_slice(&0u64.to_le_bytes());
    elf.extend_from_slice(&0u32.to_le_bytes());
    for half in [64u16, 56, 1, 0, 0, 0] {
        elf.extend_from_slice(&half.to_le_bytes());
    }
    // The program header: PT_LOAD, read and execute, the whole file at BASE.
    elf.extend_from_slice(&1u32.to_le_bytes());
    elf.extend_from_slice(&5u32.to_le_bytes());
    for word in [0, BASE, BASE, size, size, 0x1000] {
        elf.extend_from_slice(&word.to_le_bytes());
    }
    assert_eq!(elf.len() as u64, HEADERS);
    elf.extend_from_slice(&code);
    elf
}

fn path_str(path: &std::path::Path) -> &str {
    path.to_str().expect("a UTF-8 path")
}

/// The guest's AVX program, built as the Linux test builds it, runs on the host (same ABI) and
/// finds its copies right: what the gated test runs in the guest works, on any host with AVX.
#[test]
fn the_avx_copy_program_runs_and_checks_its_copies_on_the_host() {
    let test = "tinyvmm::the_avx_copy_program_runs_and_checks_its_copies_on_the_host";
    if !std::arch::is_x86_feature_detected!("avx") {
        eprintln!("SKIPPED {test}: this host's CPU has no AVX");
        return;
    }
    let dir = std::env::temp_dir().join(format!("tinyvmm-avx-loop-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a folder");
    let program = dir.join("avxloop");
    std::fs::write(&program, static_executable(AVX_LOOP, &dir)).expect("written");
    std::fs::set_permissions(
        &program,
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .expect("executable");
    let ran = std::process::Command::new(&program)
        .output()
        .expect("the program runs");
    std::fs::remove_dir_all(&dir).ok();
    assert!(
        ran.status.success() && ran.stderr.is_empty(),
        "{}: {}",
        ran.status,
        String::from_utf8_lossy(&ran.stderr)
    );
}

/// N of the last whole `<prefix>N` line of `log` (lines that two guest processes' output
/// broke are passed over).
fn last_count(log: &str, prefix: &str) -> Option<u64> {
    log.lines()
        .rev()
        .find_map(|l| l.strip_prefix(prefix)?.trim_end().parse().ok())
}

/// Boots Debian's kernel on two vCPUs with a 512 MiB virtio-mem area (2 MiB blocks, the
/// default shared slots, onlined movable as the VMM's command line asks) and plugs 256 MiB; the guest then copies with AVX
/// (a program of its own, [`AVX_LOOP`], copied afresh to a tmpfs and run from there each
/// round) and copies a tmpfs file with busybox run from a copy in the tmpfs, checking each copy,
/// while the host unplugs to 128 MiB, plugs to 384 MiB and unplugs it all through the API. The
/// loops' memory and code are in plugged memory (movable allocations go to the movable zone
/// first), so every plug and unplug changes memory in use under VEX loads and stores and
/// instruction fetches (issue 36): no copy may differ, no program die (`SIGILL` would be a
/// `#UD` from an instruction KVM could not emulate), the VM not stop, and both loops go on.
#[test]
fn linux_runs_avx_copies_and_code_in_memory_plugged_and_unplugged_under_it_with_hardware_virtualisation(
) {
    let test = "tinyvmm::linux_runs_avx_copies_and_code_in_memory_plugged_and_unplugged_under_it_with_hardware_virtualisation";
    let Some((vmlinuz, busybox)) = plug_prerequisites(
        test,
        "vmm/tests/window.rs runs VEX accesses and code through slot changes under the test \
         guest here",
    ) else {
        return;
    };
    if !tinyvmm::test_guest::layout::avx_available() {
        eprintln!(
            "SKIPPED {test}: this host's KVM offers no AVX, so the guest has no VEX \
             instructions to copy with"
        );
        return;
    }
    let dir = std::env::temp_dir().join(format!("tinyvmm-avx-plug-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a folder");
    let avx_loop = static_executable(AVX_LOOP, &dir);
    // The loops start once the first plug is online (MemTotal 200 MiB above what it was), so
    // that their memory, the tmpfs and the programs in it are in plugged memory.
    let init = b"#!/bin/busybox sh\n\
        B=/bin/busybox\n\
        $B mkdir -p /proc /sys /mnt\n\
        $B mount -t proc proc /proc\n\
        $B mount -t sysfs sysfs /sys\n\
        $B mount -t devtmpfs devtmpfs /dev\n\
        for m in virtio_ring virtio virtio_mmio virtio_mem; do\n\
        \x20   $B insmod /lib/$m.ko || echo \"insmod $m failed\"\n\
        done\n\
        echo \"virtio devices: $($B ls /sys/bus/virtio/drivers/virtio_mem)\"\n\
        $B grep -q ' avx ' /proc/cpuinfo && echo 'guest has AVX'\n\
        total() { $B awk '/MemTotal/ {print $2}' /proc/meminfo; }\n\
        base=$(total)\n\
        echo \"guest MemTotal: $base kB\"\n\
        while [ $(total) -lt $((base + 200 * 1024)) ]; do $B sleep 1; done\n\
        $B mount -t tmpfs -o size=200m tmpfs /mnt\n\
        $B cp /bin/busybox /mnt/busybox\n\
        $B dd if=/dev/urandom of=/mnt/data bs=1M count=32 2>/dev/null\n\
        sum=$(/mnt/busybox md5sum < /mnt/data)\n\
        echo \"movable zone: $($B awk '/zone +Movable/ {m=1} m && /managed/ {print $2; exit}' /proc/zoneinfo) pages\"\n\
        (\n\
        \x20   n=0\n\
        \x20   while true; do\n\
        \x20       $B rm -f /mnt/avxloop\n\
        \x20       $B cp /bin/avxloop /mnt/avxloop\n\
        \x20       if /mnt/avxloop; then n=$((n + 1)); echo \"avx rounds: $n\"; else echo \"avx round FAILED: $?\"; fi\n\
        \x20   done\n\
        ) &\n\
        (\n\
        \x20   n=0\n\
        \x20   while true; do\n\
        \x20       /mnt/busybox rm -f /mnt/copy\n\
        \x20       /mnt/busybox cp /mnt/data /mnt/copy\n\
        \x20       if [ \"$(/mnt/busybox md5sum < /mnt/copy)\" = \"$sum\" ]; then\n\
        \x20           n=$((n + 1)); echo \"copy rounds: $n\"\n\
        \x20       else\n\
        \x20           echo \"copy round FAILED\"\n\
        \x20       fi\n\
        \x20   done\n\
        ) &\n\
        while true; do\n\
        \x20   echo \"guest MemTotal: $(total) kB\"\n\
        \x20   $B sleep 1\n\
        done\n";
    let initramfs = dir.join("initramfs.cpio");
    let mut archive = virtio_initramfs(&vmlinuz, &busybox, init);
    // The AVX program goes in beside busybox: the archive's trailer is cut off and written
    // again after it (cpio pads every record to 4 bytes; the trailer is the last record).
    let trailer = cpio(&[]);
    assert!(
        archive.ends_with(&trailer),
        "a cpio archive ends with its trailer"
    );
    archive.truncate(archive.len() - trailer.len());
    let extra = cpio(&[("bin/avxloop", 0o100755, &avx_loop, (0, 0))]);
    archive.extend_from_slice(&extra);
    std::fs::write(&initramfs, archive).expect("written");
    let config = BootConfig {
        kernel: vmlinuz,
        initramfs: Some(initramfs),
        // The VMM adds `memhp_default_state=online_movable` for the virtio-mem device.
        cmdline: "console=ttyS0 reboot=k panic=-1 rdinit=/init".to_owned(),
        vcpus: 2,
        mem_mib: 512,
        hotplug_mib: 512,
        hotplug_block_mib: 2,
        api_sock: Some(dir.join("api.sock")),
        // Only a guard: longer than all the waits below together.
        timeout_secs: Some(1800.0),
        ..BootConfig::default()
    };

    let (guest, log, base) = PlugGuest::boot(config, &dir);
    let capture = &guest.capture;
    assert!(
        log.contains("guest has AVX"),
        "the host's KVM offers AVX, the guest's /proc/cpuinfo does not list it\n{log}"
    );
    // Nothing in the guest failed so far: no copy differed, no program died.
    let no_failure = |capture: &Capture| {
        let log = capture.text();
        for bad in [
            "round FAILED",
            "does not match",
            "traps:",
            "invalid opcode",
            "segfault",
            "Oops",
        ] {
            assert!(!log.contains(bad), "the guest printed {bad:?}\n{log}");
        }
    };

    // Asks for `mib` MiB and waits (at most `secs` s) for the device and the guest's MemTotal
    // to get there.
    let resize = |mib: u64, secs: u64| {
        guest.request(mib, secs);
        guest.wait_mem_total(base, mib);
        no_failure(capture);
    };
    // Both loops have done `after` rounds more than `counts` (at most `secs` s).
    let rounds = |log: &str| {
        Some((
            last_count(log, "avx rounds: ")?,
            last_count(log, "copy rounds: ")?,
        ))
    };
    let go_on = |counts: (u64, u64), after: u64, secs: u64| {
        let reached = wait_for(capture, secs, |log| {
            rounds(log).filter(|&(avx, copy)| avx >= counts.0 + after && copy >= counts.1 + after)
        });
        reached.unwrap_or_else(|| {
            panic!(
                "the guest's loops stopped at {:?} (from {counts:?})\n{}",
                rounds(&capture.text()),
                capture.text()
            )
        })
    };

    // Plug 256 MiB: the loops start in it.
    resize(256, 60);
    let started = go_on((0, 0), 1, 120);
    let log = capture.text();
    let movable = log
        .lines()
        .find_map(|l| l.strip_prefix("movable zone: "))
        .and_then(|rest| rest.strip_suffix(" pages"))
        .and_then(|n| n.trim().parse::<u64>().ok());
    assert!(
        movable.is_some_and(|pages| pages > 0),
        "the plugged memory is not in the movable zone: {movable:?}\n{log}"
    );
    // Unplug half (the guest migrates what it uses there), plug up to 384 MiB, unplug it all;
    // the loops run throughout. Linux retries an unplug that found its memory busy after 50 s:
    // allow for a few.
    resize(128, 180);
    resize(384, 60);
    resize(0, 300);
    let ended = go_on(started, 2, 120);
    no_failure(capture);
    eprintln!(
        "{test}: AVX rounds {} → {}, copy rounds {} → {} across the plugs",
        started.0, ended.0, started.1, ended.1
    );

    guest.finish_stopped();
}
