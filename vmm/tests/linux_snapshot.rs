//! A Linux guest paused, snapshotted, ended, and restored or migrated in new processes goes on
//! exactly as an uninterrupted boot of it: the same console lines (timestamps aside) and the
//! same end.
//!
//! On this host (kvm_pvm, no VT-x/AMD-V) Debian's kernel stops at its `int3` self-test, the same
//! lines and the same stop every time (docs/BOOT.md): that end is what every run is held to.
//! One boot (4096 slots, 2 vCPUs, a virtio-mem device, RAM in memfds) takes a live Full of the
//! running guest well into the boot, a live Diff after it, and a paused Diff half a second of
//! guest time before the end. Beside it an uninterrupted boot gives the reference (and is
//! itself checked: its map, command line and ACPI tables as the VMM built them, and its end on
//! the `int3` named as the host's limitation). Each in a new process: the live Full restored
//! through userfaultfd and migrated live twice (bitmap rounds to one `tinyvmm receive`, then
//! with its memfds handed over to another), which runs beside the two boots; and the chain
//! merged and restored with each memory backend, and from its last state file rewritten in the
//! format before the one saved-state envelope, short runs to the end. Only the live Full's
//! continuation does much of the boot again: the whole test costs about one and a half boots
//! of emulated ring-0 work on each core.
//!
//! No run has a deadline: the guest's ring 0 runs in this host's emulator, 5-7x faster on some
//! machines than on others; a run whose guest prints nothing for [`support::linux_patience`]
//! (scaled to the measured speed) fails with its last lines.

use std::path::{Path, PathBuf};
use std::process::Output;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tinyvmm::api::client::Client;

mod support;
use support::vmm::Vmm;
use support::{debian_kernel, hardware_virtualisation, merge_chain, ready, CMDLINE};

/// Where the live Full starts: after the line the kernel prints before its longest stretch of
/// emulated work (some 10 s of guest time on a fast machine of this kind, half a minute on a
/// slow one), time enough for the live snapshots and both migrations of the live Full's
/// continuation on any machine.
const LIVE_AT: &str = "rcu: Adjusting geometry";
/// Where the Diff is taken: half a second of guest time before the end, past which the
/// kernel's own 8250 driver takes the console, the IOAPIC and x2APIC are set up.
const DIFF_AT: &str = "NR_IRQS:";

/// A scratch folder, removed at the end.
struct Scratch(PathBuf);

