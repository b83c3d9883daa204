#!/usr/bin/env python3
"""Runs a command as if on a machine whose KVM runs guest ring 0 slower.

    python3 tests/slow-emulator.py PERCENT [--under PREFIX,...] [--burn] -- COMMAND...

On kvm_pvm a guest's ring 0 runs in the host's instruction emulator, whose speed differs
5-7x between machines of this project's kind (0.3-2 M instructions/s). To try the suite as a
slow machine would run it on a fast one, this caps vCPU threads (threads named `vcpuN`, as
tinyvmm names them, and the ring-0 speed probe's, `ring0-speed`) at PERCENT of one CPU, each
in its own cgroup-v1 `cpu` group, while the command runs. Everything else (the build, the
VMM's other threads, the test harnesses) keeps its full speed, as on the slow machine.

- `--under PREFIX,...`: cap only the vCPUs of processes that are, or descend from, one whose
  name starts with one of the prefixes (the Linux test binaries: `boot-`, whose VMs run in its
  own process, and `linux_snapshot`, whose VMs are `tinyvmm` processes it starts). The test
  guest runs in ring 3, natively on every machine of this kind: capping it too would slow
  what a slow machine does not.
- `--burn`: beside each capped vCPU, a busy loop that follows it: every 100 ms the loop may run
  what the vCPU ran, times (100 - PERCENT) / PERCENT (capped at a CPU), and it is stopped while
  the vCPU is halted. An emulating vCPU thus takes a whole core as on a slow machine (a slow
  emulator is slow, not idle: without the loop the rest of the suite would get the cores it
  leaves), and an idle one takes nothing.

The probe (`tests/run.sh` prints it; the Linux tests scale their patience with it) reads the
speed the cap gives: it is capped wherever it runs. Needs root and a cgroup-v1 `cpu`
hierarchy at /sys/fs/cgroup/cpu.
"""

import os
import re
import signal
import subprocess
import sys
import time

ROOT = "/sys/fs/cgroup/cpu"
GROUP = os.path.join(ROOT, "slow-emulator")
PERIOD_US = 20_000  # short, so that a capped vCPU waits at most this long to run again
NAMES = re.compile(r"^(vcpu\d+|ring0-speed)$")


def write(path, value):
    with open(path, "w") as file:
        file.write(str(value))


def ancestors(pid):
    """The names of `pid` and its ancestors, itself first."""
    names = []
    while pid > 1:
        try:
            with open(f"/proc/{pid}/stat") as file:
                stat = file.read()
        except OSError:
            break
        # pid (comm) state ppid ...: comm may hold spaces and parentheses.
        names.append(stat[stat.index("(") + 1 : stat.rindex(")")])
        pid = int(stat[stat.rindex(")") + 2 :].split()[1])
    return names


def vcpu_threads(prefixes):
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/comm") as file:
                    name = file.read().strip()
            except OSError:
                continue
            if not NAMES.match(name):
                continue
            if name == "ring0-speed" or not prefixes or any(
                a.startswith(prefixes) for a in ancestors(int(pid))
            ):
                yield int(tid)


def group_of(path, **settings):
    os.makedirs(path, exist_ok=True)
    for name, value in settings.items():
        write(os.path.join(path, name.replace("__", ".")), value)
    return path


