//! The command line's one vocabulary: the same option names for the same things in every
//! subcommand, defaults in every `--help`, no option a subcommand ignores, usage errors with
//! their own exit status, `--version` with the commit, and `--json` printing JSON alone on
//! stdout.

use std::process::{Command, Output, Stdio};

use kvm_test_support::cli::{
    assert_usage_error, assert_version_and_help, help_commands, help_options, help_problems,
};

mod support;

fn tinyvmm(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tinyvmm"))
        .args(args)
        // The socket comes from the arguments alone unless a test says otherwise.
        .env_remove(tinyvmm::jobs::client::API_SOCK_ENV)
        .stdin(Stdio::null())
        .output()
        .expect("tinyvmm runs")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Every subcommand, as `tinyvmm help` lists them (the measurement harnesses are
/// `tinyvmm-bench`'s, `vmm/bench/tests/cli.rs`).
const SUBCOMMANDS: [&str; 9] = [
    "check",
    "serve",
    "restore",
    "snapshot-merge",
    "receive",
    "boot",
    "client",
    "completions",
    "man",
];

/// Options that name an input of the run, which has no default (`--start` and `--end`: a
/// guest command's range, which `client guest` needs for a range's commands).
const INPUTS: [&str; 9] = [
    "--config",
    "--kernel",
    "--initramfs",
    "--snapshot",
    "--mem-file",
    "--listen",
    "--api-sock",
    "--start",
    "--end",
];

/// `tinyvmm --help` lists the product's subcommands and no measurement harness (those are
/// `tinyvmm-bench`'s).
#[test]
fn the_help_lists_the_products_subcommands_alone() {
    let help = text(&tinyvmm(&["--help"]).stdout);
    assert_eq!(help_commands(&help), SUBCOMMANDS, "{help}");
    for harness in ["bench", "stress", "harvest-bench", "snapshot-bench"] {
        assert_usage_error(&[harness], &tinyvmm(&[harness]));
    }
}

#[test]
fn every_help_shows_its_defaults_and_one_name_per_concept() {
    let mut vcpus_help = Vec::new();
    let client_help = text(&tinyvmm(&["client", "--help"]).stdout);
    let client_commands = help_commands(&client_help)
        .into_iter()
        .map(|c| vec!["client", c]);
    let commands: Vec<Vec<&str>> = SUBCOMMANDS
        .iter()
        .map(|s| vec![*s])
        .chain(client_commands)
        .collect();
    assert!(commands.len() > SUBCOMMANDS.len() + 20, "{client_help}");
    for command in &commands {
        let subcommand = command.join(" ");
        let output = tinyvmm(&[&command[..], &["--help"]].concat());
        assert!(output.status.success(), "{subcommand} --help");
        let help = text(&output.stdout);
        let problems = help_problems(&subcommand, &help, &INPUTS);
        assert!(problems.is_empty(), "{}", problems.join("\n"));
        for (option, option_help) in help_options(&help) {
            if option == "--vcpus" {
                vcpus_help.push((subcommand.clone(), option_help));
            }
        }
    }
    for (subcommand, help) in vcpus_help {
        assert!(
            help.contains("(1 to 15)") || (subcommand == "boot" && help.contains("(1 to 32)")),
            "{subcommand}: {help}"
        );
    }
}

#[test]
fn restore_lists_no_option_it_ignores() {
    let help = text(&tinyvmm(&["restore", "--help"]).stdout);
    let names: Vec<String> = help_options(&help).into_iter().map(|(n, _)| n).collect();
    for ignored in ["--slots", "--mem-mib", "--vcpus", "--memfd"] {
        assert!(
            !names.contains(&ignored.to_owned()),
            "restore lists {ignored}"
        );
        let refused = tinyvmm(&["restore", ignored, "2"]);
        assert_eq!(refused.status.code(), Some(64), "restore {ignored}");
    }
    for kept in [
        "--api-sock",
        "--idle-timeout",
        "--dirty-ring",
        "--mem-backend",
    ] {
        assert!(names.contains(&kept.to_owned()), "restore lacks {kept}");
    }
}

/// `serve --page-size 2m` with initial memory or a slot size off the 2 MiB grid is a usage
/// error (64) naming the value, before anything starts; 4 KiB pages take the same layout.
#[test]
fn serve_with_2m_pages_off_the_grid_is_a_usage_error() {
    let socket =
        std::env::temp_dir().join(format!("tinyvmm-test-{}-grid.sock", std::process::id()));
    let socket = socket.to_str().expect("a UTF-8 path");
    for (mem, slots, says) in [
        (
            "3",
            "2",
            "the test area's size 0x300000 must be a multiple of 0x200000",
        ),
        (
            "8",
            "9",
            "the test area's slot size 0x100000 must be a multiple of 0x200000",
        ),
        (
            "8",
            "4",
            "the test area's slot size 0x2aaaaa must be a multiple of 0x200000",
        ),
    ] {
        let args = [
            "serve",
            "--page-size",
            "2m",
            "--mem-mib",
            mem,
            "--slots",
            slots,
            "--api-sock",
            socket,
        ];
        let output = tinyvmm(&args);
        let stderr = text(&output.stderr);
        assert_eq!(output.status.code(), Some(64), "{args:?}: {stderr}");
        assert!(
            stderr.contains(&format!("--page-size 2m with --mem-mib {mem} over"))
                && stderr.contains(says),
            "{args:?}: {stderr}"
        );
        assert!(!std::path::Path::new(socket).exists(), "nothing started");
    }
}

/// `boot --page-size 2m` checks RAM on the 2 MiB grid with its configuration, and RAM the
/// hugetlb pool cannot hold is refused before the kernel is read, naming the pool's free
/// pages: both exit 1 (a run that failed), the kernel file never opened.
#[test]
fn kvm_boot_with_2m_pages_refuses_ram_off_the_grid_or_past_the_pool() {
    if !kvm_test_support::require_kvm(
        "tinyvmm::kvm_boot_with_2m_pages_refuses_ram_off_the_grid_or_past_the_pool",
    ) {
        return;
    }
    let kernel = "/nonexistent/vmlinux";
    let boot = |mem_mib: &str, slots: &str| {
        let args = [
            "boot",
            "--kernel",
            kernel,
            "--page-size",
            "2m",
            "--mem-mib",
            mem_mib,
            "--slots",
            slots,
            "--quiet",
        ];
        let output = tinyvmm(&args);
        (output.status.code(), text(&output.stderr))
    };
    let (code, stderr) = boot("129", "1");
    assert_eq!(code, Some(1), "{stderr}");
    assert!(
        stderr.contains("with page_size 2m, mem_mib must be a multiple of 2 MiB: 129 MiB"),
        "{stderr}"
    );
    let (code, stderr) = boot("512", "3");
    assert_eq!(code, Some(1), "{stderr}");
    assert!(
        stderr.contains("with page_size 2m, the slot size must be a multiple of 2 MiB"),
        "{stderr}"
    );
    // More than the pool has, whatever its size.
    let pages = kvm_memslots::hugetlb_pages_available() + 64;
    let (code, stderr) = boot(&(pages * 2).to_string(), "1");
    assert_eq!(code, Some(1), "{stderr}");
    assert!(
        stderr.contains("free 2 MiB pages") && stderr.contains(&format!("need {pages}")),
        "{stderr}"
    );
    assert!(
        !stderr.contains(kernel),
        "the kernel is never read: {stderr}"
    );
}

/// A slot count over what KVM offers here is a usage error (64), named before anything
/// starts, as a count under 2 is; not a failure of the run (1).
#[test]
fn kvm_a_slot_count_over_kvms_is_a_usage_error() {
    if !kvm_test_support::require_kvm("tinyvmm::kvm_a_slot_count_over_kvms_is_a_usage_error") {
        return;
    }
    let max = kvm_ioctls::Kvm::new().expect("KVM").get_nr_memslots();
    let over = (max + 1).to_string();
    for args in [
        &["check", "--slots", over.as_str()][..],
        &[
            "serve",
            "--api-sock",
            "/nonexistent/x.sock",
            "--slots",
            &over,
        ],
    ] {
        let output = tinyvmm(args);
        let stderr = text(&output.stderr);
        assert_eq!(output.status.code(), Some(64), "{args:?}: {stderr}");
        assert!(
            stderr.contains(&format!("more than KVM's {max} slots")),
            "{args:?}: {stderr}"
        );
    }
}

#[test]
fn usage_errors_have_their_own_exit_status_and_help_and_version_succeed() {
    for args in [
        &["--bogus"][..],
        &["check", "--vcpus", "16"],
        &["check", "--vcpus", "0"],
        &["check", "--slots", "1"],
        &["serve", "--api-sock", "/nonexistent/x.sock", "--slots", "1"],
        &[
            "serve",
            "--api-sock",
            "/nonexistent/x.sock",
            "--idle-timeout",
            "0",
        ],
        &["boot", "--kernel", "/nonexistent", "--vcpus", "33"],
        &["receive", "--api-sock", "/nonexistent/x.sock"],
        // A recording's length must be a number of seconds above 0, its list a file, and a
        // raw request's body JSON: each a usage error before anything starts.
        &recording_into("/nonexistent/w.wset", "--record-secs=-1"),
        &recording_into("/nonexistent/w.wset", "--record-secs=nan"),
        &recording_into("/nonexistent/w.wset", "--record-secs=0"),
        &recording_into("/tmp", "--record-secs=5"),
        &[
            "client",
            "--api-sock",
            "/nonexistent/x.sock",
            "raw",
            "PUT",
            "/vm",
            "{not json",
        ],
    ] {
        assert_usage_error(args, &tinyvmm(args));
    }
    // The old names are still understood.
    let help = tinyvmm(&["check", "--area-mib", "8", "--help"]);
    assert!(help.status.success());
    assert_version_and_help(tinyvmm, "tinyvmm", env!("CARGO_PKG_VERSION"));
}

#[test]
fn kvm_check_json_is_json_alone_on_stdout() {
    if !kvm_test_support::require_kvm("tinyvmm::kvm_check_json_is_json_alone_on_stdout") {
        return;
    }
    let output = tinyvmm(&["check", "--slots", "64", "--mem-mib", "8", "--json"]);
    assert!(output.status.success(), "{}", text(&output.stderr));
    let report: serde_json::Value = serde_json::from_slice(&output.stdout)
        .unwrap_or_else(|e| panic!("stdout is not JSON ({e}): {}", text(&output.stdout)));
    assert_eq!(report["passed"], serde_json::json!(true), "{report}");
    assert_eq!(report["slots"], serde_json::json!(64), "{report}");
    for duration in [
        "slot_setup_ms",
        "guest_write_ms",
        "host_check_ms",
        "guest_check_ms",
    ] {
        assert!(report[duration].is_f64(), "{duration} in ms: {report}");
    }
    assert!(text(&output.stderr).contains("all checks passed"));

    // What the issue asked for, as a shell user would do it.
    let python = std::env::var("TINYVMM_PYTHON").unwrap_or_else(|_| "python3".into());
    let piped = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "'{}' check --slots 64 --mem-mib 8 --json | '{python}' -m json.tool",
            env!("CARGO_BIN_EXE_tinyvmm")
        ))
        .output()
        .expect("sh runs");
    assert!(piped.status.success(), "{}", text(&piped.stderr));

    // A failure is JSON too, and says so.
    let failed = tinyvmm(&[
        "check",
        "--slots",
        "64",
        "--mem-mib",
        "8",
        "--max-guest-mib",
        "1",
        "--json",
    ]);
    assert_eq!(failed.status.code(), Some(1));
    let report: serde_json::Value = serde_json::from_slice(&failed.stdout).expect("JSON");
    assert_eq!(report["passed"], serde_json::json!(false), "{report}");
    assert!(report["error"].is_string(), "{report}");
}

