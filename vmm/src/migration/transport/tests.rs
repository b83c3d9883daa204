use super::*;
use std::os::unix::ffi::OsStrExt;

#[test]
fn endpoints_parse_and_name_what_is_wrong() {
    assert_eq!(
        "unix:/tmp/m.sock".parse::<Endpoint>(),
        Ok(Endpoint::Unix("/tmp/m.sock".into()))
    );
    assert_eq!(
        "tcp:127.0.0.1:4444".parse::<Endpoint>(),
        Ok(Endpoint::Tcp("127.0.0.1:4444".into()))
    );
    assert_eq!(
        "tcp:[::1]:4444".parse::<Endpoint>(),
        Ok(Endpoint::Tcp("[::1]:4444".into()))
    );
    for bad in ["unix:", "tcp:host", "tcp::80", "tcp:h:99999", "/tmp/x", ""] {
        let e = bad.parse::<Endpoint>().expect_err(bad);
        assert!(e.contains("unix:") || e.contains("HOST:PORT"), "{bad}: {e}");
    }
    assert_eq!(
        Endpoint::Unix("/a".into()).to_string(),
        "unix:/a",
        "Display is the parse's inverse"
    );
}

/// A watch on a flag nothing sets but `stop`, with `limits`.
fn watch(stop: &'static AtomicBool, limits: Limits) -> Watch {
    Watch::new(stop, None, "the test's bytes", limits)
}

/// Less than half of [`patient`]'s stall: a wait that ends before it was cut short (by a
/// signal, a cancel, a deadline), not waited out. A bound that tells the two apart on a
/// slow or loaded machine, not a timing check.
const SHORT: Duration = Duration::from_secs(4);

fn patient() -> Limits {
    Limits {
        deadline: None,
        stall: Duration::from_secs(10),
    }
}

#[test]
fn file_descriptors_travel_beside_the_bytes_in_order() {
    static STOP: AtomicBool = AtomicBool::new(false);
    let (a, b) = UnixStream::pair().expect("pair");
    a.set_nonblocking(true).expect("non-blocking");
    b.set_nonblocking(true).expect("non-blocking");
    let (mut a, mut b) = (
        Connection::unix(a, watch(&STOP, patient())),
        Connection::unix(b, watch(&STOP, patient())),
    );
    let files: Vec<OwnedFd> = (0..3).map(|_| OwnedFd::from(tempfile_like())).collect();
    let inodes: Vec<u64> = files.iter().map(inode).collect();
    a.attach_fds(files).expect("attach");
    a.write_all(b"with fds").expect("send");
    a.write_all(b", without").expect("send");
    let mut got = [0u8; 17];
    b.read_exact(&mut got).expect("receive");
    assert_eq!(&got, b"with fds, without");
    assert!(b.take_fds(4).is_none(), "three came");
    assert_eq!(b.fds_waiting(), 3);
    let fds = b.take_fds(3).expect("three came");
    assert_eq!(fds.iter().map(inode).collect::<Vec<_>>(), inodes);
    assert_eq!(b.take_fds(1).map(|f| f.len()), None);
    assert_eq!(b.fds_waiting(), 0);
    let mut tcp_less =
        Connection::unix(UnixStream::pair().expect("pair").0, watch(&STOP, patient()));
    let too_many = (0..MAX_FDS + 1)
        .map(|_| OwnedFd::from(tempfile_like()))
        .collect();
    assert!(tcp_less.attach_fds(too_many).is_err());
}

fn tempfile_like() -> std::fs::File {
    std::fs::File::open("/proc/self/exe").expect("a file")
}

fn inode(fd: &OwnedFd) -> u64 {
    let file = std::fs::File::from(fd.try_clone().expect("dup"));
    std::os::unix::fs::MetadataExt::ino(&file.metadata().expect("stat"))
}

