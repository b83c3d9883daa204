//! What the Linux-guest, snapshot and migration tests share: Debian's kernel (fetched by
//! `resources/fetch-kernel.sh`), whether a test can run, whether the host has hardware
//! virtualisation, merging a snapshot chain, requests to a VMM's API socket, and a `tinyvmm`
//! process to run ([`vmm::Vmm`]).

#![allow(dead_code)] // Each test file uses its part.

pub mod scratch;
pub mod vmm;

use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// The command line: the serial console from the first line, no xsave (issue 6: XRSTOR is not
/// in the emulator), no KASLR (reproducible addresses), reset through the i8042 on panic.
pub const CMDLINE: &str = "console=ttyS0 earlyprintk=ttyS0 noxsave nokaslr panic=-1 reboot=k";

/// The longest stretch of Debian's 6.1 kernel without a console line on this project's hosts
/// (from `rcu: Adjusting geometry` to `NR_IRQS:`), in instructions of the ring-0 speed probe
/// ([`kvm_test_support::ring0_speed`]): 9.3 s on a host whose probe ran 3.9-5.3 M/s, rounded up.
const LONGEST_SILENCE: f64 = 50e6;

/// How long a Linux test waits for the guest's next sign of progress (a console line, an exit)
/// before it calls the guest stuck: four times the kernel's longest silence at this host's
/// measured ring-0 speed, at least a minute. A boot that makes progress is never cut, however
/// slow the host's emulator; measured once per test binary, and printed.
/// `TINYVMM_LINUX_PATIENCE_SECS` overrides it (to see the watchdog act, or for a host known to
/// be slower still).
pub fn linux_patience() -> Duration {
    static PATIENCE: OnceLock<Duration> = OnceLock::new();
    *PATIENCE.get_or_init(|| {
        if let Some(secs) = std::env::var("TINYVMM_LINUX_PATIENCE_SECS")
            .ok()
            .and_then(|s| s.parse::<f64>().ok())
        {
            return Duration::from_secs_f64(secs);
        }
        let speed = kvm_test_support::ring0_speed();
        let patience = kvm_test_support::patience_for(LONGEST_SILENCE, speed);
        eprintln!(
            "guest ring-0 speed here: {}; a Linux guest silent for {:.0} s is called stuck",
            speed.map_or("not measured".to_owned(), |s| format!(
                "{:.2} M instructions/s",
                s / 1e6
            )),
            patience.as_secs_f64()
        );
        patience
    })
}

/// Watches a growing output (a guest's console) for progress: [`Progress::stalled`] says
/// whether it has not grown for [`linux_patience`].
#[derive(Debug)]
pub struct Progress {
    seen: usize,
    since: Instant,
    patience: Duration,
}

impl Default for Progress {
    fn default() -> Self {
        Progress {
            seen: 0,
            since: Instant::now(),
            patience: linux_patience(),
        }
    }
}

impl Progress {
    /// Notes the output's length now; true once it has not grown for the whole patience.
    pub fn stalled(&mut self, len: usize) -> bool {
        if len != self.seen {
            self.seen = len;
            self.since = Instant::now();
        }
        self.since.elapsed() > self.patience
    }

    /// The patience, for messages.
    pub fn patience(&self) -> Duration {
        self.patience
    }
}

/// The last `n` lines of `log`, for a failure's message.
pub fn tail(log: &str, n: usize) -> String {
    let lines: Vec<&str> = log.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// Where `resources/fetch-kernel.sh` puts the kernel (and busybox).
pub fn cache() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../resources/cache/kernel")
}

