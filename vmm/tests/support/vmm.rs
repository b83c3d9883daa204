//! A VMM for a test. [`Vmm`] is a `tinyvmm` process: spawned with its API on a socket of its
//! own (or none), waited for until it serves (or listens for a migration), its stderr kept all
//! along (read by a thread, so that a talkative VMM never blocks on a full pipe, or written to
//! a file the test names) and printed when the test fails, its stdout dropped or written to a
//! file (a Linux guest's console), and killed if the test ends before it does. [`InProcess`] serves from a thread
//! of the test's own process, stopped when dropped.
//!
//! ```ignore
//! let vmm = Vmm::serve("name", 4, 16, &[]);
//! let (destination, listen) = Vmm::receive("name", &[]);
//! let restored = Vmm::restore("name", &state, &mem, &["--mem-backend", "uffd"]);
//! let other = Vmm::command("name").args(["boot", "--kernel"]).arg(&vmlinux).serving();
//! ```

use std::ffi::{OsStr, OsString};
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tinyvmm::api::client::Client;
use tinyvmm::jobs::serve::{serve_in_background, ServeConfig, ServeError};
use tinyvmm::lifecycle::Ending;

/// A path in the temporary folder unique to this test process and `name` (a socket, a file).
pub fn temp_path(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("tinyvmm-test-{}-{name}", std::process::id()))
}

/// How long a VMM may take to serve its API (or to listen): a guard against a hang only.
const START_LIMIT: Duration = Duration::from_secs(120);
/// How long a VMM asked to stop may take to exit: a guard against a hang only.
const STOP_LIMIT: Duration = Duration::from_secs(120);

/// A `tinyvmm` command line to start: its arguments, then `--api-sock` and its socket (unless
/// [`Spawn::no_api`]).
#[must_use = "a command does nothing until it is spawned"]
pub struct Spawn {
    name: String,
    args: Vec<OsString>,
    api: Option<PathBuf>,
    nofile: Option<libc::rlimit>,
    stdout: Option<PathBuf>,
    stderr: Option<PathBuf>,
}

impl Spawn {
    /// Adds an argument.
    pub fn arg(mut self, arg: impl AsRef<OsStr>) -> Self {
        self.args.push(arg.as_ref().to_owned());
        self
    }

    /// Adds arguments.
    pub fn args<S: AsRef<OsStr>>(mut self, args: impl IntoIterator<Item = S>) -> Self {
        self.args
            .extend(args.into_iter().map(|a| a.as_ref().to_owned()));
        self
    }

    /// Puts the API socket at `api` instead of [`temp_path`]`("NAME.sock")`.
    pub fn api_sock(mut self, api: impl Into<PathBuf>) -> Self {
        self.api = Some(api.into());
        self
    }

    /// Starts it without `--api-sock`: no API to call or wait for.
    pub fn no_api(mut self) -> Self {
        self.api = None;
        self
    }

    /// Writes its stdout (a Linux guest's console) to the file `path` (created, or emptied)
    /// instead of dropping it; [`Vmm::stdout_now`] reads it.
    pub fn stdout_file(mut self, path: impl Into<PathBuf>) -> Self {
        self.stdout = Some(path.into());
        self
    }

    /// Writes its stderr to the file `path` (created, or emptied) instead of keeping it in
    /// memory; [`Vmm::stderr_now`] and the [`Output`]s read it from there.
    pub fn stderr_file(mut self, path: impl Into<PathBuf>) -> Self {
        self.stderr = Some(path.into());
        self
    }

    /// Starts it under an open-file limit of `soft` (hard limit `hard`).
    pub fn nofile(mut self, soft: u64, hard: u64) -> Self {
        self.nofile = Some(libc::rlimit {
            rlim_cur: soft,
            rlim_max: hard,
        });
        self
    }