/// How a watched read on a connection that gets nothing ends, and how long it took.
fn silent_read(
    watch: Watch,
    stop_after: Option<(&'static AtomicBool, Duration)>,
) -> (io::Error, Duration) {
    let (a, _b) = UnixStream::pair().expect("pair");
    a.set_nonblocking(true).expect("non-blocking");
    let mut connection = Connection::unix(a, watch);
    let started = Instant::now();
    let stopper = stop_after.map(|(flag, after)| {
        std::thread::spawn(move || {
            std::thread::sleep(after);
            flag.store(true, Ordering::Release);
        })
    });
    let e = connection.read(&mut [0u8; 4]).expect_err("nothing comes");
    if let Some(stopper) = stopper {
        stopper.join().expect("the stopper");
    }
    (e, started.elapsed())
}

#[test]
fn a_watched_read_gives_up_on_a_stall_and_on_stop() {
    static NEVER: AtomicBool = AtomicBool::new(false);
    let stall = Limits {
        deadline: None,
        stall: Duration::from_millis(50),
    };
    let (e, took) = silent_read(watch(&NEVER, stall), None);
    assert_eq!(e.kind(), io::ErrorKind::TimedOut);
    assert_eq!(
        WaitError::of(&e).map(|w| w.end),
        Some(WaitEnd::Stalled(Duration::from_millis(50)))
    );
    assert!(e.to_string().contains("the test's bytes"), "{e}");
    // At the stall, not later: a hang guard that leaves a slow machine room.
    assert!(took < SHORT, "{took:?}");

    // A signal cuts a patient wait short: long before the patience's stall.
    static SIGNALLED: AtomicBool = AtomicBool::new(false);
    let (e, took) = silent_read(
        watch(&SIGNALLED, patient()),
        Some((&SIGNALLED, Duration::from_millis(100))),
    );
    assert!(e.to_string().contains("signal"), "{e}");
    assert_ne!(
        e.kind(),
        io::ErrorKind::Interrupted,
        "read_exact would retry"
    );
    assert!(took < SHORT, "{took:?}");
}

#[test]
fn a_cancel_or_the_deadline_ends_a_wait_and_names_what_it_waited_for() {
    static NEVER: AtomicBool = AtomicBool::new(false);
    let cancel = Arc::new(AtomicBool::new(false));
    let watch = Watch::new(&NEVER, Some(Arc::clone(&cancel)), "an answer", patient());
    let flag = Arc::clone(&cancel);
    let (a, mut peer) = UnixStream::pair().expect("pair");
    a.set_nonblocking(true).expect("non-blocking");
    let mut connection = Connection::unix(a, watch.clone());
    let canceller = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(100));
        flag.store(true, Ordering::Release);
    });
    let started = Instant::now();
    let e = connection.read(&mut [0u8; 4]).expect_err("cancelled");
    canceller.join().expect("the canceller");
    assert!(started.elapsed() < SHORT, "cut short of the 10 s stall");
    assert_eq!(
        e.to_string(),
        "waiting for an answer: a client cancelled it"
    );

    // The deadline, shared by every handle, as the owner moves on.
    cancel.store(false, Ordering::Release);
    let deadline = Instant::now() + GRACE + Duration::from_millis(300);
    watch.expect(
        "the other side to take bytes",
        Limits {
            deadline: Some(deadline),
            stall: Duration::from_secs(10),
        },
    );
    let mut writer = connection.try_clone().expect("clone");
    // The socket's buffer fills, then the writes wait until the deadline.
    let e = loop {
        if let Err(e) = writer.write(&[0u8; 65536]) {
            break e;
        }
    };
    assert!(Instant::now() >= deadline);
    assert!(
        Instant::now() < deadline + SHORT,
        "not waited out to the stall"
    );
    assert!(
        matches!(WaitError::of(&e).map(|w| w.end), Some(WaitEnd::Deadline(_))),
        "{e}"
    );
    assert!(
        e.to_string().contains("the other side to take bytes"),
        "{e}"
    );
    // A wait that begins past the deadline gets a moment, no more.
    let late = Instant::now();
    let e = writer.write(&[0u8; 65536]).expect_err("still full");
    assert!(late.elapsed() >= GRACE, "{e}");
    assert!(late.elapsed() < GRACE + SHORT, "{e}");
    // What is there is taken even so: the limits end waits, not reads.
    peer.write_all(b"late").expect("the peer writes");
    let mut got = [0u8; 4];
    connection
        .read_exact(&mut got)
        .expect("taken past the deadline");
    assert_eq!(&got, b"late");
}