/// Debian's kernel: the bzImage and the ELF vmlinux unpacked from it.
pub fn debian_kernel(test: &str) -> Option<(PathBuf, PathBuf)> {
    let listed = cache().join("vmlinuz.path");
    let Ok(path) = std::fs::read_to_string(&listed) else {
        eprintln!(
            "SKIPPED {test}: no kernel ({} is missing): resources/fetch-kernel.sh could not fetch \
             Debian's linux-image-cloud-amd64; this boot test did not run",
            listed.display()
        );
        return None;
    };
    let vmlinuz = PathBuf::from(path.trim());
    let name = vmlinuz
        .file_name()?
        .to_str()?
        .replace("vmlinuz-", "vmlinux-");
    let vmlinux = vmlinuz.with_file_name(name);
    if !vmlinuz.is_file() || !vmlinux.is_file() {
        eprintln!(
            "SKIPPED {test}: {} or {} is missing (rerun resources/fetch-kernel.sh; the vmlinux \
             needs lz4); this boot test did not run",
            vmlinuz.display(),
            vmlinux.display()
        );
        return None;
    }
    Some((vmlinuz, vmlinux))
}

/// Whether test `test` can run: the kernel is there (checked first, so that a test skipped for
/// the lack of it is not counted as a KVM test that ran) and so is `/dev/kvm`.
pub fn ready(test: &str) -> bool {
    debian_kernel(test).is_some() && kvm_test_support::require_kvm(test)
}

/// Whether the host has hardware virtualisation (VT-x or AMD-V flags in /proc/cpuinfo).
pub fn hardware_virtualisation() -> bool {
    std::fs::read_to_string("/proc/cpuinfo").is_ok_and(|info| {
        info.lines()
            .filter(|l| l.starts_with("flags"))
            .any(|l| l.split_whitespace().any(|f| f == "vmx" || f == "svm"))
    })
}

/// A file for [`cpio`]: path, mode (with its type bits), contents, and (major, minor) for a
/// device node.
pub type CpioFile<'a> = (&'a str, u32, &'a [u8], (u32, u32));

/// A newc cpio archive of `files`.
pub fn cpio(files: &[CpioFile<'_>]) -> Vec<u8> {
    let mut out = Vec::new();
    let mut entry = |(name, mode, data, (major, minor)): CpioFile<'_>, ino: usize| {
        // ino, mode, uid, gid, nlink, mtime, filesize, devmajor, devminor, rdevmajor,
        // rdevminor, namesize, check.
        let fields = [
            ino,
            mode as usize,
            0,
            0,
            1,
            0,
            data.len(),
            0,
            0,
            major as usize,
            minor as usize,
            name.len() + 1,
            0,
        ];
        out.extend_from_slice(b"070701");
        for field in fields {
            out.extend_from_slice(format!("{field:08x}").as_bytes());
        }
        out.extend_from_slice(name.as_bytes());
        out.push(0);
        while out.len() % 4 != 0 {
            out.push(0);
        }
        out.extend_from_slice(data);
        while out.len() % 4 != 0 {
            out.push(0);
        }
    };
    for (ino, file) in files.iter().enumerate() {
        entry(*file, ino + 1);
    }
    entry(("TRAILER!!!", 0, &[], (0, 0)), 0);
    out
}

/// The kernel package's directory and version, from its vmlinuz's path
/// (`<package>/boot/vmlinuz-<version>`).
pub fn kernel_package(vmlinuz: &Path) -> Option<(PathBuf, String)> {
    let version = vmlinuz
        .file_name()?
        .to_str()?
        .strip_prefix("vmlinuz-")?
        .to_owned();
    Some((vmlinuz.parent()?.parent()?.to_owned(), version))
}

/// The last `guest MemTotal: N kB` the init script printed, in KiB.
pub fn last_mem_total(log: &str) -> Option<u64> {
    log.lines()
        .rev()
        .find_map(|l| l.strip_prefix("guest MemTotal: "))
        .and_then(|rest| rest.trim_end().strip_suffix(" kB"))
        .and_then(|n| n.parse().ok())
}

/// The virtio modules Debian builds as modules, in load order.
pub const VIRTIO_MODULES: [&str; 4] = ["virtio_ring", "virtio", "virtio_mmio", "virtio_mem"];