    /// Starts it, without waiting for anything.
    pub fn spawn(self) -> Vmm {
        let mut command = Command::new(env!("CARGO_BIN_EXE_tinyvmm"));
        command.args(&self.args);
        if let Some(api) = &self.api {
            let _ = std::fs::remove_file(api);
            command.arg("--api-sock").arg(api);
        }
        let file = |path: &Path| std::fs::File::create(path).expect("a file for its output");
        command.stdin(Stdio::null()).stdout(match &self.stdout {
            Some(path) => Stdio::from(file(path)),
            None => Stdio::null(),
        });
        command.stderr(match &self.stderr {
            Some(path) => Stdio::from(file(path)),
            None => Stdio::piped(),
        });
        if let Some(limit) = self.nofile {
            use std::os::unix::process::CommandExt;
            let lower = move || {
                // SAFETY: setrlimit reads one valid `rlimit`.
                match unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &limit) } {
                    0 => Ok(()),
                    _ => Err(std::io::Error::last_os_error()),
                }
            };
            // SAFETY: `lower` runs in the child between fork and exec and calls only
            // setrlimit, which is async-signal-safe; it allocates nothing and takes no lock.
            unsafe { command.pre_exec(lower) };
        }
        let mut child = command.spawn().expect("tinyvmm starts");
        let (stderr, reader) = match (self.stderr, child.stderr.take()) {
            (Some(path), _) => (Stderr::File(path), None),
            (None, pipe) => {
                let pipe = pipe.expect("piped");
                let kept = Arc::new(Mutex::new(Vec::new()));
                let reader = std::thread::spawn({
                    let kept = Arc::clone(&kept);
                    move || {
                        let mut pipe = pipe;
                        let mut chunk = [0u8; 4096];
                        while let Ok(n @ 1..) = pipe.read(&mut chunk) {
                            kept.lock()
                                .expect("not poisoned")
                                .extend_from_slice(&chunk[..n]);
                        }
                    }
                });
                (Stderr::Kept(kept), Some(reader))
            }
        };
        Vmm {
            name: self.name,
            child: Some(child),
            api: self.api,
            listen: None,
            killed: false,
            stdout: self.stdout,
            stderr,
            reader,
        }
    }

    /// Starts it and waits until its API serves a VM ([`Vmm::wait_for_vm`]).
    #[track_caller]
    pub fn serving(self) -> Vmm {
        let vmm = self.spawn();
        vmm.wait_for_vm();
        vmm
    }

    /// Starts it (a `receive`) and waits until it listens ([`Vmm::wait_listening`]).
    #[track_caller]
    pub fn listening(self) -> Vmm {
        let vmm = self.spawn();
        vmm.wait_listening();
        vmm
    }
}

/// Where a VMM's stderr goes.
enum Stderr {
    /// Read by a thread into memory.
    Kept(Arc<Mutex<Vec<u8>>>),
    /// Written to this file.
    File(PathBuf),
}

/// A `tinyvmm` process, killed if the test ends before it exits; if the test fails, what it
/// said on stderr is printed.
pub struct Vmm {
    name: String,
    child: Option<Child>,
    api: Option<PathBuf>,
    /// The socket a `receive` listens on.
    listen: Option<PathBuf>,
    /// Whether it was killed, so that the files it would have removed are left to [`Drop`].
    killed: bool,
    /// The file its stdout goes to, if any.
    stdout: Option<PathBuf>,
    stderr: Stderr,
    /// The thread that reads a kept stderr.
    reader: Option<JoinHandle<()>>,
}

impl Vmm {
    /// `tinyvmm` named `name` (in messages, and its socket [`temp_path`]`("NAME.sock")`),
    /// with no arguments yet.
    pub fn command(name: &str) -> Spawn {
        Spawn {
            name: name.to_owned(),
            args: Vec::new(),
            api: Some(temp_path(&format!("{name}.sock"))),
            nofile: None,
            stdout: None,
            stderr: None,
        }
    }

    /// `tinyvmm serve` with `slots` slots over `mem_mib` MiB, and `extra` arguments, serving
    /// on [`temp_path`]`("NAME.sock")`.
    #[track_caller]
    pub fn serve(name: &str, slots: usize, mem_mib: u64, extra: &[&str]) -> Vmm {
        Vmm::command(name)
            .args(["serve", "--slots", &slots.to_string()])
            .args(["--mem-mib", &mem_mib.to_string()])
            .args(extra)
            .serving()
    }

    /// `tinyvmm restore` of `state` and `mem` with `extra` arguments, serving (paused as
    /// restored) on [`temp_path`]`("NAME-restore.sock")`.
    #[track_caller]
    pub fn restore(name: &str, state: &Path, mem: &Path, extra: &[&str]) -> Vmm {
        Vmm::command(name)
            .api_sock(temp_path(&format!("{name}-restore.sock")))
            .arg("restore")
            .arg("--snapshot")
            .arg(state)
            .arg("--mem-file")
            .arg(mem)
            .args(extra)
            .serving()
    }

