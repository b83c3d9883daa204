#!/usr/bin/env python3
"""A live snapshot's pause against a stop-and-copy one's, with the guest writing: Full and Diff.

For each guest memory size and harvest mode, one `tinyvmm serve` (4096 slots by default) in one
run: the test guest writes every page, then loops writing one u64 per page over all of its
memory (ring 3, native speed here) while `PUT /snapshot/create {"live": true}` copies memory in
rounds; `GET /snapshot` gives the pause (`pause_ms`: from the vCPUs pausing to their going on),
the rounds and the bytes written. The loop is then stopped and the whole memory verified (the VM
went on). A live Diff follows the live Full the same way, the loop still writing (round 1: the
pages dirtied since the Full's point). The baselines, in the same process: the same VM paused,
a stop-and-copy Diff after one more pass over all of memory (every page dirty since the live
Diff, as for the live Diff's rounds) and then a stop-and-copy Full (the time `PUT /snapshot/create` takes while the
VM is paused is that snapshot's pause). Each figure is the median of --runs runs; compare
within a run (this host's timings swing).

Python 3 standard library only.

    cargo build --release -p tinyvmm
    python3 vmm/benches/live_snapshot.py                        # 512 and 4096 MiB, bitmap and ring
    python3 vmm/benches/live_snapshot.py --mem-mib 512 --runs 5
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from clones import Api, command, verify, wait_for  # noqa: E402  (the same API client)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MIB = 1 << 20
AREA = 256 * MIB  # where `serve` puts its memory
SEED = 1000


def snapshot(api, work, name, live, extra=None):
    body = {
        "snapshot_type": "Full",
        "snapshot_path": os.path.join(work, name + ".state"),
        "mem_file_path": os.path.join(work, name + ".mem"),
    }
    if live:
        body["live"] = True
    body.update(extra or {})
    started = time.monotonic()
    api.ok("PUT", "/snapshot/create", body)
    return time.monotonic() - started, body


def remove(body):
    for key in ("snapshot_path", "mem_file_path"):
        try:
            os.remove(body[key])
        except FileNotFoundError:
            pass


def run_once(binary, work, mem_mib, slots, ring, downtime_ms):
    api_path = os.path.join(work, "api.sock")
    args = [binary, "serve", "--slots", str(slots), "--mem-mib", str(mem_mib), "--api-sock", api_path]
    if ring:
        args += ["--dirty-ring", "4096"]
    proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        wait_for(api_path, proc)
        api = Api(api_path)
        # The socket's path exists from its bind, a moment before it listens.
        deadline = time.monotonic() + 60
        while True:
            try:
                api.ok("GET", "/")
                break
            except ConnectionRefusedError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.01)
        # The test area's end (its slots' sizes round it down).
        end = max(r["guest_address"] + r["size"] for r in api.ok("GET", "/memory")["regions"]
                  if AREA <= r["guest_address"] < 4096 * MIB)
        api.ok("PUT", "/guest/command", command("write", AREA, end, SEED - 1))
        answer = api.ok("PUT", "/guest/command", command("write_loop", AREA, end, SEED))
        if answer.get("result") != "started":
            raise RuntimeError(f"write_loop: {answer}")
        def live(name, kind):
            started = time.monotonic()
            _, body = snapshot(api, work, name, True,
                               {"downtime_ms": downtime_ms, "snapshot_type": kind})
            while True:
                info = api.ok("GET", "/snapshot")
                if info["phase"] not in ("setup", "pre_copy", "stop_and_copy"):
                    break
                time.sleep(0.005)
            if info["phase"] != "completed":
                raise RuntimeError(f"live {kind}: {info}")
            remove(body)
            return info, time.monotonic() - started

        info, total = live("live", "Full")
        diff_info, _ = live("live-diff", "Diff")
        stopped = api.ok("PUT", "/guest/command", {"op": "stop_loop", "vcpu": 0})
        verify(api, AREA, end, stopped["last_seed"], "after the live snapshots")
        # The baselines: every page dirtied once more, the same VM paused, a stop-and-copy
        # Diff, then a Full.
        api.ok("PUT", "/guest/command", command("write", AREA, end, SEED - 2))
        api.ok("PATCH", "/vm", {"state": "Paused"})
        diff_s, body = snapshot(api, work, "diff", False, {"snapshot_type": "Diff"})
        remove(body)
        full_s, body = snapshot(api, work, "full", False)
        remove(body)
        api.ok("PUT", "/actions", {"action_type": "Stop"})
        proc.wait(timeout=60)
        return {
            "live_pause_ms": info["pause_ms"],
            "live_total_ms": total * 1e3,
            "rounds": info["round"],
            "forced": info["forced"],
            "written_mib": info["bytes_written"] / MIB,
            "full_pause_ms": full_s * 1e3,
            "live_diff_pause_ms": diff_info["pause_ms"],
            "live_diff_rounds": diff_info["round"],
            "diff_pause_ms": diff_s * 1e3,
        }
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mem-mib", type=int, action="append")
    parser.add_argument("--slots", type=int, default=4096)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--downtime-ms", type=int, default=10)
    parser.add_argument("--binary", default=os.path.join(ROOT, "target/release/tinyvmm"))
    parser.add_argument("--out", default=os.path.join(ROOT, "target/bench/live-snapshot.json"))
    args = parser.parse_args()
    sizes = args.mem_mib or [512, 4096]
    work = tempfile.mkdtemp(prefix="tinyvmm-live-bench-")
    rows = []
    print("| guest | slots | harvest | live pause | rounds | written | live total | "
          "stop-and-copy pause | live / stop-and-copy | live Diff pause | rounds | "
          "stop-and-copy Diff pause | live / stop-and-copy Diff |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    try:
        for mem_mib in sizes:
            for ring in (False, True):
                runs = [run_once(args.binary, work, mem_mib, args.slots, ring, args.downtime_ms)
                        for _ in range(args.runs)]
                med = {k: statistics.median(r[k] for r in runs)
                       for k in ("live_pause_ms", "live_total_ms", "rounds", "written_mib",
                                 "full_pause_ms", "live_diff_pause_ms", "live_diff_rounds",
                                 "diff_pause_ms")}
                ratio = statistics.median(r["live_pause_ms"] / r["full_pause_ms"] for r in runs)
                diff_ratio = statistics.median(r["live_diff_pause_ms"] / r["diff_pause_ms"]
                                               for r in runs)
                row = {"mem_mib": mem_mib, "slots": args.slots,
                       "harvest": "ring" if ring else "bitmap", "median": med,
                       "live_over_full": ratio, "live_diff_over_diff": diff_ratio, "runs": runs}
                rows.append(row)
                forced = sum(1 for r in runs if r["forced"])
                pauses = ", ".join(f"{r['live_pause_ms']:.1f}" for r in runs)
                print(f"| {mem_mib} MiB | {args.slots} | {row['harvest']} | "
                      f"{med['live_pause_ms']:.1f} ms (runs {pauses}) | "
                      f"{med['rounds']:.0f}{f' ({forced} forced)' if forced else ''} | "
                      f"{med['written_mib']:.0f} MiB | {med['live_total_ms']:.0f} ms | "
                      f"{med['full_pause_ms']:.0f} ms | {ratio:.4f} | "
                      f"{med['live_diff_pause_ms']:.1f} ms | {med['live_diff_rounds']:.0f} | "
                      f"{med['diff_pause_ms']:.0f} ms | {diff_ratio:.4f} |", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"downtime_ms": args.downtime_ms, "rows": rows}, f, indent=2)
    print(f"JSON: {args.out}")


if __name__ == "__main__":
    main()