/// An initramfs of busybox, the kernel's virtio modules (under `/lib`, see
/// [`VIRTIO_MODULES`]) and `init`, for the kernel `vmlinuz`.
pub fn virtio_initramfs(vmlinuz: &Path, busybox: &[u8], init: &[u8]) -> Vec<u8> {
    let (package, version) = kernel_package(vmlinuz).expect("the kernel package's layout");
    let modules = package.join(format!("lib/modules/{version}/kernel/drivers/virtio"));
    let module_bytes: Vec<Vec<u8>> = VIRTIO_MODULES
        .iter()
        .map(|m| {
            let path = modules.join(format!("{m}.ko"));
            std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        })
        .collect();
    let module_paths: Vec<String> = VIRTIO_MODULES
        .iter()
        .map(|m| format!("lib/{m}.ko"))
        .collect();
    let mut files: Vec<CpioFile<'_>> = vec![
        ("bin", 0o040755, b"", (0, 0)),
        ("bin/busybox", 0o100755, busybox, (0, 0)),
        ("dev", 0o040755, b"", (0, 0)),
        ("dev/console", 0o020600, b"", (5, 1)),
        ("lib", 0o040755, b"", (0, 0)),
        ("init", 0o100755, init, (0, 0)),
    ];
    for (path, bytes) in module_paths.iter().zip(&module_bytes) {
        files.push((path, 0o100644, bytes, (0, 0)));
    }
    cpio(&files)
}

/// Merges the chain `files` (state, memory, state, memory...) into `out` with `tinyvmm
/// snapshot-merge`; fails the test, with its stderr, if it does not.
pub fn merge_chain(out: &Path, files: &[&Path]) {
    let merge = std::process::Command::new(env!("CARGO_BIN_EXE_tinyvmm"))
        .arg("snapshot-merge")
        .arg("--out")
        .arg(out)
        .args(files)
        .output()
        .expect("snapshot-merge runs");
    assert!(
        merge.status.success(),
        "{}",
        String::from_utf8_lossy(&merge.stderr)
    );
}

/// One request to the API socket at `api`: its status and body.
pub fn call(
    api: &Path,
    method: &str,
    path: &str,
    body: Option<serde_json::Value>,
) -> (u16, serde_json::Value) {
    tinyvmm::api::client::Client::connect(api)
        .expect("connect")
        .call(method, path, body.as_ref())
        .expect("an answer")
}

/// A request that must succeed (2xx): its body.
pub fn ok(
    api: &Path,
    method: &str,
    path: &str,
    body: Option<serde_json::Value>,
) -> serde_json::Value {
    let (status, answer) = call(api, method, path, body);
    assert!(
        (200..300).contains(&status),
        "{method} {path}: {status} {answer}"
    );
    answer
}

/// A test-guest command over `[start, end)`, one u64 a page.
pub fn guest_command(op: &str, start: u64, end: u64, seed: u64) -> serde_json::Value {
    serde_json::json!({"op": op, "start": start, "end": end, "stride": 4096, "seed": seed})
}

/// Stops vCPU 0's write loop on the VMM at `api` and checks that `[start, end)` holds its
/// last pass; the passes and the last pass's seed.
pub fn stop_and_verify(api: &Path, start: u64, end: u64) -> (u64, u64) {
    let stop = serde_json::json!({"op": "stop_loop", "vcpu": 0});
    let stopped = ok(api, "PUT", "/guest/command", Some(stop));
    assert_eq!(stopped["result"], "stopped", "{stopped}");
    let last = stopped["last_seed"].as_u64().expect("at least one pass");
    let command = guest_command("verify", start, end, last);
    let verified = ok(api, "PUT", "/guest/command", Some(command));
    assert_eq!(verified["result"], "ok", "{verified}");
    (stopped["passes"].as_u64().expect("passes"), last)
}