    /// `tinyvmm receive` with `extra` arguments, listening on the returned Unix socket path
    /// ([`temp_path`]`("NAME-receive.mig")`), its API on `NAME-receive.sock`.
    #[track_caller]
    pub fn receive(name: &str, extra: &[&str]) -> (Vmm, PathBuf) {
        let listen = temp_path(&format!("{name}-receive.mig"));
        let _ = std::fs::remove_file(&listen);
        let mut vmm = Vmm::command(name)
            .api_sock(temp_path(&format!("{name}-receive.sock")))
            .args(["receive", "--listen", &format!("unix:{}", listen.display())])
            .args(extra)
            .listening();
        vmm.listen = Some(listen.clone());
        (vmm, listen)
    }

    /// Its API socket.
    #[track_caller]
    pub fn api(&self) -> &Path {
        self.api
            .as_deref()
            .expect("a VMM spawned with an API socket")
    }

    /// Its process id.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("not waited for yet").id()
    }

    /// Whether it still runs (a zombie does not: it has exited, only not been waited for).
    pub fn running(&self) -> bool {
        let Some(child) = self.child.as_ref() else {
            return false;
        };
        // A zombie still has a /proc entry: look at its state.
        std::fs::read_to_string(format!("/proc/{}/stat", child.id()))
            .is_ok_and(|s| s.split(' ').nth(2).is_none_or(|state| state != "Z"))
    }

    /// What it has said on stderr so far.
    pub fn stderr_now(&self) -> String {
        match &self.stderr {
            Stderr::Kept(kept) => {
                String::from_utf8_lossy(&kept.lock().expect("not poisoned")).into_owned()
            }
            Stderr::File(path) => read_lossy(path),
        }
    }

    /// What it has written to stdout so far ([`Spawn::stdout_file`]: a Linux guest's console).
    #[track_caller]
    pub fn stdout_now(&self) -> String {
        read_lossy(
            self.stdout
                .as_deref()
                .expect("a VMM spawned with a stdout file"),
        )
    }

    /// Waits until its stdout (a Linux guest's console: [`Spawn::stdout_file`]) shows
    /// `marker`; fails if it exits first, or if the guest prints nothing for the host's
    /// patience ([`super::Progress`]), however long the whole wait takes.
    pub fn wait_for_console(&self, marker: &str) {
        let mut progress = super::Progress::default();
        loop {
            let console = self.stdout_now();
            if console.contains(marker) {
                return;
            }
            assert!(
                self.running(),
                "tinyvmm ended before its console showed {marker:?}:\n{console}"
            );
            assert!(
                !progress.stalled(console.len()),
                "no {marker:?}: the guest printed nothing for {:?}; its last lines:\n{}",
                progress.patience(),
                super::tail(&console, 20)
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Waits until it serves a VM: its socket answers `GET /vm` with a state past `Waiting`
    /// and `Receiving` (a destination's socket answers before its VM runs, and may close a
    /// connection unanswered while the VM's server takes over). Fails if it exits first.
    #[track_caller]
    pub fn wait_for_vm(&self) {
        self.wait_until("serve its API", START_LIMIT, Vmm::serves_vm);
    }

    /// Waits until it serves a VM, as [`Vmm::wait_for_vm`] does; why not (with the end of
    /// its stderr if it exited first), for a test that tells the failure on.
    pub fn try_wait_for_vm(&self) -> Result<(), String> {
        let deadline = Instant::now() + START_LIMIT;
        while !self.serves_vm() {
            if !self.running() {
                return Err(format!(
                    "{} exited before it served a VM: {}",
                    self.name,
                    super::tail(&self.stderr_now(), 5)
                ));
            }
            if Instant::now() > deadline {
                return Err(format!("{}: no VM within {START_LIMIT:?}", self.name));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        Ok(())
    }

    /// Whether its socket answers `GET /vm` with a VM: 200 and a state past `Waiting` and
    /// `Receiving`.
    fn serves_vm(&self) -> bool {
        let vm = Client::connect(self.api()).and_then(|mut c| c.call("GET", "/vm", None));
        vm.is_ok_and(|(status, vm)| {
            status == 200 && !matches!(vm["state"].as_str(), Some("Waiting" | "Receiving"))
        })
    }

    /// Waits until its API socket takes a connection (a Linux guest's VMM before the guest
    /// gets far: any state).
    #[track_caller]
    pub fn wait_for_api(&self) {
        self.wait_until("serve its API", START_LIMIT, |vmm| {
            Client::connect(vmm.api()).is_ok()
        });
    }

    /// Waits until a `receive` listens for its source: its API answers `GET /vm` with
    /// `Waiting` from then on. (The listening socket's file alone does not say so: it appears
    /// when bound, a moment before it listens.)
    #[track_caller]
    pub fn wait_listening(&self) {
        self.wait_until("listen for its source", START_LIMIT, |vmm| {
            let vm = Client::connect(vmm.api()).and_then(|mut c| c.call("GET", "/vm", None));
            vm.is_ok_and(|(_, vm)| vm["state"] == "Waiting")
        });
    }

    /// Waits until its API socket's file is there, without a request (for a test that
    /// counts the requests the VMM logs).
    #[track_caller]
    pub fn wait_for_socket_file(&self) {
        self.wait_until("create its API socket", START_LIMIT, |vmm| {
            vmm.api().exists()
        });
    }

    /// Polls `done` until it holds; fails after `limit` (a guard against a hang), or if the
    /// process exits first.
    #[track_caller]
    pub fn wait_until(&self, what: &str, limit: Duration, mut done: impl FnMut(&Vmm) -> bool) {
        let deadline = Instant::now() + limit;
        while !done(self) {
            // Its stderr is printed as it is dropped.
            assert!(
                self.running(),
                "{}: tinyvmm exited before it could {what}",
                self.name
            );
            assert!(
                Instant::now() < deadline,
                "{}: tinyvmm did not {what} within {limit:?}",
                self.name
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// One request to its API: the status and the body.
    #[track_caller]
    pub fn call(&self, method: &str, path: &str, body: Option<Value>) -> (u16, Value) {
        super::call(self.api(), method, path, body)
    }

    /// A request that must succeed (2xx): its body.
    #[track_caller]
    pub fn ok(&self, method: &str, path: &str, body: Option<Value>) -> Value {
        super::ok(self.api(), method, path, body)
    }

    /// A test-guest command over `[start, end)` that must be answered 2xx: its answer.
    #[track_caller]
    pub fn guest(&self, op: &str, start: u64, end: u64, seed: u64) -> Value {
        let command = super::guest_command(op, start, end, seed);
        self.ok("PUT", "/guest/command", Some(command))
    }

    /// Pauses (`"Paused"`) or resumes (`"Resumed"`) the VM; it must succeed.
    #[track_caller]
    pub fn set_state(&self, state: &str) {
        self.ok("PATCH", "/vm", Some(json!({"state": state})));
    }

    /// Sends it `signal`.
    #[track_caller]
    pub fn signal(&self, signal: libc::c_int) {
        // SAFETY: kill(2) only sends a signal to the child's pid, which has not been waited
        // for yet (`pid` says so), so it is still this child's.
        let sent = unsafe { libc::kill(self.pid() as libc::pid_t, signal) };
        assert_eq!(sent, 0, "kill");
    }

    /// Kills it (SIGKILL); its status and stderr.
    #[track_caller]
    pub fn kill(&mut self) -> Output {
        let child = self.child.as_mut().expect("not waited for yet");
        child.kill().expect("kill -9");
        self.killed = true;
        self.wait_for_exit()
    }

    /// Waits for it to exit (it was asked to); fails after `timeout` (a guard against a
    /// hang). Its status and stderr.
    #[track_caller]
    pub fn wait(&mut self, timeout: Duration) -> Output {
        let deadline = Instant::now() + timeout;
        while self.running() {
            assert!(
                Instant::now() < deadline,
                "{}: tinyvmm did not exit in {timeout:?}",
                self.name
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        self.wait_for_exit()
    }

    /// Waits (at most `timeout`) for a migration's source to end as one that migrated does:
    /// with status 0, saying that the VM runs on the destination.
    #[track_caller]
    pub fn wait_migrated(&mut self, timeout: Duration) {
        let output = self.wait(timeout);
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(0), "{stderr}");
        assert!(
            stderr.contains("runs on the migration's destination"),
            "{stderr}"
        );
    }

    /// Asks it to stop (`PUT /actions` Stop, whatever the answer) and waits for it to exit.
    #[track_caller]
    pub fn stop(mut self) -> Output {
        let _ = super::call(
            self.api(),
            "PUT",
            "/actions",
            Some(json!({"action_type": "Stop"})),
        );
        self.wait(STOP_LIMIT)
    }

    /// Its status and stderr if it has exited, without waiting.
    #[track_caller]
    pub fn try_exited(&mut self) -> Option<Output> {
        let child = self.child.as_mut().expect("not waited for yet");
        child.try_wait().expect("waitpid")?;
        Some(self.wait_for_exit())
    }

    /// Waits for the child (it has exited or was killed) and for the rest of its stderr.
    fn wait_for_exit(&mut self) -> Output {
        let status = self
            .child
            .take()
            .expect("not waited for yet")
            .wait()
            .expect("wait");
        if let Some(reader) = self.reader.take() {
            let _ = reader.join();
        }
        let stderr = match &self.stderr {
            Stderr::Kept(kept) => std::mem::take(&mut *kept.lock().expect("not poisoned")),
            Stderr::File(path) => std::fs::read(path).unwrap_or_default(),
        };
        Output {
            status,
            stdout: Vec::new(),
            stderr,
        }
    }
}

impl Drop for Vmm {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            self.killed = true;
            let status = child.wait();
            if let Some(reader) = self.reader.take() {
                let _ = reader.join();
            }
            // A failed test shows what the VMM said.
            if let (true, Ok(status)) = (std::thread::panicking(), status) {
                eprintln!(
                    "tinyvmm {} ({status}) said: {}",
                    self.name,
                    self.stderr_now()
                );
            }
        }
        // A killed VMM could not remove its sockets. (One that ended on its own did, or the
        // test checks that it did.)
        if self.killed {
            if let Some(api) = &self.api {
                let _ = std::fs::remove_file(api);
            }
            if let Some(listen) = &self.listen {
                let _ = std::fs::remove_file(listen);
            }
        }
    }
}

/// The file at `path` as text (empty if it cannot be read).
fn read_lossy(path: &Path) -> String {
    String::from_utf8_lossy(&std::fs::read(path).unwrap_or_default()).into_owned()
}

/// A VMM serving its API from a thread of this test process (`serve_in_background`), for a
/// test that needs no process of its own; stopped when dropped.
pub struct InProcess {
    socket: PathBuf,
    thread: Option<JoinHandle<Result<Ending, ServeError>>>,
}

impl InProcess {
    /// Starts a VMM with `config`, serving once this returns.
    #[track_caller]
    pub fn start(config: ServeConfig) -> InProcess {
        let socket = config.api_sock.clone();
        let thread = serve_in_background(config).expect("the VMM starts");
        InProcess {
            socket,
            thread: Some(thread),
        }
    }

    /// Its API socket.
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// One request to its API: the status and the body.
    #[track_caller]
    pub fn call(&self, method: &str, path: &str, body: Option<Value>) -> (u16, Value) {
        super::call(&self.socket, method, path, body)
    }

    /// A request that must succeed (2xx): its body.
    #[track_caller]
    pub fn ok(&self, method: &str, path: &str, body: Option<Value>) -> Value {
        super::ok(&self.socket, method, path, body)
    }

    /// Sends raw bytes on a new connection; returns the status and the JSON body.
    #[track_caller]
    pub fn raw(&self, bytes: &[u8]) -> (u16, Value) {
        Client::connect(&self.socket)
            .expect("connect")
            .raw(bytes)
            .expect("an answer")
    }

    /// Stops it through its API and waits until it has ended (its memory and loader
    /// dropped): a client's Stop is a clean end, and the socket is removed.
    #[track_caller]
    pub fn stop(self) {
        let (status, body) = self.call("PUT", "/actions", Some(json!({"action_type": "Stop"})));
        assert_eq!(status, 204, "{body}");
        let socket = self.socket.clone();
        let ending = self.ended().expect("clean stop");
        assert_eq!(ending, Ending::Finished, "a client's Stop is a clean end");
        assert!(!socket.exists(), "the socket is removed at the end");
    }

    /// Waits until it has ended (asked to elsewhere): how. Its thread must not panic.
    #[track_caller]
    pub fn ended(mut self) -> Result<Ending, ServeError> {
        let thread = self.thread.take().expect("running");
        thread.join().expect("no panic")
    }
}

impl Drop for InProcess {
    fn drop(&mut self) {
        if let Some(thread) = self.thread.take() {
            if let Ok(mut client) = Client::connect(&self.socket) {
                let _ = client.call("PUT", "/actions", Some(&json!({"action_type": "Stop"})));
            }
            let _ = thread.join();
        }
    }
}
