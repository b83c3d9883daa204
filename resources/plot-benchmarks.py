#!/usr/bin/env python3
"""Draw the benchmarks' scaling curves as SVG images from their JSON output.

Reads, where present:
  - memslot-map's summary (`crates/memslot-map/benches/summarize.py` writes it to
    target/criterion/memslot-map-summary.json): one image per scenario, time per operation
    against slot count, ours and vm-memory's, log-log;
  - tinyvmm's harvest bench (`tinyvmm-bench harvest-bench` writes target/bench/tinyvmm-harvest.json):
    harvest time against the share of pages dirtied, dirty ring against bitmap, log-log.

Writes the images to docs/plots/ (or --out). Python 3 standard library only: the images are
plain SVG drawn here, so the benchmark scripts need nothing installed.

Options:
  --map FILE      memslot-map summary JSON (default target/criterion/memslot-map-summary.json)
  --harvest FILE  harvest bench JSON (default target/bench/tinyvmm-harvest.json)
  --out DIR       where the SVG files go (default docs/plots)
"""

import argparse
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

WIDTH, HEIGHT = 680, 420
LEFT, RIGHT, TOP, BOTTOM = 80, 20, 56, 74
COLOURS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd"]
MARKERS = ["circle", "square", "circle", "square"]


def fmt_value(value, unit):
    """A tick label: 1, 10, 100 with the unit scaled (ns -> µs -> ms -> s)."""
    if unit == "ns":
        for scale, name in ((1e9, "s"), (1e6, "ms"), (1e3, "µs"), (1, "ns")):
            if value >= scale:
                return f"{value / scale:g} {name}"
        return f"{value:g} ns"
    if unit == "us":
        return fmt_value(value * 1e3, "ns")
    if unit == "%":
        return f"{value:g}%"
    return f"{value:g}"


def decades(low, high):
    """The powers of ten that cover [low, high]."""
    first = math.floor(math.log10(low))
    last = math.ceil(math.log10(high))
    return [10.0**e for e in range(first, last + 1)]