#[test]
fn kvm_the_client_command_speaks_for_every_status_class() {
    if !kvm_test_support::require_kvm(
        "tinyvmm::kvm_the_client_command_speaks_for_every_status_class",
    ) {
        return;
    }
    let socket =
        std::env::temp_dir().join(format!("tinyvmm-cli-client-{}.sock", std::process::id()));
    let config = tinyvmm::jobs::serve::ServeConfig::new(socket.clone());
    let vmm = support::vmm::InProcess::start(config);
    let sock = socket.to_str().expect("a UTF-8 path");
    let client = |args: &[&str]| tinyvmm(&[&["client", "--api-sock", sock][..], args].concat());

    let memory = client(&["memory"]);
    assert_eq!(memory.status.code(), Some(0), "{}", text(&memory.stderr));
    let table = text(&memory.stdout);
    assert!(table.contains("regions:\n  id  backing"), "{table}");
    assert!(
        table.contains("0x10000000") && table.contains("256 MiB"),
        "{table}"
    );

    let added = client(&["add-region", "--size", "2M", "--slot-size", "64K", "--json"]);
    assert_eq!(added.status.code(), Some(0), "{}", text(&added.stderr));
    let added: serde_json::Value = serde_json::from_slice(&added.stdout).expect("JSON alone");
    assert_eq!(added["slots"], serde_json::json!(32), "{added}");

    let write = client(&[
        "guest", "write", "--start", "256M", "--end", "257M", "--seed", "3",
    ]);
    assert_eq!(text(&write.stdout), "result  ok\n");
    let paused = client(&["pause"]);
    assert_eq!(
        (paused.status.code(), text(&paused.stdout)),
        (Some(0), "done (204)\n".into())
    );
    assert_eq!(client(&["resume", "--json"]).stdout, b"{}\n");

    // A refusal: its message on stderr, exit status 4; a 5xx would be 5.
    let refused = client(&["remove-region", "0"]);
    assert_eq!(refused.status.code(), Some(4));
    assert!(
        text(&refused.stderr).starts_with("tinyvmm: 409: region 0"),
        "{}",
        text(&refused.stderr)
    );
    let refused = client(&["--json", "migration"]);
    assert_eq!(refused.status.code(), Some(4));
    let fault: serde_json::Value = serde_json::from_slice(&refused.stdout).expect("JSON alone");
    assert!(fault["fault_message"].is_string(), "{fault}");

    // Usage errors are the CLI's; a socket that is not there is 1.
    assert_eq!(
        client(&["guest", "write", "--end", "1M"]).status.code(),
        Some(64)
    );
    assert_eq!(client(&["add-region"]).status.code(), Some(64));
    let nowhere = tinyvmm(&["client", "--api-sock", "/nonexistent/x.sock", "info"]);
    assert_eq!(nowhere.status.code(), Some(1));

    assert_eq!(client(&["stop"]).status.code(), Some(0));
    let ending = vmm.ended().expect("a clean stop");
    assert_eq!(ending, tinyvmm::lifecycle::Ending::Finished);
}

