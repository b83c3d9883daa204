#!/usr/bin/env python3
"""Time from process start to the kernel's first console line, for `tinyvmm boot`.

Starts `tinyvmm boot` (the clock starts just before the fork) with RAM in each slot count, reads
the serial console from its stdout, records when the first non-empty line and the kernel's first
log line ("Linux version") arrive, then stops the VMM with SIGTERM. Python 3 standard library
only.

    cargo build --release -p tinyvmm
    python3 vmm/benches/boot_first_line.py --slots 1,4096 --runs 3 [--bzimage]
"""
import argparse
import os
import signal
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CMDLINE = "console=ttyS0 earlyprintk=ttyS0 noxsave nokaslr panic=-1 reboot=k"


def kernel_paths():
    listed = os.path.join(ROOT, "resources/cache/kernel/vmlinuz.path")
    with open(listed) as f:
        vmlinuz = f.read().strip()
    vmlinux = os.path.join(os.path.dirname(vmlinuz),
                           os.path.basename(vmlinuz).replace("vmlinuz-", "vmlinux-"))
    return vmlinuz, vmlinux


def one_run(binary, kernel, slots, mem_mib, timeout):
    args = [binary, "boot", "--kernel", kernel, "--mem-mib", str(mem_mib),
            "--slots", str(slots), "--cmdline", CMDLINE, "--quiet",
            "--timeout", str(timeout)]
    start = time.monotonic()
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            stdin=subprocess.DEVNULL)
    first = kernel_first = None
    for raw in proc.stdout:
        now = time.monotonic() - start
        line = raw.decode(errors="replace").strip()
        if line and first is None:
            first = now
        if "Linux version" in line:
            kernel_first = now
            break
    proc.send_signal(signal.SIGTERM)
    proc.wait()
    return first, kernel_first


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--binary", default=os.path.join(ROOT, "target/release/tinyvmm"))
    parser.add_argument("--slots", default="1,4096")
    parser.add_argument("--mem-mib", type=int, default=512)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--bzimage", action="store_true",
                        help="also time the bzImage (its decompressor is slow under emulation)")
    parser.add_argument("--timeout", type=float, default=300)
    opts = parser.parse_args()
    vmlinuz, vmlinux = kernel_paths()
    kernels = [("vmlinux (PVH)", vmlinux)] + ([("bzImage", vmlinuz)] if opts.bzimage else [])
    print(f"{'kernel':<14} {'slots':>6} {'first console line':>19} {'first kernel line':>18}")
    for name, path in kernels:
        for slots in [int(s) for s in opts.slots.split(",")]:
            firsts, kernels_first = [], []
            for _ in range(opts.runs):
                first, kernel_first = one_run(opts.binary, path, slots, opts.mem_mib,
                                              opts.timeout)
                firsts.append(first)
                kernels_first.append(kernel_first)
                print(f"  run: first line {first:.2f} s, Linux version {kernel_first:.2f} s",
                      file=sys.stderr)
            print(f"{name:<14} {slots:>6} {statistics.median(firsts):>17.2f} s"
                  f" {statistics.median(kernels_first):>16.2f} s")


if __name__ == "__main__":
    main()
