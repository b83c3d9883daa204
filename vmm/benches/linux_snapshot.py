#!/usr/bin/env python3
"""A Linux guest's snapshot and restore against a cold boot, and its migration downtime.

For each slot count, Debian's kernel (`resources/fetch-kernel.sh`) boots twice, side by side
in one run: a cold `tinyvmm boot`, timed from its start to the console line NEXT, and a boot
with an API socket, paused as soon as its console shows AT (the line just before NEXT), snapshot
(Full), and stopped. A `tinyvmm restore` of that snapshot is then timed from its start to NEXT
(its API up, the VM resumed, the guest's first line): what a launch from a snapshot saves
against a cold boot to the same point. Then the restored guest is migrated (bitmap, Unix
socket) to a `tinyvmm receive`, and the source's pause (the downtime) is read from its last
line.

On this host guest ring 0 runs in KVM's instruction emulator (~2 M instructions/s), so a cold
boot to that point takes tens of seconds: the ratio, not the figures, is what carries over.
At 32764 slots the RAM has 32763 slots of 4 pages and a last one of 20 (32764 = 4 x 8191
divides no RAM size in whole pages).

Python 3 standard library only.

    cargo build --release -p tinyvmm && bash resources/fetch-kernel.sh
    python3 vmm/benches/linux_snapshot.py                 # 1, 4096 and 32764 slots
    python3 vmm/benches/linux_snapshot.py --slots 4096    # one row
"""
import argparse
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from clones import Api, wait_for  # noqa: E402  (the same API client)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CMDLINE = "console=ttyS0 earlyprintk=ttyS0 noxsave nokaslr panic=-1 reboot=k"
AT = "TSC deadline timer available"
NEXT = "smpboot: Allowing"


def kernel():
    found = glob.glob(os.path.join(ROOT, "resources/cache/kernel/linux-image-*/boot/vmlinux-*"))
    if not found:
        sys.exit("no vmlinux: run resources/fetch-kernel.sh first")
    return found[0]


def console_has(path, text):
    try:
        with open(path, errors="replace") as f:
            return text in f.read()
    except FileNotFoundError:
        return False


def wait_line(path, text, proc, deadline_s=600):
    deadline = time.monotonic() + deadline_s
    while not console_has(path, text):
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[1]} exited ({proc.returncode}) before {text!r}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"no {text!r} in {deadline_s} s")
        time.sleep(0.002)
    return time.monotonic()


def spawn(args, console, work):
    out = open(console, "w")
    err = open(console + ".err", "w")
    return subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=out, stderr=err, cwd=work)