#[test]
fn completions_and_man_pages_come_from_the_command_line() {
    let bash = tinyvmm(&["completions", "bash"]);
    assert!(bash.status.success());
    let script = text(&bash.stdout);
    assert!(script.contains("complete -F _tinyvmm"), "{script}");
    assert!(script.contains("--api-sock") && script.contains("add-region"));
    let dir = std::env::temp_dir().join(format!("tinyvmm-man-{}", std::process::id()));
    let written = tinyvmm(&["man", "--dir", dir.to_str().expect("UTF-8")]);
    assert!(written.status.success(), "{}", text(&written.stderr));
    let page = std::fs::read_to_string(dir.join("tinyvmm-serve.1")).expect("serve's page");
    assert!(
        page.contains(".TH tinyvmm-serve 1") && page.contains("idle\\-timeout"),
        "{page}"
    );
    assert!(dir.join("tinyvmm.1").exists() && dir.join("tinyvmm-client-add-region.1").exists());
    std::fs::remove_dir_all(&dir).expect("cleaned up");
    // Without a folder, a usage error: the pages never land in whatever folder it runs from.
    let scratch = std::env::temp_dir().join(format!("tinyvmm-man-cwd-{}", std::process::id()));
    std::fs::create_dir_all(&scratch).expect("a folder");
    let refused = Command::new(env!("CARGO_BIN_EXE_tinyvmm"))
        .arg("man")
        .current_dir(&scratch)
        .output()
        .expect("tinyvmm runs");
    assert_eq!(refused.status.code(), Some(64), "{}", text(&refused.stderr));
    assert!(
        text(&refused.stderr).contains("--dir"),
        "{}",
        text(&refused.stderr)
    );
    assert_eq!(std::fs::read_dir(&scratch).expect("the folder").count(), 0);
    std::fs::remove_dir_all(&scratch).expect("cleaned up");
}