#[test]
fn connecting_to_a_full_backlog_waits_watched_and_to_nothing_fails_at_once() {
    static NEVER: AtomicBool = AtomicBool::new(false);
    let dir = std::env::temp_dir().join(format!("tinyvmm-transport-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a folder");
    let path = dir.join("backlog.sock");
    let _ = std::fs::remove_file(&path);
    let endpoint = Endpoint::Unix(path.clone());
    let limits = Limits {
        deadline: Some(Instant::now() + Duration::from_millis(300)),
        stall: Duration::from_secs(10),
    };
    let e = endpoint
        .connect(watch(&NEVER, limits))
        .expect_err("nothing listens");
    assert!(WaitError::of(&e).is_none(), "{e}");
    // A listener that never accepts: its backlog fills, and a connect then waits.
    let _listener = UnixListener::bind(&path).expect("bind");
    let mut held = Vec::new();
    let e = loop {
        match endpoint.connect(watch(&NEVER, limits)) {
            Ok(c) => held.push(c),
            Err(e) => break e,
        }
        assert!(held.len() < 10_000, "the backlog never filled");
    };
    assert!(
        matches!(WaitError::of(&e).map(|w| w.end), Some(WaitEnd::Deadline(_))),
        "{e}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_fifo_or_a_device_is_no_endpoint() {
    static NEVER: AtomicBool = AtomicBool::new(false);
    let dir = std::env::temp_dir().join(format!("tinyvmm-fifo-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a folder");
    let fifo = dir.join("fifo");
    let _ = std::fs::remove_file(&fifo);
    let c_path = std::ffi::CString::new(fifo.as_os_str().as_bytes()).expect("no NUL");
    // SAFETY: mkfifo reads the NUL-terminated path, valid for the call.
    assert_eq!(unsafe { libc::mkfifo(c_path.as_ptr(), 0o600) }, 0);
    for (path, is) in [
        (fifo.clone(), "is a FIFO"),
        ("/dev/null".into(), "is a device"),
    ] {
        let endpoint = Endpoint::Unix(path);
        let e = endpoint.listen().expect_err("no listener there");
        assert!(e.to_string().contains(is), "{e}");
        let e = endpoint
            .connect(watch(&NEVER, patient()))
            .expect_err("no socket there");
        assert!(e.to_string().contains(is), "{e}");
    }
    assert!(fifo.exists(), "left as it was");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn tcp_connects_watched() {
    static NEVER: AtomicBool = AtomicBool::new(false);
    let listener = TcpListener::bind("127.0.0.1:0").expect("a port");
    let port = listener.local_addr().expect("its address").port();
    let endpoint = Endpoint::Tcp(format!("127.0.0.1:{port}"));
    let mut connection = endpoint.connect(watch(&NEVER, patient())).expect("connect");
    let (mut other, _) = listener.accept().expect("accept");
    connection.write_all(b"over tcp").expect("send");
    let mut got = [0u8; 8];
    other.read_exact(&mut got).expect("receive");
    assert_eq!(&got, b"over tcp");
    drop(listener);
    let e = endpoint
        .connect(watch(&NEVER, patient()))
        .expect_err("nothing listens");
    assert_eq!(e.kind(), io::ErrorKind::ConnectionRefused, "{e}");
}
