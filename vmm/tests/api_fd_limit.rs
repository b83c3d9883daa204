//! The API socket when the VMM's process runs out of file descriptors: a client it cannot take
//! is answered 503 and closed (rather than left waiting while the listener stays readable and
//! the event loop spins), and the socket serves as before once descriptors are free again.
//!
//! A test binary of its own: it lowers the whole process's descriptor limit.

use std::fs::File;
use std::time::Duration;

use tinyvmm::api::client::Client;
use tinyvmm::jobs::serve::ServeConfig;

mod support;
use support::vmm::InProcess;

/// The process's soft and hard limits on open descriptors.
fn nofile() -> libc::rlimit {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one `rlimit` into the valid one given.
    let got = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) };
    assert_eq!(got, 0, "getrlimit");
    limit
}

fn set_nofile(limit: libc::rlimit) {
    // SAFETY: setrlimit reads one valid `rlimit`.
    let set = unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &limit) };
    assert_eq!(set, 0, "setrlimit");
}

#[test]
fn a_client_beyond_the_descriptor_limit_gets_503_and_the_socket_recovers() {
    let test = "tinyvmm::a_client_beyond_the_descriptor_limit_gets_503_and_the_socket_recovers";
    if !kvm_test_support::require_kvm(test) {
        return;
    }
    let socket =
        std::env::temp_dir().join(format!("tinyvmm-test-{}-fd-limit.sock", std::process::id()));
    let config = ServeConfig {
        api_sock: socket.clone(),
        slots: 2,
        area_size: 1 << 20,
        vcpus: 1,
        ..ServeConfig::new(std::path::PathBuf::new())
    };
    let vmm = InProcess::start(config);
    let get_memory = || {
        Client::connect(&socket)
            .expect("connect")
            .call("GET", "/memory", None)
            .expect("an answer")
    };
    let open = || std::fs::read_dir("/proc/self/fd").expect("/proc").count();
    let open_before = open();
    assert_eq!(get_memory().0, 200);
    // The server closes its end of that connection when it sees the client's close: wait for
    // it, or it would free a descriptor in the middle of what follows.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while open() > open_before {
        assert!(
            std::time::Instant::now() < deadline,
            "the server keeps a closed connection"
        );
        std::thread::sleep(Duration::from_millis(10));
    }

    // Fill the descriptor table but for one: the client's socket takes that one, and the
    // server's accept finds none.
    let original = nofile();
    let open_now = open() as u64;
    set_nofile(libc::rlimit {
        rlim_cur: open_now + 16,
        ..original
    });
    let mut filler = Vec::new();
    loop {
        match File::open("/dev/null") {
            Ok(file) => filler.push(file),
            Err(e) if e.raw_os_error() == Some(libc::EMFILE) => break,
            Err(e) => panic!("opening /dev/null: {e}"),
        }
    }
    filler.pop();
    let mut client = Client::connect(&socket).expect("connect with the last descriptor");
    let answer = client.call("GET", "/memory", None);
    // Free them before checking, so that a failed check leaves a usable process.
    drop(client);
    drop(filler);
    set_nofile(original);
    let (status, body) = answer.expect("an answer, not a client left waiting");
    assert_eq!(status, 503, "{body}");
    let message = body["fault_message"].as_str().unwrap_or_default();
    assert!(message.contains("out of file descriptors"), "{body}");

    // The server took its spare descriptor back and serves as before.
    assert_eq!(get_memory().0, 200);
    vmm.stop();
}