impl Scratch {
    fn new() -> Self {
        let dir = std::env::temp_dir().join(format!("tinyvmm-linux-snap-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("a scratch folder");
        Scratch(dir)
    }

    fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// `tinyvmm ARGS` (support's [`Vmm`]) with its console (stdout) in the file `console` and its
/// API on the socket `api`, or none; named after the console file.
fn spawn(args: &[&str], console: PathBuf, api: Option<PathBuf>) -> Vmm {
    let name = console
        .file_stem()
        .expect("a console file")
        .to_string_lossy()
        .into_owned();
    let command = Vmm::command(&name).args(args).stdout_file(console);
    match api {
        Some(api) => command.api_sock(api),
        None => command.no_api(),
    }
    .spawn()
}

/// `tinyvmm restore` of `state` and `mem` through `backend`, its console and API socket
/// named after `name` in `scratch`.
fn restore(scratch: &Scratch, name: &str, (state, mem): (&Path, &Path), backend: &str) -> Vmm {
    spawn(
        &[
            "restore",
            "--snapshot",
            state.to_str().expect("UTF-8"),
            "--mem-file",
            mem.to_str().expect("UTF-8"),
            "--mem-backend",
            backend,
        ],
        scratch.path(&format!("{name}.console")),
        Some(scratch.path(&format!("{name}.sock"))),
    )
}

/// What a Linux guest's VMM is asked here beyond the shared fixture: its console, waited on
/// while the guest makes progress.
trait Linux {
    /// The console so far.
    fn console(&self) -> String;
    /// Waits until the console shows `marker`; fails if the VMM exits first, or if the guest
    /// prints nothing for the host's patience (however long the whole wait takes).
    fn wait_for_line(&self, marker: &str);
    /// Pauses the VM; returns the console up to the pause (the pause flushes it).
    fn pause(&self) -> String;
    /// Resumes the VM.
    fn resume(&self);
    /// Waits for the process to end, while its guest makes progress (see
    /// [`Linux::wait_for_line`]): its status and stderr, and its console.
    fn run_out(&mut self) -> (Output, String);
}

impl Linux for Vmm {
    fn console(&self) -> String {
        self.stdout_now()
    }

    fn wait_for_line(&self, marker: &str) {
        self.wait_for_console(marker);
    }

    fn pause(&self) -> String {
        self.set_state("Paused");
        assert_eq!(self.ok("GET", "/vm", None)["state"], "Paused");
        self.console()
    }

    fn resume(&self) {
        self.set_state("Resumed");
    }

    fn run_out(&mut self) -> (Output, String) {
        let mut progress = support::Progress::default();
        while self.running() {
            let console = self.console();
            assert!(
                !progress.stalled(console.len()),
                "tinyvmm runs on, but its guest printed nothing for {:?}; its last lines:\n{}",
                progress.patience(),
                support::tail(&console, 20)
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        let output = self.try_exited().expect("it has exited");
        (output, self.console())
    }
}

/// Lines whose figures are timings that differ between any two boots (the TSC cycles the
/// boot took before kvmclock's sched offset was taken, the TSC frequency measured): their
/// figures are not compared, nor their lengths.
const TIMING_LINES: [&str; 2] = ["kvm-clock: using sched offset of", "tsc: Detected"];

/// When the test began, for [`phase`].
static STARTED: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();

/// Says on stderr how far into the test `what` happened: the test's output (shown when it
/// fails, or with `--nocapture`) then says where a slow run spent its time.
fn phase(what: &str) {
    let started = STARTED.get_or_init(Instant::now);
    eprintln!("[{:7.1} s] {what}", started.elapsed().as_secs_f64());
}

/// Waits up to two minutes for `done` (host-side work: a live snapshot, a migration's end, a
/// socket; a hang guard), naming `what` if it does not come.
fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(120);
    while !done() {
        assert!(Instant::now() < deadline, "no {what} within two minutes");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The console's lines without printk's timestamps, and with the digits of timing figures
/// masked.
fn lines(console: &str) -> Vec<String> {
    console
        .lines()
        .map(|line| {
            let line = line.trim_end_matches('\r');
            let line = match (line.starts_with('['), line.find("] ")) {
                (true, Some(end)) => &line[end + 2..],
                _ => line,
            };
            if TIMING_LINES.iter().any(|t| line.contains(t)) {
                // Each run of digits one `#`: the figures' lengths differ too (a boot slowed
                // past 10^10 TSC cycles before kvmclock prints one digit more).
                let mut masked = String::with_capacity(line.len());
                for c in line.chars() {
                    if !c.is_ascii_digit() {
                        masked.push(c);
                    } else if !masked.ends_with('#') {
                        masked.push('#');
                    }
                }
                masked
            } else {
                line.to_owned()
            }
        })
        .collect()
}

/// How a run ended: its exit status and the vCPU's stop as the VMM named it (the vCPU and rip).
fn ending(output: &Output) -> (Option<i32>, String) {
    let stderr = String::from_utf8_lossy(&output.stderr);
    let stop = stderr
        .lines()
        .find(|l| l.contains(" at rip "))
        .and_then(|l| l.split(" (KVM suberror").next())
        .unwrap_or("no vCPU stop")
        .trim_start_matches("tinyvmm: ")
        .to_owned();
    (output.status.code(), stop)
}

/// The arguments every boot of the test shares.
fn boot_args(kernel: &Path) -> Vec<String> {
    [
        "boot",
        "--kernel",
        kernel.to_str().expect("a UTF-8 path"),
        "--mem-mib",
        "512",
        "--slots",
        "4096",
        "--vcpus",
        "2",
        "--hotplug-mib",
        "1024",
        "--memfd",
        "--quiet",
        "--cmdline",
        CMDLINE,
    ]
    .map(String::from)
    .to_vec()
}

/// What every continuation is held to: the uninterrupted boot's console and ending.
struct Reference {
    console: String,
    ending: (Option<i32>, String),
}

impl Reference {
    /// Checks that `before` (the console up to a snapshot's point) and `after` (a restored
    /// run's) read as the reference does, and that the run ended as it did.
    fn check(&self, what: &str, before: &str, after: &str, ended: &(Option<i32>, String)) {
        let expected = lines(&self.console);
        let got = lines(&format!("{before}{after}"));
        if got != expected {
            let at = got
                .iter()
                .zip(&expected)
                .position(|(a, b)| a != b)
                .unwrap_or(got.len().min(expected.len()));
            panic!(
                "{what}: the console differs from an uninterrupted boot's at line {at}:\n  got: \
                 {:?}\n  expected: {:?}\n--- got ---\n{after}",
                got.get(at),
                expected.get(at)
            );
        }
        assert_eq!(ended, &self.ending, "{what}: the run ended otherwise");
    }

    /// Checks that `after` (a run restored from a point the test did not see: a live
    /// snapshot's) goes on as the reference does: past its first line, which may begin
    /// mid-line, its lines are the reference's last ones, and it ended as the reference did.
    fn check_continuation(&self, what: &str, after: &str, ended: &(Option<i32>, String)) {
        let expected = lines(&self.console);
        let got = lines(after);
        assert!(
            got.len() > 3,
            "{what}: the restored run printed too little to compare:\n{after}"
        );
        assert!(
            expected.ends_with(&got[1..]),
            "{what}: the console does not go on as an uninterrupted boot's:\n--- got ---\n{after}"
        );
        assert_eq!(ended, &self.ending, "{what}: the run ended otherwise");
    }
}

/// Checks that the kernel printed exactly the e820 map and the command line that `tinyvmm
/// boot` said on `stderr` it built (`e820: [mem …] TYPE` lines and `command line: …`), and
/// that RAM was in 4096 KVM slots: the map follows regions, not slots.
fn check_map_and_command_line(stderr: &str, console: &str) {
    let built: Vec<&str> = stderr
        .lines()
        .filter_map(|l| l.strip_prefix("tinyvmm: e820: "))
        .collect();
    let printed: Vec<&str> = console
        .lines()
        .filter_map(|l| l.split_once("] BIOS-e820: ").map(|(_, m)| m.trim_end()))
        .collect();
    assert!(!built.is_empty(), "tinyvmm said no map: {stderr}");
    assert_eq!(printed, built, "the kernel's BIOS-e820 map\n{console}");
    // RAM in three ranges (below the EBDA, the reserved low range, the rest), whatever the
    // slots; and none where the virtio-mem area lies (above 4 GiB): it has no slot until the
    // guest plugs.
    assert_eq!(printed.len(), 3, "{printed:?}");
    for range in &printed {
        let end = range
            .strip_prefix("[mem ")
            .and_then(|r| r.split_once(']'))
            .and_then(|(r, _)| r.split_once('-'))
            .and_then(|(_, end)| u64::from_str_radix(end.trim_start_matches("0x"), 16).ok())
            .unwrap_or_else(|| panic!("an e820 range: {range}"));
        assert!(end < 4 << 30, "RAM in the hotplug area: {range}");
    }
    let summary = stderr
        .lines()
        .find(|l| l.contains(" KVM slots; e820 map of "))
        .unwrap_or_else(|| panic!("no summary in: {stderr}"));
    assert!(summary.contains("in 4096 KVM slots"), "{summary}");
    let (_, command_line) = summary
        .split_once("; command line: ")
        .unwrap_or_else(|| panic!("no command line in: {summary}"));
    let kernel: Vec<&str> = console
        .lines()
        .filter_map(|l| l.split_once("] Command line: ").map(|(_, c)| c.trim_end()))
        .collect();
    assert_eq!(kernel, [command_line], "the kernel's command line");
}

/// The state file at `path` as the builds before the one envelope wrote it: a Linux guest's
/// own format (`TVMLINUX` version 1), its devices and machine beside the layout rather than in
/// a guest part, and no guest kind.
fn as_older(path: &Path) -> Vec<u8> {
    use tinyvmm::snapshot::state::{STATE_MAGIC, STATE_VERSION};
    let bytes = std::fs::read(path).expect("the state");
    let json = kvm_memslots_persist::unframe(STATE_MAGIC, STATE_VERSION, &bytes).expect("valid");
    let mut state: Value = serde_json::from_slice(json).expect("JSON");
    let fields = state.as_object_mut().expect("an object");
    fields.remove("kind");
    let guest = fields.remove("guest").expect("the guest part");
    for (name, value) in guest.as_object().expect("an object") {
        fields.insert(name.clone(), value.clone());
    }
    fields.insert("version".into(), json!(1));
    let json = serde_json::to_vec(&state).expect("JSON");
    kvm_memslots_persist::frame(b"TVMLINUX", 1, &json)
}

/// Restores `state` with `mem` through `backend` in a new process, resumes it, and checks it
/// against the reference from `before`.
fn restore_and_check(
    scratch: &Scratch,
    name: &str,
    (state, mem, backend): (&Path, &Path, &str),
    before: &str,
    reference: &Reference,
) {
    let mut vmm = restore(scratch, name, (state, mem), backend);
    vmm.wait_for_api();
    let vm = vmm.ok("GET", "/vm", None);
    assert_eq!(
        (&vm["state"], &vm["vcpus"]),
        (&json!("Paused"), &json!(2)),
        "{name}: a restored VM waits, paused"
    );
    let hotplug = vmm.ok("GET", "/hotplug/memory", None);
    assert_eq!(hotplug["total_size_mib"], 1024, "{name}: {hotplug}");
    vmm.resume();
    let (output, console) = vmm.run_out();
    reference.check(name, before, &console, &ending(&output));
}

/// Restores the live Full through `uffd` (its pages come in as the guest touches them, and
/// the migration reads the rest from the file), lets it run, and migrates it live twice: over
/// a Unix socket with bitmap rounds to one `tinyvmm receive`, and from there with its memfds
/// handed over to another. Checks the three consoles together against the reference: the
/// guest goes on from the live Full's point to the uninterrupted boot's end, in three
/// processes; returns their consoles, one after the other, and how the last ended.
fn live_restore_and_migrate_twice(
    scratch: &Scratch,
    (state, mem): (&Path, &Path),
) -> (String, (Option<i32>, String)) {
    let receiver = |name: &str| {
        let listen = scratch.path(&format!("{name}.mig"));
        let vmm = spawn(
            &["receive", "--listen", &format!("unix:{}", listen.display())],
            scratch.path(&format!("{name}.console")),
            Some(scratch.path(&format!("{name}.sock"))),
        );
        wait_until("receive to listen", || listen.exists());
        (vmm, listen)
    };
    phase("continuation: restoring the live Full through uffd");
    let (mut first, first_listen) = receiver("first-dst");
    let (mut second, second_listen) = receiver("second-dst");
    let mut source = restore(scratch, "live", (state, mem), "uffd");
    source.wait_for_api();
    source.resume();
    // A migration to a destination that is not there fails, and the guest runs on here
    // unharmed (its console is checked with the rest).
    let nobody = scratch.path("nobody.mig");
    source.ok(
        "PUT",
        "/migrate",
        Some(json!({"destination": format!("unix:{}", nobody.display())})),
    );
    wait_until("the failed migration's end", || {
        source.ok("GET", "/migrate", None)["phase"] == "failed"
    });
    assert_eq!(source.ok("GET", "/vm", None)["state"], "Running");
    phase("continuation: the migration to nobody failed; migrating (bitmap)");
    source.ok(
        "PUT",
        "/migrate",
        Some(json!({"destination": format!("unix:{}", first_listen.display()), "timeout_s": 120})),
    );
    // A VMM whose VM moved on ends, exit status 0, once the VM runs on the destination.
    let moved_away = |vmm: &mut Vmm, what: &str| {
        let (output, console) = vmm.run_out();
        let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
        assert_eq!(
            output.status.code(),
            Some(0),
            "{what} ends once the VM runs on its destination: {stderr}"
        );
        (console, stderr)
    };
    // A destination runs the Linux guest only once its memory matched the source's digest
    // (the pages the uffd restore had not filled yet included).
    let checked = "its memory checked against the source's digest";
    let (src_console, _) = moved_away(&mut source, "the restored source");
    phase("continuation: migrated; migrating again (local)");
    // The received VM runs, and moves on at once, its memory handed over.
    first.wait_for_api();
    assert_eq!(first.ok("GET", "/vm", None)["state"], "Running");
    first.ok(
        "PUT",
        "/migrate",
        Some(json!({
            "destination": format!("unix:{}", second_listen.display()),
            "local": true,
            "timeout_s": 120,
        })),
    );
    let (first_console, first_said) = moved_away(&mut first, "the first destination");
    phase("continuation: migrated again; running to the end");
    assert!(first_said.contains(checked), "{first_said}");
    let (second_output, second_console) = second.run_out();
    phase("continuation: ended");
    let second_said = String::from_utf8_lossy(&second_output.stderr);
    assert!(second_said.contains(checked), "{second_said}");
    (
        format!("{src_console}{first_console}{second_console}"),
        ending(&second_output),
    )
}

#[test]
fn kvm_a_linux_guest_restored_or_migrated_goes_on_as_an_uninterrupted_boot() {
    let test = "tinyvmm::kvm_a_linux_guest_restored_or_migrated_goes_on_as_an_uninterrupted_boot";
    if hardware_virtualisation() {
        eprintln!(
            "SKIPPED {test}: this host has hardware virtualisation, where the kernel does not stop \
             at its int3 self-test: the end this test compares against (the gated tests cover it)"
        );
        return;
    }
    if !ready(test) {
        return;
    }
    let (_, vmlinux) = debian_kernel(test).expect("checked by ready");
    let scratch = Scratch::new();
    phase("booting the reference and the boot to snapshot");
    let args = boot_args(&vmlinux);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();

    // The uninterrupted reference and the boot to snapshot, side by side. The reference says
    // what it built (not --quiet), for the check of the kernel's map below.
    let loud: Vec<&str> = args.iter().copied().filter(|a| *a != "--quiet").collect();
    let mut reference = spawn(&loud, scratch.path("reference.console"), None);
    let mut booted = spawn(
        &args,
        scratch.path("booted.console"),
        Some(scratch.path("booted.sock")),
    );
    booted.wait_for_api();
    let (live, live_mem) = (scratch.path("live.state"), scratch.path("live.mem"));
    let (live_diff, live_diff_mem) = (
        scratch.path("live-diff.state"),
        scratch.path("live-diff.mem"),
    );
    let (diff, diff_mem) = (scratch.path("diff.state"), scratch.path("diff.mem"));
    booted.wait_for_line(LIVE_AT);
    phase("the boot to snapshot reached the live Full's point");
    // A running VM is refused a paused snapshot, as the test guest is.
    let (status, refused) = Client::connect(booted.api())
        .expect("connect")
        .call(
            "PUT",
            "/snapshot/create",
            Some(
                &json!({"snapshot_type": "Full", "snapshot_path": scratch.path("no.state"),
                         "mem_file_path": scratch.path("no.mem")}),
            ),
        )
        .expect("an answer");
    assert_eq!(status, 400, "{refused}");
    assert!(!scratch.path("no.state").exists());
    // A live Full of the running guest (the guest's kernel code runs in this host's emulator:
    // bitmap harvests); the Diffs below follow it.
    booted.ok(
        "PUT",
        "/snapshot/create",
        Some(
            json!({"snapshot_type": "Full", "snapshot_path": live, "mem_file_path": live_mem,
                     "live": true}),
        ),
    );
    let mut taken = Value::Null;
    wait_until("the live snapshot's end", || {
        taken = booted.ok("GET", "/snapshot", None);
        !["setup", "pre_copy", "stop_and_copy"].contains(&taken["phase"].as_str().unwrap_or(""))
    });
    assert_eq!(taken["phase"], "completed", "{taken}");
    assert_eq!(booted.ok("GET", "/vm", None)["state"], "Running");
    phase("live Full taken");

    std::thread::scope(|s| {
        // The live Full's own continuation, from its point (which the test did not see) to
        // the end through two migrations, beside the two boots: the only long continuation.
        let moved = s.spawn(|| live_restore_and_migrate_twice(&scratch, (&live, &live_mem)));
        // A live Diff of the guest still booting: it holds what the guest wrote since the live
        // Full's point, and only it does (the Diff below starts at its point): the merged
        // chain restores only if it is right.
        booted.ok(
            "PUT",
            "/snapshot/create",
            Some(json!({"snapshot_type": "Diff", "snapshot_path": live_diff,
                         "mem_file_path": live_diff_mem, "live": true})),
        );
        wait_until("the live Diff's end", || {
            taken = booted.ok("GET", "/snapshot", None);
            !["setup", "pre_copy", "stop_and_copy"].contains(&taken["phase"].as_str().unwrap_or(""))
        });
        assert_eq!(taken["phase"], "completed", "{taken}");
        phase("live Diff taken");
        booted.wait_for_line(DIFF_AT);
        let at_diff = booted.pause();
        phase("the boot to snapshot reached the Diff's point");
        booted.ok(
            "PUT",
            "/snapshot/create",
            Some(
                json!({"snapshot_type": "Diff", "snapshot_path": diff, "mem_file_path": diff_mem}),
            ),
        );
        booted.ok("PUT", "/actions", Some(json!({"action_type": "Stop"})));
        let (stopped, _) = booted.run_out();
        assert_eq!(stopped.status.code(), Some(0), "a stopped boot exits 0");
        phase("Diff taken, the boot to snapshot stopped");
        let (output, console) = reference.run_out();
        phase("the reference ended");
        let reference = Reference {
            ending: ending(&output),
            console,
        };
        check_reference(&String::from_utf8_lossy(&output.stderr), &reference);

        // The memory backends restore the merged chain, taken half a second of guest time
        // before the end: cheap runs, each to the same end as the uninterrupted boot (two at
        // a time beside the migrations: the host has two cores).
        let merged = scratch.path("merged.mem");
        merge_chain(
            &merged,
            &[
                &live,
                &live_mem,
                &live_diff,
                &live_diff_mem,
                &diff,
                &diff_mem,
            ],
        );
        let chain = (diff.as_path(), merged.as_path());
        for backend in ["copy", "file", "uffd"] {
            restore_and_check(
                &scratch,
                backend,
                (chain.0, chain.1, backend),
                &at_diff,
                &reference,
            );
            phase(&format!(
                "the chain restored through {backend} ran to the end"
            ));
        }
        // A state file of the format before the one envelope (a Linux guest's own, `TVMLINUX`
        // version 1) restores alike.
        let older = scratch.path("older.state");
        std::fs::write(&older, as_older(&diff)).expect("write");
        restore_and_check(
            &scratch,
            "older-format",
            (&older, chain.1, "file"),
            &at_diff,
            &reference,
        );
        phase("the chain restored from the older state format ran to the end");
        // `restore --page-size` reaches a Linux guest's restore as a test guest's: its RAM
        // slots here (512 MiB in 4096) are off the 2 MiB grid, so 2 MiB pages are refused,
        // naming the override and the grid, before anything runs.
        let mut refused = spawn(
            &[
                "restore",
                "--snapshot",
                chain.0.to_str().expect("UTF-8"),
                "--mem-file",
                chain.1.to_str().expect("UTF-8"),
                "--mem-backend",
                "uffd",
                "--page-size",
                "2m",
            ],
            scratch.path("page-size.console"),
            Some(scratch.path("page-size.sock")),
        );
        let (output, _) = refused.run_out();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_ne!(output.status.code(), Some(0), "{stderr}");
        assert!(
            stderr.contains("--page-size 2m") && stderr.contains("pages of 0x200000 bytes"),
            "{stderr}"
        );
        let (console, ended) = moved
            .join()
            .unwrap_or_else(|panic| std::panic::resume_unwind(panic));
        reference.check_continuation(
            "the live Full restored through uffd, migrated (bitmap), migrated again (local)",
            &console,
            &ended,
        );
    });
}

/// Checks the uninterrupted boot: it ran to the `int3` of the kernel's self-test, which the
/// host's emulator lacks (status 3, named as the host's limitation, not a VMM crash); by then
/// the kernel got past `Memory: …` and SLUB (whose cmpxchg16b tinyvmm hides on kvm_pvm), and
/// its own 8250 driver took the console over. On its way it printed the map and the command
/// line the VMM built, found the ACPI tables with valid checksums, took its processors and
/// I/O APIC from the MADT, and kept the virtio-mem area out of its RAM.
fn check_reference(stderr: &str, reference: &Reference) {
    let console = &reference.console;
    check_map_and_command_line(stderr, console);
    // The virtio-mem device is in the DSDT, not on the command line, and its memory is
    // onlined movable.
    let command_line = console
        .lines()
        .find_map(|l| l.split_once("] Command line: ").map(|(_, c)| c))
        .unwrap_or_else(|| panic!("no command line in\n{console}"));
    assert!(
        !command_line.contains("virtio_mmio.device="),
        "{command_line}"
    );
    assert!(
        command_line.contains("memhp_default_state=online_movable"),
        "{command_line}"
    );
    assert_eq!(
        reference.ending.0,
        Some(3),
        "the reference boot stops at the host's limitation: {stderr}"
    );
    for said in [
        "KVM_EXIT_INTERNAL_ERROR",
        "a limitation of the host, not a VMM crash",
    ] {
        assert!(stderr.contains(said), "{said:?} not in: {stderr}");
    }
    assert!(
        console.contains("Memory: "),
        "the kernel got that far first\n{console}"
    );
    if tinyvmm::linux::cpu::host_emulates_ring0() {
        assert!(
            console.contains("printk: console [ttyS0] enabled"),
            "past SLUB, the kernel's serial driver drove the console\n{console}"
        );
    }
    assert!(
        console.contains("ACPI: RSDP 0x") && console.contains(" 000024 (v02 TINYVM)"),
        "{console}"
    );
    for (table, id) in [
        ("XSDT", "TINYXSDT"),
        ("FACP", "TINYFACP"),
        ("DSDT", "TINYDSDT"),
        ("APIC", "TINYMADT"),
    ] {
        assert!(
            console
                .lines()
                .any(|l| l.contains(&format!("ACPI: {table} 0x")) && l.contains(id)),
            "no {table} in\n{console}"
        );
    }
    for complaint in [
        "ACPI BIOS Warning",
        "ACPI BIOS Error",
        "ACPI Error",
        "Incorrect checksum",
    ] {
        assert!(!console.contains(complaint), "{complaint}\n{console}");
    }
    for line in [
        "IOAPIC[0]: apic_id 2, version 17, address 0xfec00000, GSI 0-23",
        "ACPI: Using ACPI (MADT) for SMP configuration information",
        "smpboot: Allowing 2 CPUs, 0 hotplug CPUs",
    ] {
        assert!(console.contains(line), "no {line:?} in\n{console}");
    }
}

/// With VT-x or AMD-V (skipped here): a busybox initramfs prints a marker and then, every
/// second, the time and its MemTotal; the guest is snapshotted, restored in a new process
/// (its console goes on: commands run after the restore), plugs virtio-mem memory there
/// (MemTotal grows), migrates on, and plugs more on the destination. Its clock goes on from the
/// saved point: after the restore it reads the host's time less the time the VM was away,
/// within a second; a pause holds it too (3 s paused, it lags the host 3 s more).
#[test]
fn a_restored_and_migrated_linux_guest_runs_and_plugs_memory_with_hardware_virtualisation() {
    let test = "tinyvmm::a_restored_and_migrated_linux_guest_runs_and_plugs_memory_with_hardware_virtualisation";
    if !hardware_virtualisation() {
        eprintln!(
            "SKIPPED {test}: /proc/cpuinfo has neither vmx nor svm: this host's KVM (kvm_pvm) \
             emulates guest ring 0 and a stock kernel stops long before userspace (docs/BOOT.md); \
             kvm_a_linux_guest_restored_or_migrated_goes_on_as_an_uninterrupted_boot covers \
             restore and migration here"
        );
        return;
    }
    let Some((vmlinuz, _)) = debian_kernel(test) else {
        return;
    };
    if !kvm_test_support::require_kvm(test) {
        return;
    }
    let Ok(busybox) = std::fs::read(support::cache().join("busybox")) else {
        eprintln!("SKIPPED {test}: busybox is missing (resources/fetch-kernel.sh fetches it)");
        return;
    };
    let init = b"#!/bin/busybox sh\n\
        B=/bin/busybox\n\
        $B mkdir -p /proc /sys\n\
        $B mount -t proc proc /proc\n\
        $B mount -t sysfs sysfs /sys\n\
        for m in virtio_ring virtio virtio_mmio virtio_mem; do $B insmod /lib/$m.ko; done\n\
        echo 'init ready'\n\
        while true; do\n\
        \x20   echo \"tick $($B date +%s) guest MemTotal: $($B awk '/MemTotal/ {print $2}' /proc/meminfo) kB\"\n\
        \x20   $B sleep 1\n\
        done\n";
    let scratch = Scratch::new();
    let initramfs = scratch.path("initramfs.cpio");
    std::fs::write(
        &initramfs,
        support::virtio_initramfs(&vmlinuz, &busybox, init),
    )
    .expect("the initramfs");
    let mut booted = spawn(
        &[
            "boot",
            "--kernel",
            vmlinuz.to_str().expect("UTF-8"),
            "--initramfs",
            initramfs.to_str().expect("UTF-8"),
            "--mem-mib",
            "512",
            "--vcpus",
            "2",
            "--hotplug-mib",
            "512",
            "--memfd",
            "--quiet",
            "--cmdline",
            "console=ttyS0 reboot=k panic=-1 rdinit=/init",
        ],
        scratch.path("booted.console"),
        Some(scratch.path("booted.sock")),
    );
    booted.wait_for_api();
    booted.wait_for_line("init ready");
    booted.wait_for_line("tick ");
    booted.pause();
    let paused_at = std::time::SystemTime::now();
    let (state, mem) = (scratch.path("vm.state"), scratch.path("vm.mem"));
    booted.ok(
        "PUT",
        "/snapshot/create",
        Some(json!({"snapshot_type": "Full", "snapshot_path": state, "mem_file_path": mem})),
    );
    booted.ok("PUT", "/actions", Some(json!({"action_type": "Stop"})));
    booted.run_out();

    let restored = restore(&scratch, "restored", (&state, &mem), "file");
    restored.wait_for_api();
    let away = paused_at.elapsed().expect("time goes on").as_secs_f64();
    restored.resume();
    restored.wait_for_line("tick ");
    let now = std::time::SystemTime::UNIX_EPOCH
        .elapsed()
        .expect("after 1970")
        .as_secs_f64();
    let guest_time: f64 = restored
        .console()
        .lines()
        .find_map(|l| l.strip_prefix("tick "))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|t| t.parse().ok())
        .expect("a tick with the guest's time");
    assert!(
        (guest_time - (now - away)).abs() <= 1.5,
        "the guest's clock ({guest_time}) is not the host's ({now}) less the {away:.1} s away"
    );
    // Plug 64 MiB after the restore: the guest onlines it.
    let mem_total = |vmm: &Vmm| support::last_mem_total(&vmm.console()).unwrap_or(0);
    let base = mem_total(&restored);
    restored.ok(
        "PATCH",
        "/hotplug/memory",
        Some(json!({"requested_size_mib": 64})),
    );
    wait_until("MemTotal to grow after the restore", || {
        mem_total(&restored) >= base + 64 * 1024
    });
    // Migrate on, and plug more on the destination.
    let listen = scratch.path("vm.mig");
    let destination = spawn(
        &["receive", "--listen", &format!("unix:{}", listen.display())],
        scratch.path("destination.console"),
        Some(scratch.path("destination.sock")),
    );
    wait_until("receive to listen", || listen.exists());
    restored.ok(
        "PUT",
        "/migrate",
        Some(json!({"destination": format!("unix:{}", listen.display()), "local": true})),
    );
    destination.wait_for_api();
    destination.wait_for_line("tick ");
    let moved = mem_total(&destination);
    destination.ok(
        "PATCH",
        "/hotplug/memory",
        Some(json!({"requested_size_mib": 128})),
    );
    wait_until("MemTotal to grow after the migration", || {
        mem_total(&destination) >= moved + 64 * 1024
    });
    // A pause holds the guest's clock: 3 s paused later, its time is the host's less the time
    // away and the pause, within a second and a half.
    let ticks = |vmm: &Vmm| -> Vec<f64> {
        vmm.console()
            .lines()
            .filter_map(|l| l.strip_prefix("tick "))
            .filter_map(|rest| rest.split_whitespace().next()?.parse().ok())
            .collect()
    };
    // How far the guest's time lags the host's, read as a new tick comes (a tick's time is
    // whole seconds: within a second).
    let lag = |vmm: &Vmm| {
        let seen = ticks(vmm).len();
        wait_until("a new tick", || ticks(vmm).len() > seen);
        let now = std::time::SystemTime::UNIX_EPOCH
            .elapsed()
            .expect("after 1970")
            .as_secs_f64();
        now - ticks(vmm).last().copied().expect("a tick")
    };
    let lag_before = lag(&destination);
    destination.pause();
    std::thread::sleep(Duration::from_secs(3));
    destination.resume();
    let lag_after = lag(&destination);
    assert!(
        (lag_after - lag_before - 3.0).abs() <= 1.5,
        "the guest's clock ran on while paused: it lagged the host by {lag_before:.1} s before a \
         3 s pause and {lag_after:.1} s after it"
    );
    destination.ok("PUT", "/actions", Some(json!({"action_type": "Stop"})));
}