def escape(text):
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def loglog_svg(title, x_label, x_unit, y_label, y_unit, series, note=None):
    """An SVG log-log chart. `series` is [(name, [(x, y), ...])]; points with a value <= 0 or
    None are left out (a log axis cannot show them)."""
    series = [
        (name, [(x, y) for x, y in points if x and y and x > 0 and y > 0])
        for name, points in series
    ]
    series = [(name, points) for name, points in series if points]
    if not series:
        return None
    xs = [x for _, pts in series for x, _ in pts]
    ys = [y for _, pts in series for _, y in pts]
    x_ticks, y_ticks = decades(min(xs), max(xs)), decades(min(ys), max(ys))
    x0, x1 = math.log10(x_ticks[0]), math.log10(x_ticks[-1])
    y0, y1 = math.log10(y_ticks[0]), math.log10(y_ticks[-1])
    x1 = x1 if x1 > x0 else x0 + 1
    y1 = y1 if y1 > y0 else y0 + 1
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def px(x):
        return LEFT + (math.log10(x) - x0) / (x1 - x0) * plot_w

    def py(y):
        return TOP + plot_h - (math.log10(y) - y0) / (y1 - y0) * plot_h

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
        f'viewBox="0 0 {WIDTH} {HEIGHT}" font-family="sans-serif" font-size="12">',
        f'<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>',
        f'<text x="{WIDTH / 2}" y="22" text-anchor="middle" font-size="14">{escape(title)}</text>',
    ]
    for t in x_ticks:
        x = px(t)
        out.append(f'<line x1="{x:.1f}" y1="{TOP}" x2="{x:.1f}" y2="{TOP + plot_h}" stroke="#ddd"/>')
        out.append(
            f'<text x="{x:.1f}" y="{TOP + plot_h + 16}" text-anchor="middle">'
            f"{escape(fmt_value(t, x_unit))}</text>"
        )
    for t in y_ticks:
        y = py(t)
        out.append(f'<line x1="{LEFT}" y1="{y:.1f}" x2="{LEFT + plot_w}" y2="{y:.1f}" stroke="#ddd"/>')
        out.append(
            f'<text x="{LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">'
            f"{escape(fmt_value(t, y_unit))}</text>"
        )
    out.append(
        f'<rect x="{LEFT}" y="{TOP}" width="{plot_w}" height="{plot_h}" fill="none" stroke="#333"/>'
    )
    out.append(
        f'<text x="{LEFT + plot_w / 2}" y="{TOP + plot_h + 34}" text-anchor="middle">{escape(x_label)}</text>'
    )
    out.append(
        f'<text transform="translate(18 {TOP + plot_h / 2}) rotate(-90)" text-anchor="middle">'
        f"{escape(y_label)}</text>"
    )
    for i, (name, points) in enumerate(series):
        colour = COLOURS[i % len(COLOURS)]
        path = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in points)
        out.append(f'<polyline points="{path}" fill="none" stroke="{colour}" stroke-width="2"/>')
        for x, y in points:
            if MARKERS[i % len(MARKERS)] == "circle":
                out.append(f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="3.5" fill="{colour}"/>')
            else:
                out.append(
                    f'<rect x="{px(x) - 3.5:.1f}" y="{py(y) - 3.5:.1f}" width="7" height="7" '
                    f'fill="{colour}"/>'
                )
        # The legend: one row above the plot, entries side by side.
        lx = LEFT + i * (plot_w // max(len(series), 1))
        out.append(
            f'<line x1="{lx}" y1="{TOP - 12}" x2="{lx + 24}" y2="{TOP - 12}" '
            f'stroke="{colour}" stroke-width="2"/>'
        )
        out.append(f'<text x="{lx + 30}" y="{TOP - 8}">{escape(name)}</text>')
    for k, line in enumerate(note or []):
        out.append(
            f'<text x="{LEFT}" y="{HEIGHT - 22 + 13 * k}" font-size="10" fill="#555">'
            f"{escape(line)}</text>"
        )
    out.append("</svg>")
    return "\n".join(out) + "\n"


def map_plots(summary):
    """{file name: svg} for memslot-map's scenarios."""
    plots = {}
    by_label = {}
    for row in summary["rows"]:
        by_label.setdefault((row["scenario"], row["ours"], row["label"]), []).append(row)
    for (scenario, ours, label), rows in by_label.items():
        rows.sort(key=lambda r: r["slots"])
        svg = loglog_svg(
            f"memslot-map: {label}",
            "slots in the map",
            "",
            "time per operation (median)",
            "ns",
            [
                ("ours (MemslotMap)", [(r["slots"], r["ours_ns"]) for r in rows]),
                ("vm-memory (GuestMemoryMmap)", [(r["slots"], r["vm_memory_ns"]) for r in rows]),
            ],
            note=["cargo bench -p memslot-map --bench map, then benches/summarize.py; both sides",
                  "in the same run, on the same regions"],
        )
        name = f"map-{scenario}" + ("" if ours == "MemslotMap" else "-" + ours.split("-")[-1])
        if svg:
            plots[name + ".svg"] = svg
    return plots


def harvest_plots(bench):
    rows = [r for r in bench["rows"] if r["dirtied_percent"] > 0 and r.get("pattern", "scattered") == "scattered"]
    clustered = [r for r in bench["rows"] if r.get("pattern") == "clustered"]
    svg = loglog_svg(
        f"Harvest of {bench['slots']} slots ({bench['area_size'] >> 20} MiB), one vCPU",
        "share of pages dirtied since the last harvest",
        "%",
        "harvest time",
        "us",
        [
            ("bitmap, scattered", [(r["dirtied_percent"], r["bitmap_harvest_us"]) for r in rows]),
            # Where the pages outnumber the ring's entries, the ring filled during the writes
            # and most entries were collected then: the harvest's own time would mislead.
            ("ring, scattered", [
                (r["dirtied_percent"], r["ring_harvest_us"])
                for r in rows
                if r["dirty_pages"] <= bench["ring_entries"]
            ]),
            ("ring, neighbouring", [
                (r["dirtied_percent"], r["ring_harvest_us"])
                for r in clustered
                if r["dirty_pages"] <= bench["ring_entries"]
            ]),
        ],
        note=[
            f"tinyvmm-bench harvest-bench; one {bench['ring_entries']}-entry ring. Ring points only where the pages dirtied",
            "fit in the ring: past that, a full ring is collected during the writes (KVM_EXIT_DIRTY_RING_FULL).",
        ],
    )
    return {"harvest-ring-vs-bitmap.svg": svg} if svg else {}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--map", type=Path, default=ROOT / "target/criterion/memslot-map-summary.json")
    parser.add_argument("--harvest", type=Path, default=ROOT / "target/bench/tinyvmm-harvest.json")
    parser.add_argument("--out", type=Path, default=ROOT / "docs/plots")
    args = parser.parse_args()

    plots = {}
    for path, make in ((args.map, map_plots), (args.harvest, harvest_plots)):
        if path.exists():
            plots.update(make(json.loads(path.read_text())))
        else:
            print(f"{path} not found: its plots are skipped", file=sys.stderr)
    if not plots:
        sys.exit("no benchmark JSON found: run the benchmarks first (docs/BENCHMARKS.md)")
    args.out.mkdir(parents=True, exist_ok=True)
    for name, svg in sorted(plots.items()):
        (args.out / name).write_text(svg)
        print(f"wrote {args.out / name}")


if __name__ == "__main__":
    main()
