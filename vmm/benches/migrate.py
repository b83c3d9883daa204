#!/usr/bin/env python3
"""Live migration between two `tinyvmm` processes, against the Unix socket's raw throughput and
QEMU's migration of the same memory size, all in the same run.

Per configuration (guest memory size x KVM slots x dirty-log harvest mode): `tinyvmm serve`
starts, the test guest writes every page of its initial memory once (one u64 per 4 KiB page,
stride 4096) and goes idle, `tinyvmm receive` listens on a Unix socket, `PUT /migrate` moves
the VM, and the destination verifies every page the guest wrote before it is stopped: a broken
migration is a failure, never a fast figure. `--workloads idle,loop` adds a second workload in
which the guest keeps rewriting a small range (`write_loop`) during the migration, to show the
rounds and the dirty rate converging.

The baseline: a forked sender writing 1 MiB buffers over a Unix stream socket to a receiver that
reads into one reused buffer, for `--baseline-mib` (3 runs, median). The peer: Debian's
`qemu-system-x86_64` migrating a guest of the same size between two local processes over a Unix
socket (no OS, `-S`; guest memory a file on /dev/shm filled with non-zero data, so that QEMU
cannot skip zero pages).

Python 3 standard library only.

    cargo build --release -p tinyvmm
    python3 vmm/benches/migrate.py                        # the full matrix
    python3 vmm/benches/migrate.py --sizes 512 --slots 2 --modes bitmap --qemu off   # quick
"""
import argparse
import json
import mmap
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MIB = 1 << 20
AREA = 256 * MIB  # where `serve` puts its initial memory
PAGE = 4096
SEED = 0x5EED_0001
LOOP_SEED = 0x100_0000


# ---------------------------------------------------------------------------------------------
# Child processes, cleaned up whatever happens.

CHILDREN = []


class Child:
    """A child process whose stderr lines are read and timestamped by a thread."""

    def __init__(self, name, args, log_dir):
        self.name = name
        self.args = args
        self.lines = []  # (monotonic time, line)
        self.log_path = os.path.join(log_dir, f"{name}.stderr")
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, start_new_session=True)
        CHILDREN.append(self)
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()
        self.exited_at = None

    def _read(self):
        for raw in self.proc.stderr:
            now = time.monotonic()
            line = raw.decode(errors="replace").rstrip("\n")
            self.lines.append((now, line))
            self._log.write(f"{now:.6f} {line}\n")
            self._log.flush()

    def running(self):
        if self.proc.poll() is None:
            return True
        if self.exited_at is None:
            self.exited_at = time.monotonic()
        return False

    def line_with(self, text):
        for t, line in self.lines:
            if text in line:
                return t, line
        return None

    def stderr(self):
        return "\n".join(line for _, line in self.lines)

    def wait(self, timeout):
        deadline = time.monotonic() + timeout
        while self.running():
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} did not exit within {timeout} s")
            time.sleep(0.005)
        self._thread.join(timeout=5)
        return self.proc.returncode

    def kill(self):
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait()
        self._thread.join(timeout=5)
        self._log.close()
        if self in CHILDREN:
            CHILDREN.remove(self)


def kill_children():
    for child in list(CHILDREN):
        child.kill()


