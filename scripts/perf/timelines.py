"""Overlap, made visible: one traced step of each lesson at 2 ranks, and one table.

    make timelines            # or: .venv/bin/python -m scripts.perf.timelines [--out docs/figures]

Each run passes `--trace DIR` (measure.Run: a torch.profiler trace per rank that opens in
https://ui.perfetto.dev, and DIR/timeline.png) and reads the overlap the run measured
(`comm.overlap` in its report: communication time from issue to completion, the part the main
thread spent blocked waiting for it, and the share hidden behind computation). The charts for
01, 03 (4 buckets), 06 and 06 without prefetch are copied to OUT/timeline_<run>.png.
"""
import argparse
import os
import shutil
import sys
import tempfile

from scripts.runs import ROOT, launch

RUNS = [  # (label, lesson, extra flags, chart name or None)
    ("01 blocking all-reduce", "01_vanilla_dp", [], "01"),
    ("02 async per gradient", "02_async_allreduce", [], None),
    ("03 --bucket-mb 1 (4 buckets)", "03_buckets", ["--bucket-mb", "1"], "03"),
    ("05 --bucket-mb 1", "05_zero2", ["--bucket-mb", "1"], None),
    ("06 prefetch", "06_zero3", [], "06_prefetch"),
    ("06 --prefetch 0", "06_zero3", ["--prefetch", "0"], "06_no_prefetch"),
]
# a few warm-up steps before the traced one; no per-op memory sampling, which would slow
# compute and so inflate how much communication it seems to hide
FLAGS = ["--steps", "6", "--measure-step", "4", "--log-every", "100", "--peak-params", "0"]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.path.join(ROOT, "docs", "figures"), help="where the charts go")
    p.add_argument("--nproc", type=int, default=2)
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    rows = []
    for label, lesson, extra, chart in RUNS:
        with tempfile.TemporaryDirectory() as trace:
            report = launch(lesson, a.nproc, FLAGS + extra + ["--trace", trace])
            if chart:
                shutil.copy(os.path.join(trace, "timeline.png"), os.path.join(a.out, f"timeline_{chart}.png"))
        ov = report["comm"]["overlap_per_rank"]
        rows.append((label, [o["comm_ms"] for o in ov], [o["exposed_ms"] for o in ov],
                     [o["hidden_share"] for o in ov]))
        print(f"  {label}: done", file=sys.stderr, flush=True)
    print(f"\n{a.nproc} ranks, CPU (gloo), one traced step (step 4 of 6) per run\n")
    print("| run | comm (ms), per rank | exposed (ms), per rank | hidden, per rank |")
    print("|---|---:|---:|---:|")
    for label, comm, exposed, hidden in rows:
        fmt = lambda xs, f: " / ".join(f.format(x) for x in xs)
        print(f"| {label} | {fmt(comm, '{:.1f}')} | {fmt(exposed, '{:.1f}')} | {fmt(hidden, '{:.0%}')} |")
    print(f"\ncharts: {', '.join(f'timeline_{c}.png' for *_, c in RUNS if c)} in {os.path.relpath(a.out, ROOT)}/")


if __name__ == "__main__":
    main()