#[test]
fn kvm_log_requests_logs_each_request_with_its_status() {
    if !kvm_test_support::require_kvm("tinyvmm::kvm_log_requests_logs_each_request_with_its_status")
    {
        return;
    }
    let mut vmm = support::vmm::Vmm::command("cli-log")
        .args(["serve", "--mem-mib", "0", "--slots", "1", "--log-requests"])
        .spawn();
    // No request before the test's own: they are what the log must show.
    vmm.wait_for_socket_file();
    let sock = vmm.api().to_str().expect("a UTF-8 path").to_owned();
    for (args, status) in [
        (&["vm"][..], 0),
        (&["remove-region", "0"], 4),
        (&["stop"], 0),
    ] {
        let client = tinyvmm(&[&["client", "--api-sock", &sock][..], args].concat());
        assert_eq!(client.status.code(), Some(status), "{args:?}");
    }
    let output = vmm.wait(std::time::Duration::from_secs(120));
    assert!(output.status.success());
    let log = text(&output.stderr);
    for line in [
        "tinyvmm: api: GET /vm -> 200 in ",
        "tinyvmm: api: DELETE /memory/regions/0 -> 409 in ",
        "tinyvmm: api: PUT /actions -> 204 in ",
    ] {
        assert!(
            log.lines().any(|l| l.starts_with(line)),
            "{line} in:\n{log}"
        );
    }
    assert!(
        log.contains(" ms: region 0 holds the guest's code"),
        "{log}"
    );
}