/// Where `serve`'s initial memory, from `area`, ends (split over its slots, it may fall short
/// of the size asked for by less than a page per slot).
pub fn area_end(api: &Path, area: u64) -> u64 {
    let memory = ok(api, "GET", "/memory", None);
    memory["regions"]
        .as_array()
        .expect("regions")
        .iter()
        .filter_map(|r| {
            let start = r["guest_address"].as_u64()?;
            (area..4 << 30)
                .contains(&start)
                .then(|| start + r["size"].as_u64().expect("a size"))
        })
        .max()
        .expect("serve has initial memory")
}

/// Bytes of hugetlb pages the process has mapped in `[hva, hva + len)` (smaps'
/// `Private_Hugetlb` and `Shared_Hugetlb` of the mappings there): what the region holds of
/// the pool, whatever other tests take from it meanwhile.
pub fn hugetlb_bytes(hva: u64, len: u64) -> u64 {
    hugetlb_bytes_of("self", hva, len)
}

/// [`hugetlb_bytes`] of process `pid` (a number, or `self`): what a VMM process's region
/// holds of the pool.
pub fn hugetlb_bytes_of(pid: &str, hva: u64, len: u64) -> u64 {
    let path = format!("/proc/{pid}/smaps");
    let smaps = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {path}: {e}"));
    let mut inside = false;
    let mut kib = 0;
    for line in smaps.lines() {
        let first = line.split_whitespace().next().unwrap_or_default();
        if let Some((start, end)) = first.split_once('-') {
            if let (Ok(start), Ok(end)) =
                (u64::from_str_radix(start, 16), u64::from_str_radix(end, 16))
            {
                inside = start < hva + len && hva < end;
                continue;
            }
        }
        if !inside {
            continue;
        }
        for field in ["Private_Hugetlb:", "Shared_Hugetlb:"] {
            if let Some(value) = line.strip_prefix(field) {
                kib += value
                    .trim()
                    .trim_end_matches("kB")
                    .trim()
                    .parse::<u64>()
                    .expect("a size");
            }
        }
    }
    kib * 1024
}

/// Whether the host's hugetlb pool has `pages` free 2 MiB pages for the test `name`. When it
/// has not, prints a loud SKIPPED line with what the test needs (`needs`: "8", or "64: a
/// 128 MiB Linux guest") and what the pool has, and the test returns early.
pub fn require_hugetlb_pages(name: &str, pages: u64, needs: &str) -> bool {
    let available = kvm_memslots::hugetlb_pages_available();
    if available < pages {
        eprintln!(
            "SKIPPED {name}: the hugetlb pool has {available} free 2 MiB pages, the test needs \
             {needs} (resources/setup-host.sh reserves a pool): this test did not run"
        );
        return false;
    }
    true
}

/// A hugetlbfs mount of 2 MiB pages on a folder of its own: unmounted when dropped (lazily, so
/// that a VMM still mapping a file there cannot keep it: its files and their pages go with it)
/// and the folder removed.
pub struct HugetlbfsMount {
    /// Where it is mounted.
    pub dir: PathBuf,
}

impl HugetlbfsMount {
    /// Mounts one on `dir` (made if missing), or says why not (mounting needs root); a folder
    /// it made is removed again if the mount fails.
    pub fn mount(dir: PathBuf) -> Result<HugetlbfsMount, String> {
        std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let mounted = std::process::Command::new("mount")
            .args(["-t", "hugetlbfs", "-o", "pagesize=2M", "none"])
            .arg(&dir)
            .output();
        let why = match mounted {
            Ok(out) if out.status.success() => return Ok(HugetlbfsMount { dir }),
            Ok(out) => String::from_utf8_lossy(&out.stderr).trim().to_owned(),
            Err(e) => e.to_string(),
        };
        let _ = std::fs::remove_dir(&dir);
        Err(why)
    }

    /// The file `name` on it.
    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }
}

impl Drop for HugetlbfsMount {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(&self.dir)
            .status();
        let _ = std::fs::remove_dir(&self.dir);
    }
}
