#!/usr/bin/env python3
"""Summarise the memslot-map benchmark (benches/map.rs) as a markdown table.

Run after `cargo bench -p memslot-map --bench map`. Reads criterion's
`<criterion dir>/memslot-map_*/**/new/{benchmark,estimates}.json`, prints a markdown table
(scenario x slot count: ours, vm-memory, ratio, target met?) and writes the same data as JSON to
`<criterion dir>/memslot-map-summary.json`.

The time of a benchmark is the median of its samples (criterion's `median` estimate), which
noise from other processes moves less than the mean. Ratio is vm-memory's time divided by ours:
above 1, ours is faster.

Options:
  --criterion-dir DIR  criterion's output (default: $CRITERION_HOME, else
                       $CARGO_TARGET_DIR/criterion, else target/criterion of the workspace)
  --log FILE           the bench's saved stderr: its `memslot-map memory:` lines are added
                       to the output (bytes per slot)

Python 3 standard library only.
"""

import argparse
import json
import os
import re
import sys
from pathlib import Path

PREFIX = "memslot-map/"
OURS = "MemslotMap"
THEIRS = "GuestMemoryMmap"
TARGET_SLOTS = 32764

# (group, our function id, row label); rows appear in this order.
SCENARIOS = [
    ("build", OURS, "build, one slot at a time (ours in place)"),
    ("build", OURS + "-published", "build, one slot at a time (ours published after each)"),
    ("insert_remove", OURS, "insert + remove one slot at full occupancy"),
    (
        "insert_remove",
        OURS + "-owned",
        "insert + remove, ours given a Slot (insert allocates its Arc)",
    ),
    ("gpa_lookup_random", OURS, "random guest-address lookup"),
    ("gpa_lookup_repeated", OURS, "repeated lookup, same slot (ours hinted)"),
    ("hva_lookup_random", OURS, "host-address lookup (vm-memory: linear scan)"),
]

# Targets at TARGET_SLOTS slots: (description, check(ours_ns, theirs_ns) -> bool).
TARGETS = {
    ("insert_remove", OURS): (
        ">= 100x faster than vm-memory",
        lambda ours, theirs: theirs / ours >= 100.0,
    ),
    ("gpa_lookup_random", OURS): (
        "<= 0.5x vm-memory's time",
        lambda ours, theirs: ours <= 0.5 * theirs,
    ),
    ("gpa_lookup_repeated", OURS): ("<= 10 ns", lambda ours, theirs: ours <= 10.0),
    ("hva_lookup_random", OURS): ("<= 200 ns", lambda ours, theirs: ours <= 200.0),
}

MEMORY_LINE = re.compile(
    r"memslot-map memory: slots=(\d+) bytes_per_slot=([\d.]+) index_bytes=(\d+) slot_bytes=(\d+)"
)


def default_criterion_dir():
    if os.environ.get("CRITERION_HOME"):
        return Path(os.environ["CRITERION_HOME"])
    if os.environ.get("CARGO_TARGET_DIR"):
        return Path(os.environ["CARGO_TARGET_DIR"]) / "criterion"
    # benches/ -> memslot-map/ -> crates/ -> workspace root
    return Path(__file__).resolve().parents[3] / "target" / "criterion"


def load_results(criterion_dir):
    """{(group, function, slots): {"median": ns, "low": ns, "high": ns}}"""
    results = {}
    for bench_file in sorted(criterion_dir.glob("memslot-map_*/**/new/benchmark.json")):
        bench = json.loads(bench_file.read_text())
        group = bench.get("group_id", "")
        if not group.startswith(PREFIX) or bench.get("value_str") is None:
            continue
        estimates = json.loads((bench_file.parent / "estimates.json").read_text())
        median = estimates["median"]
        key = (group[len(PREFIX):], bench["function_id"], int(bench["value_str"]))
        results[key] = {
            "median_ns": median["point_estimate"],
            "ci95_ns": [
                median["confidence_interval"]["lower_bound"],
                median["confidence_interval"]["upper_bound"],
            ],
        }
    return results