def on_sigterm(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def remove(path):
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def wait_for_path(path, child, timeout=120):
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if child is not None and not child.running():
            raise RuntimeError(f"{child.name} exited ({child.proc.returncode}) before {path} "
                               f"appeared: {child.stderr()}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{path} never appeared")
        time.sleep(0.005)


# ---------------------------------------------------------------------------------------------
# The tinyvmm API: HTTP/1.1 + JSON on a Unix socket, Content-Length framing.

class Api:
    """One keep-alive connection to a tinyvmm API socket."""

    def __init__(self, path, timeout=3600):
        self.path = path
        self.timeout = timeout
        self.sock = None

    def connect(self):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(self.path)
        self.sock = sock

    def close(self):
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def call(self, method, path, body=None):
        if self.sock is None:
            self.connect()
        data = b"" if body is None else json.dumps(body).encode()
        head = (f"{method} {path} HTTP/1.1\r\nHost: localhost\r\n"
                f"Content-Length: {len(data)}\r\n\r\n").encode()
        try:
            self.sock.sendall(head + data)
            return self._answer()
        except BaseException:
            self.close()
            raise

    def _answer(self):
        buf = b""
        while True:
            end = buf.find(b"\r\n\r\n")
            if end >= 0:
                head = buf[:end].decode(errors="replace")
                length = 0
                for line in head.split("\r\n")[1:]:
                    key, _, value = line.partition(":")
                    if key.strip().lower() == "content-length":
                        length = int(value)
                if len(buf) >= end + 4 + length:
                    body = buf[end + 4:end + 4 + length]
                    return int(head[9:12]), (json.loads(body) if body else None)
            chunk = self.sock.recv(1 << 16)
            if not chunk:
                raise ConnectionError(f"the API closed the connection after {len(buf)} bytes")
            buf += chunk

    def ok(self, method, path, body=None):
        status, answer = self.call(method, path, body)
        if not 200 <= status < 300:
            raise RuntimeError(f"{method} {path}: {status} {answer}")
        return answer


def one_call(path, method, url, body=None):
    api = Api(path)
    try:
        return api.ok(method, url, body)
    finally:
        api.close()


def wait_for_api(path, child, timeout=600):
    deadline = time.monotonic() + timeout
    while True:
        try:
            one_call(path, "GET", "/vm")
            return
        except (OSError, ConnectionError):
            if not child.running():
                raise RuntimeError(f"{child.name} exited ({child.proc.returncode}) before its API "
                                   f"came up: {child.stderr()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{child.name}'s API never came up")
            time.sleep(0.01)


def guest(op, start, end, seed):
    return {"op": op, "start": start, "end": end, "stride": PAGE, "seed": seed}


# ---------------------------------------------------------------------------------------------
# One tinyvmm migration.

def migrate_tinyvmm(opts, tmp, logs, size_mib, slots, mode, workload, transfer="copy"):
    """Runs one configuration; returns its figures (raises if the migration is broken).
    `transfer` "local" puts the guest's memory in a memfd (`serve --memfd`) and hands it over
    (`"local": true`) instead of copying it."""
    tag = f"{workload}-{size_mib}-{slots}-{mode}-{transfer}"
    src_api = os.path.join(tmp, f"{tag}-src.sock")
    dst_api = os.path.join(tmp, f"{tag}-dst.sock")
    listen = os.path.join(tmp, f"{tag}-mig.sock")
    ring = ["--dirty-ring", str(opts.ring_entries)] if mode == "ring" else []
    if transfer == "local":
        ring.append("--memfd")
    result = {"workload": workload, "mem_mib": size_mib, "slots": slots, "mode": mode,
              "transfer": transfer}
    source = destination = None
    try:
        started = time.monotonic()
        source = Child(f"{tag}-source", [opts.binary, "serve", "--api-sock", src_api,
                                         "--slots", str(slots), "--mem-mib", str(size_mib)]
                       + ring, logs)
        wait_for_api(src_api, source)
        result["serve_up_s"] = time.monotonic() - started
        memory = one_call(src_api, "GET", "/memory")
        # The initial memory: the regions at or above 256 MiB (split over the slots, it may end
        # short of the size asked for by less than a page per slot).
        area = [r for r in memory["regions"] if r["guest_address"] >= AREA]
        end = max(r["guest_address"] + r["size"] for r in area)
        result["area_bytes"] = end - AREA
        result["guest_memory_bytes"] = memory["used"]["guest_memory"]
        result["slots_used"] = memory["slots"]["used"]

        t = time.monotonic()
        wrote = one_call(src_api, "PUT", "/guest/command", guest("write", AREA, end, SEED))
        if wrote.get("result") != "ok":
            raise RuntimeError(f"the guest's write: {wrote}")
        result["guest_write_s"] = time.monotonic() - t
        loop_end = None
        if workload == "loop":
            loop_end = min(end, AREA + opts.loop_mib * MIB)
            one_call(src_api, "PUT", "/guest/command",
                     guest("write_loop", AREA, loop_end, LOOP_SEED))

        destination = Child(f"{tag}-destination", [opts.binary, "receive", "--listen",
                                                   f"unix:{listen}", "--api-sock", dst_api], logs)
        wait_for_path(listen, destination)

        body = {"destination": f"unix:{listen}", "downtime_ms": opts.downtime_ms,
                "timeout_s": opts.timeout_s, "on_timeout": opts.on_timeout,
                "local": transfer == "local"}
        poll = Api(src_api)
        poll.connect()
        t_put = time.monotonic()
        status, answer = poll.call("PUT", "/migrate", body)
        if status != 204:
            raise RuntimeError(f"PUT /migrate: {status} {answer}")
        # Poll on one keep-alive connection: the source exits within one event-loop tick of
        # completing, and only a request on a connection it has already accepted is answered
        # in that window (a new connection is dropped unanswered).
        timeline, last, final, last_pre_t = [], None, None, None
        deadline = t_put + opts.timeout_s + 300
        while True:
            try:
                status, info = poll.call("GET", "/migrate")
            except (OSError, ConnectionError):
                break  # the source has gone
            now = time.monotonic()
            last = info
            if info["phase"] in ("setup", "pre_copy"):
                last_pre_t = now
            key = (info["phase"], info["round"])
            if not timeline or timeline[-1]["key"] != key:
                timeline.append({"key": key, "t_ms": (now - t_put) * 1e3,
                                 "phase": info["phase"], "round": info["round"],
                                 "bytes_sent": info["bytes_sent"],
                                 "pages_left": info["pages_left"],
                                 "dirty_rate_pages_per_second":
                                     info["dirty_rate_pages_per_second"],
                                 "throughput_bytes_per_second":
                                     info["throughput_bytes_per_second"],
                                 "estimated_downtime_ms": info["estimated_downtime_ms"]})
            if info["phase"] in ("completed", "failed", "cancelled"):
                final = info
                break
            if now > deadline:
                raise RuntimeError(f"the migration never ended: {info}")
            time.sleep(opts.poll_ms / 1e3)
        poll.close()
        if final is not None and final["phase"] != "completed":
            raise RuntimeError(f"the migration {final['phase']}: {final.get('error')}")
        code = source.wait(120)
        t_src_exit = source.exited_at
        if code != 0:
            raise RuntimeError(f"the source exited with {code}: {source.stderr()}")
        if source.line_with("runs on the migration's destination") is None:
            raise RuntimeError(f"the source did not say the VM moved: {source.stderr()}")
        wait_for_api(dst_api, destination, 120)
        runs = destination.line_with("the VM runs here after")
        if runs is None:
            raise RuntimeError(f"the destination did not say the VM runs: "
                               f"{destination.stderr()}")
        t_runs, line = runs
        # "the VM runs here after N rounds, X MiB, Y ms (its memory checked against the source's
        # digest in Z ms); serving the API on ..."
        words = line.split("after", 1)[1].split(";")[0].split(",")
        result["dest_rounds"] = int(words[0].split()[0])
        result["dest_mib"] = int(words[1].split()[0])
        result["dest_ms"] = float(words[2].split()[0])
        checked = line.split("digest in ", 1)
        result["dest_check_ms"] = float(checked[1].split()[0]) if len(checked) == 2 else None
        result["dest_line"] = line

        result["total_ms"] = (t_runs - t_put) * 1e3
        result["source_exit_ms"] = (t_src_exit - t_put) * 1e3
        info = final or last
        result["completed_seen"] = final is not None
        result["downtime_ms"] = final["downtime_ms"] if final else None
        if result["downtime_ms"] is None:
            # The source says it as it leaves: "..., paused X ms".
            said = source.line_with("paused ")
            if said is not None:
                try:
                    result["downtime_ms"] = float(said[1].rsplit("paused ", 1)[1].split()[0])
                except (IndexError, ValueError):
                    pass
        result["source_elapsed_ms"] = final["elapsed_ms"] if final else None
        result["bytes_sent"] = info["bytes_sent"]
        result["rounds"] = info["round"]
        result["throughput_bytes_per_second"] = (info["bytes_sent"] / (t_runs - t_put))
        result["round1_throughput_bytes_per_second"] = next(
            (e["throughput_bytes_per_second"] for e in timeline
             if e["throughput_bytes_per_second"] > 0), None)
        firsts = {}
        for e in timeline:
            firsts.setdefault("pre_copy" if e["phase"] == "pre_copy" else e["phase"], e["t_ms"])
            if e["phase"] == "pre_copy" and e["round"] >= 2:
                firsts.setdefault("round2", e["t_ms"])
        result["t_pre_copy_ms"] = firsts.get("pre_copy")
        result["t_round1_end_ms"] = firsts.get("round2", firsts.get("stop_and_copy",
                                                                   firsts.get("completed")))
        # If the completed answer was missed: the pause began after the last pre-copy answer
        # and before the first stop-and-copy one.
        last_pre = None if last_pre_t is None else (last_pre_t - t_put) * 1e3
        first_stop = firsts.get("stop_and_copy")
        total_ms = result["total_ms"]
        result["downtime_bounds_ms"] = [None if first_stop is None else total_ms - first_stop,
                                        None if last_pre is None else total_ms - last_pre]
        paused_at = (final["elapsed_ms"] - final["downtime_ms"]) if final else first_stop
        result["forced_at_timeout"] = (paused_at is not None
                                       and paused_at >= opts.timeout_s * 1e3)
        # Forced before the timeout: the harvest alone outlasted the budget.
        result["forced"] = bool(final and final.get("forced"))
        result["timeline"] = [{k: v for k, v in e.items() if k != "key"} for e in timeline]

        # The destination holds every page the guest wrote (and a running loop's last pass).
        t = time.monotonic()
        if workload == "loop":
            stopped = one_call(dst_api, "PUT", "/guest/command", {"op": "stop_loop", "vcpu": 0})
            if stopped.get("result") != "stopped":
                raise RuntimeError(f"stop_loop on the destination: {stopped}")
            result["loop_passes"] = stopped.get("passes")
            checks = [(AREA, loop_end, stopped["last_seed"]), (loop_end, end, SEED)]
        else:
            checks = [(AREA, end, SEED)]
        for start, stop, seed in checks:
            if start >= stop:
                continue
            verified = one_call(dst_api, "PUT", "/guest/command",
                                guest("verify", start, stop, seed))
            if verified.get("result") != "ok":
                raise RuntimeError(f"VERIFY FAILED on the destination [{start:#x}, {stop:#x}) "
                                   f"seed {seed}: {verified}")
        result["verify_s"] = time.monotonic() - t
        result["verified"] = True
        one_call(dst_api, "PUT", "/actions", {"action_type": "Stop"})
        code = destination.wait(120)
        if code != 0:
            raise RuntimeError(f"the destination exited with {code}: {destination.stderr()}")
        return result
    finally:
        for child in (source, destination):
            if child is not None:
                child.kill()
        for path in (src_api, dst_api, listen):
            remove(path)


# ---------------------------------------------------------------------------------------------
# The baseline: a Unix stream socket's raw throughput.

def socket_once(tmp, nbytes, chunk, fresh=False):
    """Bytes per second through a Unix stream socket, 1 MiB writes. Raw: from one buffer into
    one reused buffer. `fresh`: as a copy migration moves memory, from `nbytes` of populated
    memory the sender holds into `nbytes` of new anonymous memory the receiver touches for the
    first time."""
    path = os.path.join(tmp, "baseline.sock")
    remove(path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)
    pid = os.fork()
    if pid == 0:  # the sender
        code = 1
        try:
            listener.close()
            buf = memoryview(bytes(range(1, 256)) * (chunk // 255 + 1))[:chunk]
            if fresh:
                # Like a source's guest: `nbytes` of populated memory, sent from where it is.
                held = mmap.mmap(-1, nbytes)
                for off in range(0, nbytes, chunk):
                    held[off:off + chunk] = buf[:min(chunk, nbytes - off)]
                whole = memoryview(held)
            out = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            out.connect(path)
            sent = 0
            while sent < nbytes:
                n = min(chunk, nbytes - sent)
                out.sendall(whole[sent:sent + n] if fresh else buf[:n])
                sent += n
            out.close()
            code = 0
        finally:
            os._exit(code)
    try:
        conn, _ = listener.accept()
        if fresh:
            area = mmap.mmap(-1, nbytes)
            whole = memoryview(area)
        else:
            buf = bytearray(chunk)
            view = memoryview(buf)
        got = 0
        start = time.monotonic()
        while got < nbytes:
            n = conn.recv_into(whole[got:got + chunk] if fresh else view)
            if n == 0:
                raise RuntimeError(f"the baseline sender stopped after {got} bytes")
            got += n
        elapsed = time.monotonic() - start
        conn.close()
        if fresh:
            whole.release()
            area.close()
    finally:
        _, status = os.waitpid(pid, 0)
        listener.close()
        remove(path)
    if status != 0:
        raise RuntimeError(f"the baseline sender failed ({status})")
    return nbytes / elapsed


def socket_baseline(tmp, nbytes, runs):
    rates = [socket_once(tmp, nbytes, MIB) for _ in range(runs)]
    fresh = [socket_once(tmp, nbytes, MIB, fresh=True) for _ in range(runs)]
    return {"bytes": nbytes, "chunk": MIB, "runs_bytes_per_second": rates,
            "bytes_per_second": statistics.median(rates),
            "fresh_memory_runs_bytes_per_second": fresh,
            "fresh_memory_bytes_per_second": statistics.median(fresh)}


# ---------------------------------------------------------------------------------------------
# The peer: QEMU migrating a guest of the same memory size between two local processes.

QEMU = "qemu-system-x86_64"


class Qmp:
    def __init__(self, path, timeout=60):
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                self.sock.settimeout(timeout)
                self.sock.connect(path)
                break
            except OSError:
                self.sock.close()
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02)
        self.file = self.sock.makefile("rb")
        self._read()  # the greeting
        self.execute("qmp_capabilities")

    def _read(self):
        while True:
            line = self.file.readline()
            if not line:
                raise ConnectionError("QMP closed")
            message = json.loads(line)
            if "event" not in message:
                return message

    def execute(self, command, **arguments):
        request = {"execute": command}
        if arguments:
            request["arguments"] = arguments
        self.sock.sendall(json.dumps(request).encode() + b"\n")
        answer = self._read()
        if "error" in answer:
            raise RuntimeError(f"QMP {command}: {answer['error']}")
        return answer["return"]

    def close(self):
        self.file.close()
        self.sock.close()


def qemu_available(opts):
    """(path or None, why not)."""
    path = shutil.which(QEMU)
    if path:
        return path, None
    if opts.qemu != "on":
        return None, f"{QEMU} is not installed (--qemu on installs qemu-system-x86)"
    print("installing qemu-system-x86 (apt-get) ...", file=sys.stderr)
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    done = subprocess.run(["apt-get", "install", "-y", "--no-install-recommends",
                           "qemu-system-x86"], env=env, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE)
    path = shutil.which(QEMU)
    if path:
        return path, None
    return None, (f"apt-get install qemu-system-x86 failed ({done.returncode}): "
                  f"{done.stderr.decode(errors='replace').strip()[-300:]}")


def fill_file(path, size_mib):
    """A guest memory file of non-zero pages: page p's first u64 is p ^ SEED, the rest 0xA5."""
    page = bytearray(b"\xa5" * PAGE)
    with open(path, "wb") as f:
        for mib in range(size_mib):
            chunk = bytearray()
            for i in range(MIB // PAGE):
                p = mib * (MIB // PAGE) + i
                page[:8] = (p ^ SEED).to_bytes(8, "little")
                chunk += page
            f.write(chunk)


def migrate_qemu(opts, tmp, logs, qemu, size_mib, accels):
    """Migrates an OS-less QEMU guest of `size_mib`; the first accelerator that starts wins."""
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else tmp
    mem_file = os.path.join(shm, f"tinyvmm-migrate-bench-{os.getpid()}-qemu-{size_mib}.mem")
    listen = os.path.join(tmp, f"qemu-{size_mib}-mig.sock")
    result = {"mem_mib": size_mib}
    tried = []
    try:
        t = time.monotonic()
        fill_file(mem_file, size_mib)
        result["fill_s"] = time.monotonic() - t
        for accel in accels:
            source = destination = None
            try:
                common = ["-nodefaults", "-display", "none", "-S", "-accel", accel,
                          "-machine", "pc,memory-backend=mem", "-m", f"{size_mib}M"]
                dst_qmp = os.path.join(tmp, f"qemu-{size_mib}-dst-qmp.sock")
                src_qmp = os.path.join(tmp, f"qemu-{size_mib}-src-qmp.sock")
                destination = Child(f"qemu-{size_mib}-{accel}-destination", [
                    qemu, *common, "-object", f"memory-backend-ram,id=mem,size={size_mib}M",
                    "-qmp", f"unix:{dst_qmp},server=on,wait=off",
                    "-incoming", f"unix:{listen}"], logs)
                try:
                    wait_for_path(listen, destination, 60)
                except RuntimeError as e:
                    tried.append(f"{accel}: {e}")
                    continue
                source = Child(f"qemu-{size_mib}-{accel}-source", [
                    qemu, *common, "-object",
                    f"memory-backend-file,id=mem,size={size_mib}M,mem-path={mem_file},share=off",
                    "-qmp", f"unix:{src_qmp},server=on,wait=off"], logs)
                try:
                    wait_for_path(src_qmp, source, 60)
                    qmp = Qmp(src_qmp)
                except (RuntimeError, OSError, ConnectionError) as e:
                    tried.append(f"{accel}: {e} {source.stderr()}")
                    continue
                result["accel"] = accel
                result["version"] = qmp.execute("query-version")["qemu"]
                # QEMU's default bandwidth cap (128 MiB/s in 7.2) would measure the cap: lift it.
                qmp.execute("migrate-set-parameters", **{"max-bandwidth": 100 << 30,
                                                          "downtime-limit": opts.downtime_ms})
                t_put = time.monotonic()
                qmp.execute("migrate", uri=f"unix:{listen}")
                while True:
                    info = qmp.execute("query-migrate")
                    if info.get("status") in ("completed", "failed", "cancelled"):
                        break
                    time.sleep(opts.poll_ms / 1e3)
                wall = time.monotonic() - t_put
                if info["status"] != "completed":
                    raise RuntimeError(f"QEMU's migration {info['status']}: {info}")
                ram = info["ram"]
                result.update({
                    "wall_ms": wall * 1e3, "total_ms": info["total-time"],
                    "downtime_ms": info["downtime"], "setup_ms": info.get("setup-time"),
                    "bytes_sent": ram["transferred"], "ram_total": ram["total"],
                    "zero_pages": ram["duplicate"], "normal_pages": ram["normal"],
                    "rounds": ram.get("dirty-sync-count"), "mbps": ram.get("mbps"),
                    "throughput_bytes_per_second": ram["transferred"] /
                    (info["total-time"] / 1e3),
                })
                qmp.execute("quit")
                qmp.close()
                source.wait(60)
                # The destination holds what the file held: sample pages below 1 GiB, read by
                # the monitor (guest physical = RAM offset there on `pc`).
                dqmp = Qmp(dst_qmp)
                status = dqmp.execute("query-status")
                result["destination_status"] = status["status"]
                bad = []
                top = min(size_mib, 1024) * MIB
                for addr in range(16 * MIB, top, max(PAGE, (top - 16 * MIB) // 64 // PAGE * PAGE)):
                    out = dqmp.execute("human-monitor-command", **{"command-line":
                                                                   f"xp /1gx {addr:#x}"})
                    value = int(out.split(":")[1].split()[0], 16)
                    if value != (addr // PAGE) ^ SEED:
                        bad.append((addr, out.strip()))
                result["verified"] = not bad
                if bad:
                    raise RuntimeError(f"QEMU's destination holds other data: {bad[:3]}")
                dqmp.execute("quit")
                dqmp.close()
                destination.wait(60)
                result["tried"] = tried
                return result
            finally:
                for child in (source, destination):
                    if child is not None:
                        child.kill()
                remove(listen)
        raise RuntimeError("QEMU started with no accelerator: " + " | ".join(tried))
    finally:
        remove(mem_file)


# ---------------------------------------------------------------------------------------------
# Output.

def fmt_ms(v):
    return "-" if v is None else f"{v:.0f}"


def print_table(results, baseline, qemu_results, qemu_skipped):
    rate = baseline["bytes_per_second"]
    fresh = baseline["fresh_memory_bytes_per_second"]
    print()
    print(f"Unix socket baseline: {rate / MIB:.0f} MiB/s (median of "
          f"{len(baseline['runs_bytes_per_second'])} x {baseline['bytes'] // MIB} MiB in 1 MiB "
          f"writes; runs {', '.join(f'{r / MIB:.0f}' for r in baseline['runs_bytes_per_second'])}"
          f" MiB/s)")
    print(f"Unix socket from populated into fresh memory (the sender holds and sends "
          f"{baseline['bytes'] // MIB} MiB it wrote, the receiver reads into new anonymous memory, "
          f"as a copy migration does): {fresh / MIB:.0f} MiB/s (runs "
          f"{', '.join(f'{r / MIB:.0f}' for r in baseline['fresh_memory_runs_bytes_per_second'])}"
          f" MiB/s)")
    print()
    head = ("| workload | guest | slots | harvest | memory | total | to pre-copy | round 1 | after round 1"
            " | downtime | rounds | sent | sent / guest | throughput | / socket | / socket into"
            " fresh memory | round 1 rate"
            " | / socket | destination's line | its digest check | verify |")
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for r in results:
        if "error" in r:
            print(f"| {r['workload']} | {r['mem_mib']} MiB | {r['slots']} | {r['mode']} | "
                  f"{r.get('transfer', 'copy')} | FAILED: {r['error']} |")
            continue
        after = (max(0.0, r["total_ms"] - r["t_round1_end_ms"]) if r["t_round1_end_ms"]
                 else None)
        r1 = r["round1_throughput_bytes_per_second"]
        if r["downtime_ms"] is not None:
            down = f"{r['downtime_ms']:.0f} ms"
        else:
            low, high = r["downtime_bounds_ms"]
            down = f"not seen ({fmt_ms(low)}-{fmt_ms(high)} ms)"
        if r["forced_at_timeout"]:
            rounds = f"{r['rounds']} (forced at the timeout)"
        elif r.get("forced"):
            rounds = f"{r['rounds']} (forced: the harvest alone outlasts the budget)"
        else:
            rounds = f"{r['rounds']}"
        print(f"| {r['workload']} | {r['mem_mib']} MiB | {r['slots']} | {r['mode']} "
              f"| {'handed over' if r.get('transfer') == 'local' else 'copied'} "
              f"| {r['total_ms']:.0f} ms | {fmt_ms(r['t_pre_copy_ms'])} ms "
              f"| {fmt_ms((r['t_round1_end_ms'] or 0) - (r['t_pre_copy_ms'] or 0))} ms "
              f"| {fmt_ms(after)} ms | {down} | {rounds} "
              f"| {r['bytes_sent'] / MIB:.0f} MiB | {r['bytes_sent'] / r['guest_memory_bytes']:.3f}"
              f" | {r['throughput_bytes_per_second'] / MIB:.0f} MiB/s "
              f"| {100 * r['throughput_bytes_per_second'] / rate:.0f} % "
              f"| {100 * r['throughput_bytes_per_second'] / fresh:.0f} % "
              f"| {'-' if not r1 else f'{r1 / MIB:.0f} MiB/s'} "
              f"| {'-' if not r1 else f'{100 * r1 / rate:.0f} %'} "
              f"| {r['dest_rounds']} rounds, {r['dest_mib']} MiB, {r['dest_ms']:.0f} ms "
              f"| {fmt_ms(r.get('dest_check_ms'))} ms "
              f"| ok, {r['verify_s']:.1f} s |")
    print()
    if qemu_skipped:
        print(f"QEMU peer: skipped: {qemu_skipped}")
    for q in qemu_results:
        if "error" in q:
            print(f"QEMU {q['mem_mib']} MiB: FAILED: {q['error']}")
            continue
        print(f"QEMU {q['version']['major']}.{q['version']['minor']}.{q['version']['micro']} "
              f"-accel {q['accel']}, {q['mem_mib']} MiB (file-backed, non-zero): total "
              f"{q['total_ms']} ms, downtime {q['downtime_ms']} ms, setup {q['setup_ms']} ms, "
              f"{q['rounds']} dirty syncs, {q['bytes_sent'] / MIB:.0f} MiB sent "
              f"({q['normal_pages']} normal, {q['zero_pages']} zero pages), "
              f"{q['throughput_bytes_per_second'] / MIB:.0f} MiB/s = "
              f"{100 * q['throughput_bytes_per_second'] / rate:.0f} % of the socket, "
              f"{100 * q['throughput_bytes_per_second'] / fresh:.0f} % of the socket into fresh "
              f"memory"
              + (f" (tried first: {'; '.join(q['tried'])})" if q["tried"] else ""))
    target = [r for r in results if "error" not in r and r["mem_mib"] == 4096
              and r["workload"] == "idle" and r.get("transfer", "copy") == "copy"]
    local = [r for r in results if "error" not in r and r.get("transfer") == "local"
             and r["slots"] >= 32764]
    for r in local:
        down = r["downtime_ms"]
        met = down is not None and down <= 50
        print(f"target (local mode, downtime <= 50 ms at {r['slots']} slots): {r['mem_mib']} MiB "
              f"{r['mode']}: {'-' if down is None else f'{down:.1f}'} ms -> "
              f"{'met' if met else 'NOT met'}")
    if target:
        print()
        for r in target:
            share = r["throughput_bytes_per_second"] / rate
            print(f"target (4 GiB, idle, >= 80 % of the socket): {r['slots']} slots {r['mode']}: "
                  f"{100 * share:.0f} % -> {'met' if share >= 0.8 else 'NOT met'}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    target = os.environ.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target"))
    parser.add_argument("--binary", default=os.path.join(target, "release/tinyvmm"))
    parser.add_argument("--sizes", default="512,4096", help="guest memory, MiB")
    parser.add_argument("--slots", default="2,4096,32764",
                        help="KVM slots in all (`serve --slots`: the system region's too)")
    parser.add_argument("--modes", default="bitmap,ring")
    parser.add_argument("--transfers", default="copy",
                        help="copy (the guest memory travels) and/or local (a memfd handed over)")
    parser.add_argument("--workloads", default="idle",
                        help="idle (every page written once) and/or loop (a write_loop too)")
    parser.add_argument("--loop-mib", type=int, default=16)
    parser.add_argument("--ring-entries", type=int, default=65536)
    parser.add_argument("--downtime-ms", type=int, default=300)
    parser.add_argument("--timeout-s", type=int, default=60)
    parser.add_argument("--on-timeout", default="force", choices=["force", "cancel"])
    parser.add_argument("--poll-ms", type=float, default=5)
    parser.add_argument("--baseline-mib", type=int, default=4096)
    parser.add_argument("--baseline-runs", type=int, default=3)
    parser.add_argument("--qemu", default="auto", choices=["auto", "on", "off"],
                        help="auto: if installed; on: install qemu-system-x86 if missing")
    parser.add_argument("--qemu-accel", default="kvm,tcg",
                        help="accelerators to try, in order")
    parser.add_argument("--json", default=os.path.join(ROOT, "target/bench-results/migrate.json"))
    opts = parser.parse_args()
    if not os.path.exists(opts.binary):
        sys.exit(f"{opts.binary} is missing: cargo build --release -p tinyvmm")
    signal.signal(signal.SIGTERM, on_sigterm)
    # Also when started in the background, where SIGINT may come in ignored.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    tmp = tempfile.mkdtemp(prefix="tinyvmm-migrate-bench-")
    logs = os.path.join(os.path.dirname(os.path.abspath(opts.json)), "migrate-logs")
    shutil.rmtree(logs, ignore_errors=True)
    os.makedirs(logs)
    started = time.monotonic()
    results, qemu_results, qemu_skipped = [], [], None
    try:
        print("socket baseline ...", file=sys.stderr)
        baseline = socket_baseline(tmp, opts.baseline_mib * MIB, opts.baseline_runs)
        for workload in opts.workloads.split(","):
            for size in [int(s) for s in opts.sizes.split(",")]:
                for slots in [int(s) for s in opts.slots.split(",")]:
                    for mode, transfer in [(m, t) for t in opts.transfers.split(",")
                                           for m in opts.modes.split(",")]:
                        t = time.monotonic()
                        print(f"tinyvmm {workload} {size} MiB {slots} slots {mode} {transfer} ...",
                              file=sys.stderr, end=" ", flush=True)
                        try:
                            r = migrate_tinyvmm(opts, tmp, logs, size, slots, mode, workload,
                                                transfer)
                            print(f"{r['total_ms']:.0f} ms, downtime {r['downtime_ms']}; "
                                  f"{time.monotonic() - t:.0f} s in all", file=sys.stderr)
                        except (RuntimeError, OSError, ConnectionError, ValueError) as e:
                            r = {"workload": workload, "mem_mib": size, "slots": slots,
                                 "mode": mode, "transfer": transfer, "error": str(e)}
                            print(f"FAILED: {e}", file=sys.stderr)
                        results.append(r)
        if opts.qemu == "off":
            qemu_skipped = "--qemu off"
        else:
            qemu, why = qemu_available(opts)
            if qemu is None:
                qemu_skipped = why
            for size in [int(s) for s in opts.sizes.split(",")] if qemu else []:
                print(f"qemu {size} MiB ...", file=sys.stderr, flush=True)
                try:
                    qemu_results.append(migrate_qemu(opts, tmp, logs, qemu, size,
                                                     opts.qemu_accel.split(",")))
                except (RuntimeError, OSError, ConnectionError, ValueError) as e:
                    qemu_results.append({"mem_mib": size, "error": str(e)})
                    print(f"QEMU FAILED: {e}", file=sys.stderr)
    finally:
        kill_children()
        shutil.rmtree(tmp, ignore_errors=True)
    print_table(results, baseline, qemu_results, qemu_skipped)
    os.makedirs(os.path.dirname(os.path.abspath(opts.json)), exist_ok=True)
    with open(opts.json, "w") as f:
        json.dump({"date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
                   "argv": sys.argv, "options": vars(opts),
                   "wall_s": time.monotonic() - started,
                   "loadavg": os.getloadavg(), "socket_baseline": baseline,
                   "tinyvmm": results, "qemu": qemu_results, "qemu_skipped": qemu_skipped},
                  f, indent=1)
    print(f"\nwall time {time.monotonic() - started:.0f} s; JSON: {opts.json}")
    if any("error" in r for r in results):
        sys.exit(1)


if __name__ == "__main__":
    main()