def stop(proc, api=None):
    if proc.poll() is None:
        if api is not None:
            try:
                api.ok("PUT", "/actions", {"action_type": "Stop"})
            except Exception:  # noqa: BLE001 (it may have gone already)
                pass
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def row(tinyvmm, vmlinux, slots, work):
    boot = [tinyvmm, "boot", "--kernel", vmlinux, "--mem-mib", "512", "--slots", str(slots),
            "--vcpus", "2", "--quiet", "--timeout", "600", "--cmdline", CMDLINE]
    cold_console = os.path.join(work, f"cold-{slots}.out")
    snap_console = os.path.join(work, f"snap-{slots}.out")
    sock = os.path.join(work, f"snap-{slots}.sock")
    t_cold = time.monotonic()
    cold = spawn(boot, cold_console, work)
    snap = spawn(boot + ["--api-sock", sock], snap_console, work)
    try:
        wait_for(sock, snap)
        api = Api(sock)
        wait_line(snap_console, AT, snap)
        t0 = time.monotonic()
        api.ok("PATCH", "/vm", {"state": "Paused"})
        pause_ms = (time.monotonic() - t0) * 1e3
        if console_has(snap_console, NEXT):
            raise RuntimeError(f"the guest printed {NEXT!r} before the pause: pick a later AT")
        state, mem = os.path.join(work, f"{slots}.state"), os.path.join(work, f"{slots}.mem")
        t0 = time.monotonic()
        api.ok("PUT", "/snapshot/create",
               {"snapshot_type": "Full", "snapshot_path": state, "mem_file_path": mem})
        snapshot_ms = (time.monotonic() - t0) * 1e3
        stop(snap, api)
        cold_s = wait_line(cold_console, NEXT, cold) - t_cold
    finally:
        stop(cold)
        stop(snap)
    # The restore, alone on the host.
    rsock = os.path.join(work, f"restored-{slots}.sock")
    rconsole = os.path.join(work, f"restored-{slots}.out")
    t_restore = time.monotonic()
    restored = spawn([tinyvmm, "restore", "--snapshot", state, "--mem-file", mem,
                      "--api-sock", rsock], rconsole, work)
    try:
        wait_for(rsock, restored)
        rapi = Api(rsock)
        api_ms = (time.monotonic() - t_restore) * 1e3
        rapi.ok("PATCH", "/vm", {"state": "Resumed"})
        restore_s = wait_line(rconsole, NEXT, restored) - t_restore
        # Migrate the restored guest on while it boots.
        listen = os.path.join(work, f"mig-{slots}.sock")
        dconsole = os.path.join(work, f"dest-{slots}.out")
        dest = spawn([tinyvmm, "receive", "--listen", f"unix:{listen}",
                      "--api-sock", os.path.join(work, f"dest-{slots}.api")], dconsole, work)
        wait_for(listen, dest)
        # A harvest of every slot's log may alone take longer than a short budget at high
        # slot counts: the pause is forced once rounds cannot help (what the source reports).
        rapi.ok("PUT", "/migrate", {"destination": f"unix:{listen}", "timeout_s": 20,
                                    "on_timeout": "force"})
        restored.wait(timeout=300)
        with open(rconsole + ".err") as f:
            err = f.read()
        paused = re.search(r"paused ([0-9.]+) ms", err)
        if not paused:
            raise RuntimeError(f"the source did not say its pause:\n{err}")
        downtime_ms = float(paused.group(1))
        stop(dest, Api(os.path.join(work, f"dest-{slots}.api")))
    finally:
        stop(restored)
    return {
        "slots": slots,
        "cold_boot_to_line_s": cold_s,
        "pause_ms": pause_ms,
        "snapshot_ms": snapshot_ms,
        "memory_file_mib": os.stat(mem).st_blocks * 512 / (1 << 20),
        "restore_api_ms": api_ms,
        "restore_to_line_s": restore_s,
        "restore_over_cold": restore_s / cold_s,
        "migration_downtime_ms": downtime_ms,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--slots", type=lambda s: [int(x) for x in s.split(",")],
                        default=[1, 4096, 32764])
    parser.add_argument("--tinyvmm", default=os.path.join(ROOT, "target/release/tinyvmm"))
    parser.add_argument("--json", default=os.path.join(ROOT, "target/bench/linux-snapshot.json"))
    args = parser.parse_args()
    vmlinux = kernel()
    work = tempfile.mkdtemp(prefix="tinyvmm-linux-bench-")
    rows = []
    try:
        for slots in args.slots:
            rows.append(row(args.tinyvmm, vmlinux, slots, work))
            print(json.dumps(rows[-1]), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"{'slots':>6} {'cold boot':>10} {'pause':>8} {'snapshot':>9} {'file MiB':>9} "
          f"{'API up':>8} {'restore':>9} {'ratio':>6} {'downtime':>9}")
    for r in rows:
        print(f"{r['slots']:>6} {r['cold_boot_to_line_s']:>9.2f}s {r['pause_ms']:>6.1f}ms "
              f"{r['snapshot_ms']:>7.0f}ms {r['memory_file_mib']:>9.1f} {r['restore_api_ms']:>6.0f}ms "
              f"{r['restore_to_line_s']:>8.3f}s {r['restore_over_cold']:>6.3f} "
              f"{r['migration_downtime_ms']:>7.1f}ms")
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"at": AT, "next": NEXT, "rows": rows}, f, indent=2)
    print(f"JSON: {args.json}")


if __name__ == "__main__":
    main()