def cpu_ns(tid):
    """The time `tid` has run on a CPU, in nanoseconds (None once it ended)."""
    try:
        with open(f"/proc/{tid}/schedstat") as file:
            return int(file.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


class Capped:
    """A capped vCPU thread, and with `--burn` its busy loop and what the loop last got."""

    def __init__(self, tid, percent, burn):
        self.tid = tid
        self.percent = percent
        quota_us = max(1000, int(PERIOD_US * percent / 100))
        group = group_of(
            os.path.join(GROUP, f"t{tid}"),
            cpu__cfs_period_us=PERIOD_US,
            cpu__cfs_quota_us=quota_us,
        )
        write(os.path.join(group, "tasks"), tid)
        self.burner = None
        if burn:
            self.burner = subprocess.Popen(
                ["sh", "-c", "while :; do :; done"],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            os.kill(self.burner.pid, signal.SIGSTOP)
            self.stopped = True
            loop = group_of(
                os.path.join(GROUP, f"b{tid}"),
                cpu__cfs_period_us=PERIOD_US,
                cpu__cfs_quota_us=1000,
            )
            write(os.path.join(loop, "tasks"), self.burner.pid)
            self.last = (time.monotonic(), cpu_ns(tid) or 0)

    def follow(self):
        """Gives the busy loop what the vCPU ran since the last call, scaled: an emulating
        vCPU that ran PERCENT of a CPU takes a whole one, a halted one takes nothing."""
        if self.burner is None:
            return
        now, ran = time.monotonic(), cpu_ns(self.tid)
        if ran is None:
            return
        then, before = self.last
        self.last = (now, ran)
        share = (ran - before) / 1e9 / max(now - then, 1e-3)
        loop_share = min(1.0, share * (100 - self.percent) / self.percent)
        if loop_share < 0.05:
            if not self.stopped:
                os.kill(self.burner.pid, signal.SIGSTOP)
                self.stopped = True
            return
        try:
            write(
                os.path.join(GROUP, f"b{self.tid}", "cpu.cfs_quota_us"),
                max(1000, int(PERIOD_US * loop_share)),
            )
        except OSError:
            pass
        if self.stopped:
            os.kill(self.burner.pid, signal.SIGCONT)
            self.stopped = False

    def ended(self):
        """Whether the thread has ended; then removes its groups and stops its loop."""
        group = os.path.join(GROUP, f"t{self.tid}")
        try:
            with open(os.path.join(group, "tasks")) as file:
                if file.read().strip():
                    return False
        except OSError:
            pass
        if self.burner is not None:
            self.burner.kill()
            self.burner.wait()
        for path in [group, os.path.join(GROUP, f"b{self.tid}")]:
            try:
                os.rmdir(path)
            except OSError:
                pass
        return True


def sweep(capped):
    """Forgets the threads that have ended."""
    for tid, entry in list(capped.items()):
        if entry.ended():
            del capped[tid]


def main():
    args = sys.argv[1:]
    if "--" not in args or args.index("--") == len(args) - 1:
        sys.exit(__doc__)
    options, command = args[: args.index("--")], args[args.index("--") + 1 :]
    if not options:
        sys.exit(__doc__)
    percent = float(options.pop(0))
    prefixes, burn = (), False
    while options:
        option = options.pop(0)
        if option == "--under" and options:
            prefixes = tuple(p for p in options.pop(0).split(",") if p)
        elif option == "--burn":
            burn = True
        else:
            sys.exit(f"unknown option {option!r}\n{__doc__}")
    if not 0 < percent <= 100:
        sys.exit(f"PERCENT must be in (0, 100], not {sys.argv[1]}")
    if not os.path.isdir(ROOT):
        sys.exit(f"no cgroup-v1 cpu hierarchy at {ROOT}: cannot cap the vCPU threads")
    os.makedirs(GROUP, exist_ok=True)
    print(
        f"slow-emulator: vCPU threads{' under ' + ','.join(prefixes) if prefixes else ''} "
        f"capped at {percent:g}% of a CPU"
        f"{', each followed by a busy loop for the rest' if burn else ''}",
        file=sys.stderr,
    )

    child = subprocess.Popen(command)
    signal.signal(signal.SIGINT, lambda *_: child.send_signal(signal.SIGINT))
    signal.signal(signal.SIGTERM, lambda *_: child.send_signal(signal.SIGTERM))
    capped = {}
    total = 0
    rounds = 0
    while child.poll() is None:
        for tid in vcpu_threads(prefixes):
            if tid not in capped:
                try:
                    capped[tid] = Capped(tid, percent, burn)
                    total += 1
                except OSError:
                    pass  # the thread ended in between
        rounds += 1
        if rounds % 5 == 0:
            for entry in capped.values():
                entry.follow()
        if rounds % 25 == 0:
            sweep(capped)
        time.sleep(0.02)
    # The command's vCPUs end with it; give stragglers a few seconds, then stop their loops.
    for _ in range(250):
        sweep(capped)
        if not capped:
            break
        time.sleep(0.02)
    for entry in capped.values():
        if entry.burner is not None:
            entry.burner.kill()
    try:
        os.rmdir(GROUP)
    except OSError:
        pass
    print(f"slow-emulator: capped {total} vCPU threads in all", file=sys.stderr)
    sys.exit(child.returncode)


if __name__ == "__main__":
    main()
