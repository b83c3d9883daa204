#!/usr/bin/env python3
"""Clone fan-out: N test-guest VMs restored one after another from one template snapshot, each a
`tinyvmm restore` process with its own API socket, with the memory file mapped privately (the
default `file` backend), so that the clones share the template's unchanged pages through the
page cache.

The template: `tinyvmm serve` with `--mem-mib` MiB in `--slots` KVM slots; the test guest writes
every page of the first `--written-mib` MiB (one u64 per 4 KiB page), then the VM is paused and
a Full snapshot taken. Each clone is started, resumed, and its first guest command (a verify of
one page the template wrote) timed from the process's start: the time to the first guest
command. Each clone then reads every page the template wrote (so that every shared page is
mapped in it), and once all are idle each clone's proportional set size (PSS,
`/proc/PID/smaps_rollup`) is read, and their sum compared with N x the template's data (what N copies would cost) and
with the target of 1.2 x one template's data + 2 MiB per clone.

Isolation is checked, not assumed: clone 0 rewrites the written range with another seed and
verifies it; clone 1 then still verifies the template's seed over the whole range, and so does
a clone started after that. A failed check is a failure, never a figure.

`--page-size 2m`: the template serves its memory in 2 MiB hugetlb pages and its memory file
goes on a hugetlbfs mount the script makes in its scratch folder (root; unmounted at the end),
so the clones map it in 2 MiB pages. smaps counts hugetlb pages apart from the PSS
(`Private_Hugetlb`/`Shared_Hugetlb`), so the figures that say what the clones cost are the
pool's (/sys/kernel/mm/hugepages/hugepages-2048kB): pages in use (the template's and the
clones' copies) and reserved (each clone reserves its whole memory at start for its copies on
write) before the clones, with them idle after reading everything, and after clone 0 rewrote
its data. The pool needs room for the template's pages plus every clone's memory (the script
says how many pages before it starts; raise /proc/sys/vm/nr_hugepages for the run).

Python 3 standard library only.

    cargo build --release -p tinyvmm
    python3 vmm/benches/clones.py                          # 32 clones of 512 MiB, 4096 slots
    python3 vmm/benches/clones.py --clones 4 --mem-mib 64  # quick
    python3 vmm/benches/clones.py --page-size 2m --mem-mib 64 --written-mib 32 --slots 17
"""
import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MIB = 1 << 20
AREA = 256 * MIB  # where `serve` puts its initial memory
PAGE = 4096
SEED = 0x5EED_0001
CLONE_SEED = 0xC10E_0002


class Api:
    """One connection per call to a tinyvmm API socket (HTTP/1.1, JSON, Content-Length)."""

    def __init__(self, path):
        self.path = path

    def call(self, method, url, body=None, timeout=600):
        data = b"" if body is None else json.dumps(body).encode()
        head = (f"{method} {url} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n"
                f"Content-Length: {len(data)}\r\n\r\n").encode()
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout)
            sock.connect(self.path)
            sock.sendall(head + data)
            buf = b""
            while True:
                end = buf.find(b"\r\n\r\n")
                if end >= 0:
                    head_text = buf[:end].decode(errors="replace")
                    length = 0
                    for line in head_text.split("\r\n")[1:]:
                        key, _, value = line.partition(":")
                        if key.strip().lower() == "content-length":
                            length = int(value)
                    if len(buf) >= end + 4 + length:
                        body = buf[end + 4:end + 4 + length]
                        return int(head_text[9:12]), (json.loads(body) if body else None)
                chunk = sock.recv(1 << 16)
                if not chunk:
                    raise ConnectionError(f"{self.path}: closed after {len(buf)} bytes")
                buf += chunk

    def ok(self, method, url, body=None):
        status, answer = self.call(method, url, body)
        if not 200 <= status < 300:
            raise RuntimeError(f"{method} {url}: {status} {answer}")
        return answer


def wait_for(path, proc, deadline_s=120):
    """Until the API socket at `path` takes connections (it exists a moment before it listens)."""
    deadline = time.monotonic() + deadline_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[1]} exited ({proc.returncode}) before {path} listened")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{path} never listened")
        if os.path.exists(path):
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                try:
                    sock.connect(path)
                    return
                except (ConnectionRefusedError, FileNotFoundError):
                    pass
        time.sleep(0.002)


def command(op, start, end, seed):
    return {"op": op, "start": start, "end": end, "stride": PAGE, "seed": seed}


def verify(api, start, end, seed, what):
    answer = api.ok("PUT", "/guest/command", command("verify", start, end, seed))
    if answer.get("result") != "ok":
        raise RuntimeError(f"{what}: {answer}")


def pss_kib(pid):
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1])
    raise RuntimeError(f"no Pss in /proc/{pid}/smaps_rollup")


def rollup_kib(pid, field):
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


HUGEPAGES = "/sys/kernel/mm/hugepages/hugepages-2048kB"