def load_memory(log_file):
    memory = {}
    for line in Path(log_file).read_text(errors="replace").splitlines():
        match = MEMORY_LINE.search(line)
        if match:
            slots, per_slot, index_bytes, slot_bytes = match.groups()
            memory[int(slots)] = {
                "bytes_per_slot": float(per_slot),
                "index_bytes": int(index_bytes),
                "slot_bytes": int(slot_bytes),
            }
    return memory


def fmt_time(ns):
    if ns is None:
        return "-"
    for unit, scale in (("s", 1e9), ("ms", 1e6), ("µs", 1e3)):
        if ns >= scale:
            return f"{ns / scale:.3g} {unit}"
    return f"{ns:.3g} ns"


def fmt_ratio(ratio):
    if ratio is None:
        return "-"
    return f"{ratio:.3g}×" if ratio < 100 else f"{ratio:.0f}×"


def summarise(results):
    rows = []
    slot_counts = sorted({slots for (_, _, slots) in results})
    for group, ours_id, label in SCENARIOS:
        for slots in slot_counts:
            ours = results.get((group, ours_id, slots))
            theirs = results.get((group, THEIRS, slots))
            if ours is None and theirs is None:
                continue
            ours_ns = ours["median_ns"] if ours else None
            theirs_ns = theirs["median_ns"] if theirs else None
            ratio = theirs_ns / ours_ns if ours_ns and theirs_ns else None
            row = {
                "scenario": group,
                "ours": ours_id,
                "label": label,
                "slots": slots,
                "ours_ns": ours_ns,
                "ours_ci95_ns": ours["ci95_ns"] if ours else None,
                "vm_memory_ns": theirs_ns,
                "vm_memory_ci95_ns": theirs["ci95_ns"] if theirs else None,
                "ratio_vm_memory_over_ours": ratio,
                "target": None,
                "target_met": None,
            }
            target = TARGETS.get((group, ours_id))
            if target and slots == TARGET_SLOTS:
                row["target"] = target[0]
                if ours_ns is not None and theirs_ns is not None:
                    row["target_met"] = bool(target[1](ours_ns, theirs_ns))
            rows.append(row)
    return rows


def markdown(rows, memory):
    out = [
        "| scenario | slots | ours (median) | vm-memory (median) | ratio vm-memory / ours "
        "| target at 32764 | met? |",
        "|---|---:|---:|---:|---:|---|---|",
    ]
    for row in rows:
        met = {None: "", True: "**yes**", False: "**NO**"}[row["target_met"]]
        out.append(
            f"| {row['label']} | {row['slots']} | {fmt_time(row['ours_ns'])} "
            f"| {fmt_time(row['vm_memory_ns'])} | {fmt_ratio(row['ratio_vm_memory_over_ours'])} "
            f"| {row['target'] or ''} | {met} |"
        )
    if memory:
        out += [
            "",
            "| slots | bytes per slot (ours) | index bytes | slot bytes |",
            "|---:|---:|---:|---:|",
        ]
        for slots in sorted(memory):
            m = memory[slots]
            out.append(
                f"| {slots} | {m['bytes_per_slot']:.1f} | {m['index_bytes']} | {m['slot_bytes']} |"
            )
    return "\n".join(out)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--criterion-dir", type=Path, default=None)
    parser.add_argument("--log", default=None)
    args = parser.parse_args()

    criterion_dir = args.criterion_dir or default_criterion_dir()
    results = load_results(criterion_dir)
    if not results:
        sys.exit(
            f"no memslot-map results under {criterion_dir}: "
            "run `cargo bench -p memslot-map --bench map` first"
        )
    rows = summarise(results)
    memory = load_memory(args.log) if args.log else {}
    print(markdown(rows, memory))

    summary = {
        "estimate": "median of samples, nanoseconds per iteration",
        "target_slots": TARGET_SLOTS,
        "rows": rows,
        "bytes_per_slot": {str(k): v for k, v in sorted(memory.items())},
        "targets_met": {
            row["scenario"]: row["target_met"] for row in rows if row["target"] is not None
        },
    }
    out_file = criterion_dir / "memslot-map-summary.json"
    out_file.write_text(json.dumps(summary, indent=2) + "\n")
    print(f"\nwrote {out_file}", file=sys.stderr)


if __name__ == "__main__":
    main()