/// `tinyvmm restore` with a working-set recording into `list` and `secs`.
fn recording_into<'a>(list: &'a str, secs: &'a str) -> [&'a str; 12] {
    [
        "restore",
        "--snapshot",
        "/nonexistent/s",
        "--mem-file",
        "/nonexistent/m",
        "--api-sock",
        "/nonexistent/x.sock",
        "--mem-backend",
        "uffd",
        "--record-working-set",
        list,
        secs,
    ]
}

/// A server that accepts and never answers: `tinyvmm client` gives up after `--timeout`, with
/// exit status 124 and a message naming the socket and the wait, instead of hanging (it once
/// waited 300 s a read). The test's own deadline only guards a hang.
#[test]
fn the_client_gives_up_on_a_server_that_never_answers() {
    use std::os::unix::net::UnixListener;
    use std::time::{Duration, Instant};
    let path = std::env::temp_dir().join(format!("tinyvmm-mute-{}.sock", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let listener = UnixListener::bind(&path).expect("a socket");
    // Accepts every connection and keeps it open, reading nothing and answering nothing.
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for stream in listener.incoming().flatten() {
            held.push(stream);
        }
    });
    let socket = path.to_str().expect("UTF-8");
    for (args, waited) in [
        (vec!["--timeout", "1", "info"], "1 s"),
        (
            vec![
                "snapshot",
                "--snapshot",
                "s",
                "--mem-file",
                "m",
                "--timeout",
                "2",
            ],
            "2 s",
        ),
    ] {
        let mut child = Command::new(env!("CARGO_BIN_EXE_tinyvmm"))
            .args(["client", "--api-sock", socket])
            .args(&args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("tinyvmm runs");
        let guard = Instant::now() + Duration::from_secs(120);
        while child.try_wait().expect("waitpid").is_none() {
            if Instant::now() > guard {
                let _ = child.kill();
                panic!("{args:?}: the client still waits for an answer");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let output = child.wait_with_output().expect("its output");
        let stderr = text(&output.stderr);
        assert_eq!(output.status.code(), Some(124), "{args:?}: {stderr}");
        assert!(
            stderr.starts_with(&format!("tinyvmm: {socket}: no answer within {waited}")),
            "{args:?}: {stderr}"
        );
        assert!(output.stdout.is_empty(), "{args:?}");
    }
    // A wait that is not a number of seconds is a usage error, before any connection.
    for bad in ["-1", "abc", "1.5x"] {
        let refused = tinyvmm(&["client", "--api-sock", socket, "--timeout", bad, "info"]);
        assert_eq!(refused.status.code(), Some(64), "--timeout {bad}");
    }
    let _ = std::fs::remove_file(&path);
}

/// A typo gets clap's "did you mean", for a subcommand as for a client request.
#[test]
fn a_typo_gets_a_suggestion() {
    for (args, suggested) in [
        (&["serv"][..], "'serve'"),
        (
            &["client", "--api-sock", "/nonexistent/x.sock", "memroy"],
            "'memory'",
        ),
        (
            &["serve", "--api-sok", "/nonexistent/x.sock"],
            "'--api-sock'",
        ),
    ] {
        let output = tinyvmm(args);
        assert_eq!(output.status.code(), Some(64), "{args:?}");
        let stderr = text(&output.stderr);
        assert!(
            stderr.contains("tip: a similar") && stderr.contains(suggested),
            "{args:?}: {stderr}"
        );
    }
}

/// The client's API socket: `--api-sock` or `--api-socket` (Cloud Hypervisor's name), before
/// or after the request's name, or `TINYVMM_API_SOCK`; without any, a usage error naming both.
/// A socket that is not there fails with exit status 1 naming the path it was given.
#[test]
fn the_clients_socket_comes_from_either_name_anywhere_or_the_environment() {
    let nowhere = |name: &str| format!("/nonexistent/{name}.sock");
    let sockets = [nowhere("before"), nowhere("after"), nowhere("alias")];
    for (args, socket) in [
        (
            vec!["client", "--api-sock", &sockets[0], "info"],
            &sockets[0],
        ),
        (
            vec!["client", "info", "--api-sock", &sockets[1]],
            &sockets[1],
        ),
        (
            vec!["client", "vm", "--api-socket", &sockets[2]],
            &sockets[2],
        ),
    ] {
        let output = tinyvmm(&args);
        let stderr = text(&output.stderr);
        assert_eq!(output.status.code(), Some(1), "{args:?}: {stderr}");
        assert!(
            stderr.starts_with(&format!("tinyvmm: {socket}: ")),
            "{args:?}: {stderr}"
        );
    }
    let from_env = Command::new(env!("CARGO_BIN_EXE_tinyvmm"))
        .args(["client", "info"])
        .env(tinyvmm::jobs::client::API_SOCK_ENV, nowhere("env"))
        .stdin(Stdio::null())
        .output()
        .expect("tinyvmm runs");
    assert_eq!(from_env.status.code(), Some(1));
    assert!(
        text(&from_env.stderr).starts_with(&format!("tinyvmm: {}: ", nowhere("env"))),
        "{}",
        text(&from_env.stderr)
    );
    // The argument wins over the environment.
    let both = Command::new(env!("CARGO_BIN_EXE_tinyvmm"))
        .args(["client", "info", "--api-sock", &nowhere("argument")])
        .env(tinyvmm::jobs::client::API_SOCK_ENV, nowhere("env"))
        .stdin(Stdio::null())
        .output()
        .expect("tinyvmm runs");
    assert!(
        text(&both.stderr).starts_with(&format!("tinyvmm: {}: ", nowhere("argument"))),
        "{}",
        text(&both.stderr)
    );
    // The VMM's own `--api-sock` takes the same second name.
    let served = tinyvmm(&[
        "serve",
        "--api-socket",
        &nowhere("served"),
        "--mem-mib",
        "0",
        "--slots",
        "1",
    ]);
    assert_eq!(served.status.code(), Some(1), "{}", text(&served.stderr));
    assert!(
        text(&served.stderr).contains(&nowhere("served")),
        "{}",
        text(&served.stderr)
    );
    let missing = tinyvmm(&["client", "info"]);
    assert_eq!(missing.status.code(), Some(64));
    let stderr = text(&missing.stderr);
    assert!(
        stderr.starts_with("error: ")
            && stderr.contains("--api-sock")
            && stderr.contains(tinyvmm::jobs::client::API_SOCK_ENV),
        "{stderr}"
    );
}

/// The log level is the VMM's: every subcommand that runs one lists it, and the client's
/// requests, which say only their failures, do not repeat it in each help (it is still
/// accepted there).
#[test]
fn the_clients_helps_do_not_repeat_the_log_level() {
    for command in [
        &["client"][..],
        &["client", "memory"],
        &["client", "migrate"],
    ] {
        let help = text(&tinyvmm(&[command, &["--help"]].concat()).stdout);
        assert!(
            help.contains("Usage: tinyvmm client"),
            "{command:?}: {help}"
        );
        assert!(!help.contains("--log-level"), "{command:?}: {help}");
    }
    for command in ["serve", "boot", "receive", "check"] {
        let help = text(&tinyvmm(&[command, "--help"]).stdout);
        assert!(help.contains("--log-level"), "{command}: {help}");
    }
    let accepted = tinyvmm(&[
        "client",
        "--log-level",
        "debug",
        "--api-sock",
        "/nonexistent/x.sock",
        "info",
    ]);
    assert_eq!(
        accepted.status.code(),
        Some(1),
        "{}",
        text(&accepted.stderr)
    );
}

/// `client migrate` and `client snapshot --live` wait for their run's outcome and exit with
/// it: a migration to a destination that is not there exits 1 naming why, a live snapshot
/// that completes exits 0 with its final status, one its timeout cancels exits 1;
/// `--no-wait` returns once they started. A guest verify that finds a mismatch exits 1.
#[test]
fn kvm_the_client_waits_for_a_runs_outcome_and_a_failed_verify_fails() {
    if !kvm_test_support::require_kvm(
        "tinyvmm::kvm_the_client_waits_for_a_runs_outcome_and_a_failed_verify_fails",
    ) {
        return;
    }
    let dir = std::env::temp_dir().join(format!("tinyvmm-cli-wait-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("a folder");
    let socket = dir.join("api.sock");
    let mut config = tinyvmm::jobs::serve::ServeConfig::new(socket.clone());
    config.area_size = 8 << 20;
    let vmm = support::vmm::InProcess::start(config);
    let sock = socket.to_str().expect("a UTF-8 path");
    let client = |args: &[&str]| tinyvmm(&[&["client", "--api-sock", sock][..], args].concat());
    let file = |name: &str| dir.join(name).to_str().expect("UTF-8").to_owned();

    // A destination that is not there: the migration fails once it tries to connect.
    let nowhere = format!("unix:{}", file("nobody-listens.sock"));
    let migrated = client(&["migrate", &nowhere]);
    let stderr = text(&migrated.stderr);
    assert_eq!(migrated.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("the migration ended failed: cannot connect to"),
        "{stderr}"
    );
    let started = client(&["migrate", &nowhere, "--no-wait"]);
    assert_eq!(
        (started.status.code(), text(&started.stdout)),
        (Some(0), "done (204)\n".to_owned())
    );
    // It fails on its own meanwhile; the VM runs on.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        let status = client(&["--json", "migration"]);
        let status: serde_json::Value = serde_json::from_slice(&status.stdout).expect("JSON");
        if status["phase"] == "failed" {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "{status}");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }

    // A live snapshot that completes: its final status, and both files.
    let live = client(&[
        "snapshot",
        "--live",
        "--snapshot",
        &file("live.state"),
        "--mem-file",
        &file("live.mem"),
    ]);
    let stdout = text(&live.stdout);
    assert_eq!(live.status.code(), Some(0), "{}", text(&live.stderr));
    assert!(
        stdout.contains("phase ") && stdout.contains("completed"),
        "{stdout}"
    );
    assert!(stdout.contains("snapshot_id"), "{stdout}");
    assert!(dir.join("live.state").exists() && dir.join("live.mem").exists());
    // One that cannot converge (a budget of 0) and gives up at its timeout.
    let cancelled = client(&[
        "--json",
        "snapshot",
        "--live",
        "--type",
        "diff",
        "--snapshot",
        &file("cancelled.state"),
        "--mem-file",
        &file("cancelled.mem"),
        "--downtime-ms",
        "0",
        "--timeout-s",
        "1",
        "--on-timeout",
        "cancel",
    ]);
    let stderr = text(&cancelled.stderr);
    assert_eq!(cancelled.status.code(), Some(1), "{stderr}");
    let status: serde_json::Value = serde_json::from_slice(&cancelled.stdout).expect("JSON alone");
    assert_eq!(status["phase"], "cancelled", "{status}");
    assert!(
        stderr.contains("the live snapshot ended cancelled: cancelled: not converged"),
        "{stderr}"
    );
    assert!(!dir.join("cancelled.state").exists());
    // A verify that finds what was written passes; one with another seed fails.
    let range = ["--start", "256M", "--end", "257M"];
    let write = client(&[&["guest", "write"][..], &range, &["--seed", "3"]].concat());
    assert_eq!(write.status.code(), Some(0), "{}", text(&write.stderr));
    let verify = client(&[&["guest", "verify"][..], &range, &["--seed", "3"]].concat());
    assert_eq!(verify.status.code(), Some(0), "{}", text(&verify.stderr));
    let mismatch = client(&[&["guest", "verify"][..], &range, &["--seed", "4"]].concat());
    let stderr = text(&mismatch.stderr);
    assert_eq!(mismatch.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("the guest's verify failed: 0x10000000 holds"),
        "{stderr}"
    );
    assert!(stderr.contains("mismatch"), "{stderr}");

    let started = client(&[
        "snapshot",
        "--live",
        "--type",
        "diff",
        "--snapshot",
        &file("diff.state"),
        "--mem-file",
        &file("diff.mem"),
        "--no-wait",
    ]);
    assert_eq!(
        (started.status.code(), text(&started.stdout)),
        (Some(0), "done (204)\n".to_owned())
    );

    // Stop cancels it, as it would any run under way.
    assert_eq!(client(&["stop"]).status.code(), Some(0));
    vmm.ended().expect("a clean stop");
    let _ = std::fs::remove_dir_all(&dir);
}