def pool():
    """The hugetlb pool's 2 MiB pages: total, free, reserved; in use = total - free."""
    read = lambda name: int(open(os.path.join(HUGEPAGES, name)).read())
    total, free, resv = read("nr_hugepages"), read("free_hugepages"), read("resv_hugepages")
    return {"total": total, "free": free, "reserved": resv, "in_use": total - free,
            "available": free - resv}


def percentile(values, p):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(p / 100 * (len(ordered) - 1))))]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clones", type=int, default=32)
    parser.add_argument("--mem-mib", type=int, default=512)
    parser.add_argument("--written-mib", type=int, default=256)
    parser.add_argument("--slots", type=int, default=4096)
    parser.add_argument("--tinyvmm", default=os.path.join(ROOT, "target/release/tinyvmm"))
    parser.add_argument("--json", default=None,
                        help="default: target/bench/clones.json (clones-2m.json for 2m)")
    parser.add_argument("--page-size", choices=["4k", "2m"], default="4k",
                        help="2m: the template in 2 MiB pages, its memory file on hugetlbfs")
    args = parser.parse_args()
    huge = args.page_size == "2m"
    if args.json is None:
        args.json = os.path.join(ROOT, "target/bench",
                                 "clones-2m.json" if huge else "clones.json")
    if args.clones < 2:
        sys.exit("--clones: at least 2 (isolation is checked between two clones)")
    # The system region (2 MiB) and the initial memory, in 2 MiB pages.
    vm_pages = 1 + args.mem_mib // 2
    if huge:
        # The template VM's memory, then the template's pages and every clone's reservation
        # (the clones and the one started after clone 0 wrote, at once).
        need = max(vm_pages, vm_pages + (args.clones + 1) * vm_pages)
        have = pool()["available"]
        if have < need:
            sys.exit(f"--page-size 2m: the hugetlb pool has {have} free, unreserved 2 MiB pages; "
                     f"{args.clones} clones of {args.mem_mib} MiB need up to {need} "
                     f"(raise /proc/sys/vm/nr_hugepages for the run)")
    work = tempfile.mkdtemp(prefix="tinyvmm-clones-")
    procs = []
    mount = None
    pools = {}
    try:
        written_end = AREA + args.written_mib * MIB
        state, mem = os.path.join(work, "t.state"), os.path.join(work, "t.mem")
        if huge:
            mount = os.path.join(work, "hugetlbfs")
            os.mkdir(mount)
            subprocess.run(["mount", "-t", "hugetlbfs", "-o", "pagesize=2M", "none", mount],
                           check=True)
            mem = os.path.join(mount, "t.mem")
            pools["before"] = pool()
        # The template.
        sock = os.path.join(work, "template.sock")
        template = subprocess.Popen(
            [args.tinyvmm, "serve", "--api-sock", sock, "--slots", str(args.slots),
             "--mem-mib", str(args.mem_mib), "--page-size", args.page_size],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        procs.append(template)
        wait_for(sock, template)
        api = Api(sock)
        api.ok("PUT", "/guest/command", command("write", AREA, written_end, SEED))
        api.ok("PATCH", "/vm", {"state": "Paused"})
        api.ok("PUT", "/snapshot/create",
               {"snapshot_type": "Full", "snapshot_path": state, "mem_file_path": mem})
        api.ok("PUT", "/actions", {"action_type": "Stop"})
        template.wait(timeout=120)
        procs.remove(template)
        mem_file_mib = os.stat(mem).st_blocks * 512 / MIB
        if huge:
            pools["template"] = pool()
        # Drop nothing from the page cache: the file was just written, as a template's is.

        def start_clone(i):
            sock = os.path.join(work, f"clone{i}.sock")
            t0 = time.monotonic()
            proc = subprocess.Popen(
                [args.tinyvmm, "restore", "--snapshot", state, "--mem-file", mem,
                 "--api-sock", sock],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            procs.append(proc)
            wait_for(sock, proc)
            api = Api(sock)
            api.ok("PATCH", "/vm", {"state": "Resumed"})
            verify(api, AREA, AREA + PAGE, SEED, f"clone {i}'s first command")
            return proc, api, time.monotonic() - t0

        clones = [start_clone(i) for i in range(args.clones)]
        first_ms = [c[2] * 1e3 for c in clones]
        # Each clone reads the template's whole data (a working set of every written page), so
        # that every shared page is mapped in every clone and counted, shared, in its PSS.
        for i, (_, capi, _) in enumerate(clones):
            verify(capi, AREA, written_end, SEED, f"clone {i}'s whole data")
        # Memory of the idle clones.
        pss = [pss_kib(c[0].pid) for c in clones]
        hugetlb = [{"private_kib": rollup_kib(c[0].pid, "Private_Hugetlb"),
                    "shared_kib": rollup_kib(c[0].pid, "Shared_Hugetlb")} for c in clones]
        if huge:
            pools["clones_idle"] = pool()
        # Isolation: clone 0 writes; its siblings and a later clone still see the template.
        clones[0][1].ok("PUT", "/guest/command", command("write", AREA, written_end, CLONE_SEED))
        verify(clones[0][1], AREA, written_end, CLONE_SEED, "clone 0 after its write")
        if huge:
            pools["clone0_wrote"] = pool()
        verify(clones[1][1], AREA, written_end, SEED, "clone 1 after clone 0 wrote")
        late, late_api, _ = start_clone(args.clones)
        verify(late_api, AREA, written_end, SEED, "a clone started after clone 0 wrote")
        late_api.ok("PUT", "/actions", {"action_type": "Stop"})
        late.wait(timeout=60)
        procs.remove(late)
        template_data_kib = args.written_mib * 1024
        total_pss_mib = sum(pss) / 1024
        # With hugetlb pages, the PSS leaves out the template's pages and the clones' copies:
        # the pool's pages in use with the clones idle (the template's file included) count.
        pool_mib = (2 * (pools["clones_idle"]["in_use"] - pools["before"]["in_use"])
                    if huge else 0)
        memory_mib = total_pss_mib + pool_mib
        copies_mib = args.clones * args.written_mib
        target_mib = 1.2 * args.written_mib + 2 * args.clones
        result = {
            "clones": args.clones,
            "mem_mib": args.mem_mib,
            "written_mib": args.written_mib,
            "slots": args.slots,
            "memory_file_mib": mem_file_mib,
            "first_command_ms": {"median": statistics.median(first_ms),
                                 "p99": percentile(first_ms, 99),
                                 "min": min(first_ms), "max": max(first_ms),
                                 "all": first_ms},
            "pss_mib": {"sum": total_pss_mib, "per_clone": [p / 1024 for p in pss]},
            "n_copies_mib": copies_mib,
            "target_mib": target_mib,
            "pool_in_use_mib": pool_mib,
            "memory_mib": memory_mib,
            "within_target": memory_mib <= target_mib,
            "template_data_kib": template_data_kib,
            "page_size": args.page_size,
            "hugetlb_kib_per_clone": hugetlb,
            "pool_pages": pools,
        }
        for proc, capi, _ in clones:
            capi.ok("PUT", "/actions", {"action_type": "Stop"})
            proc.wait(timeout=60)
            procs.remove(proc)
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
        if mount:
            # The template's file and its pages go with the mount.
            subprocess.run(["umount", mount], check=False)
        shutil.rmtree(work, ignore_errors=True)

    where = "on hugetlbfs, in 2 MiB pages" if huge else "in 4 KiB pages"
    print(f"{args.clones} clones of a {args.mem_mib} MiB template ({args.written_mib} MiB written, "
          f"{args.slots} KVM slots), memory file {where} mapped privately:")
    f = result["first_command_ms"]
    print(f"  time to the first guest command   median {f['median']:.1f} ms, p99 {f['p99']:.1f} ms "
          f"(min {f['min']:.1f}, max {f['max']:.1f})")
    print(f"  PSS of the idle clones, summed    {total_pss_mib:.1f} MiB"
          + (" (hugetlb pages not counted)" if huge else ""))
    if huge:
        mib = lambda pages: pages * 2
        p = pools
        print(f"  pool pages in use / reserved      before {p['before']['in_use']} / "
              f"{p['before']['reserved']}, template written {p['template']['in_use']} / "
              f"{p['template']['reserved']}, {args.clones} clones idle "
              f"{p['clones_idle']['in_use']} / {p['clones_idle']['reserved']}, clone 0 wrote "
              f"{p['clone0_wrote']['in_use']} / {p['clone0_wrote']['reserved']}")
        used = p["clones_idle"]["in_use"] - p["template"]["in_use"]
        held = (p["clones_idle"]["in_use"] + p["clones_idle"]["reserved"]
                - p["template"]["in_use"] - p["template"]["reserved"])
        print(f"  the clones' pool use              {mib(used)} MiB in use, {mib(held)} MiB in use "
              f"or reserved ({mib(held) / args.clones:.1f} MiB a clone); the template's file "
              f"{mem_file_mib:.0f} MiB")
        priv = statistics.median(h["private_kib"] for h in hugetlb) / 1024
        shared = statistics.median(h["shared_kib"] for h in hugetlb) / 1024
        print(f"  per clone, smaps (median)         Private_Hugetlb {priv:.1f} MiB, "
              f"Shared_Hugetlb {shared:.1f} MiB")
    if huge:
        print(f"  PSS + the pool's pages in use     {memory_mib:.1f} MiB")
    print(f"  {args.clones} copies of the data would be {copies_mib} MiB; target "
          f"<= 1.2 x {args.written_mib} + 2 x {args.clones} = {target_mib:.1f} MiB: "
          f"{'met' if result['within_target'] else 'NOT met'}")
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as out:
        json.dump(result, out, indent=2)
    print(f"  JSON: {args.json}")


if __name__ == "__main__":
    main()
