"""Overlap, made visible: one traced step of each lesson at 2 ranks, and one table.

    make timelines            # or: .venv/bin/python -m scripts.perf.timelines [--out docs/figures]

Each run passes `--trace DIR` (a torch.profiler trace per rank that opens in
https://ui.perfetto.dev, and DIR/timeline.png) and reads the overlap the run measured
(`comm.overlap` in its report: communication time from issue to completion, the part the main
thread spent blocked waiting for it, and the share hidden behind computation). The charts for
01, 03 (4 buckets), 06 and 06 without prefetch are copied to OUT/timeline_<run>.png.
What `--trace DIR` does in any lesson's run is Trace below: measure.Run makes one only then
(matplotlib, and the profiler, are a tool's dependencies, not a lesson's).
"""
import json
import os
import shutil
import sys
import tempfile
import time
from contextlib import contextmanager

from scripts.runs import ROOT, Parser, at_least, launch, tool_main

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


class Trace:
    """`--trace DIR`, for measure.Run: over the measured step, torch.profiler (DIR/trace_rank{r}.json)
    and the phases, each loss.backward() and optimizer.step() timed; on CUDA, where the CPU clock
    cannot see NCCL overlap, the overlap from the trace's kernel times (gpu_overlap). Rank 0 then
    draws every rank's step: DIR/timeline.png."""

    def __init__(self, run):
        self.run, self.phases, self.gpu_overlap = run, [], None  # phases: [name, start, end]

    def timed(self, phase, fn):
        def timed_fn(*args, **kwargs):
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            self.phases.append([phase, t0, time.perf_counter()])
            return out
        return timed_fn

    @contextmanager
    def measuring(self):
        import torch
        from torch.profiler import ProfilerActivity, profile
        run, backward, step = self.run, torch.Tensor.backward, self.run.optimizer.step
        # outside Run's memory probe, which wraps this step: the phase leaves its sampling out
        torch.Tensor.backward, run.optimizer.step = self.timed("backward", backward), self.timed("optimizer", step)
        os.makedirs(run.args.trace, exist_ok=True)
        try:
            with profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * run.cuda) as prof:
                yield
        finally:
            torch.Tensor.backward, run.optimizer.step = backward, step
        path = os.path.join(run.args.trace, f"trace_rank{run.env.rank}.json")
        prof.export_chrome_trace(path)
        if run.cuda:
            self.gpu_overlap = gpu_overlap(path)

    def timeline(self):
        return timeline(self.run.comm, self.phases)

    def plot(self, timelines, strategy):
        """Rank 0, at the run's end: the timeline drawn, and one line saying where it all went."""
        path = f"{self.run.args.trace}/timeline.png"
        traces = f"{self.run.args.trace}/trace_rank{{0..{len(timelines) - 1}}}.json (they open in https://ui.perfetto.dev)"
        if None in timelines:  # NCCL: no rank's step on the CPU clock
            print(f"--trace: wrote {traces}")
            return
        try:
            import matplotlib  # noqa: F401  (the .venv has it; a lesson needs torch only)
        except ImportError:
            print(f"--trace: {path} not drawn: matplotlib is not installed (wrote {traces})")
            return
        plot_timeline(timelines, strategy, path)
        print(f"--trace: wrote {path} and {traces}")


def gpu_overlap(trace_path):
    """Overlap on a GPU, from a torch.profiler trace of the measured step: comm = the time NCCL
    kernels ran, exposed = the part of it with no other kernel running beside them (the GPU's
    compute did not hide it), hidden share = 1 - exposed / comm. None if the trace has none."""
    from lessonkit.comm_meter import union  # (imports torch: only where a run is traced)
    with open(trace_path) as f:
        events = json.load(f).get("traceEvents", [])
    kernels = [(e["name"], e["ts"], e["ts"] + e["dur"]) for e in events
               if e.get("cat") == "kernel" and "dur" in e]
    comm = [(a, b) for name, a, b in kernels if "nccl" in name.lower()]
    compute = [(a, b) for name, a, b in kernels if "nccl" not in name.lower()]
    if not comm:
        return None
    total = union(comm)
    hidden = total + union(compute) - union(comm + compute)  # |comm & compute|
    return {"comm_ms": total / 1e3, "exposed_ms": (total - hidden) / 1e3,  # trace times are in us
            "hidden_share": hidden / total, "source": "GPU kernel times (profiler)"}


def timeline(meter, phases=()):
    """A comm_meter.CommMeter's measured step, laid out for the chart in ms from its start: the
    collectives [kind, start, end], the main thread's blocked intervals, and the phases (Trace's),
    forward = from the step's start, or the last backward's end, to a backward. None where the
    CPU clock means nothing (NCCL) or nothing was measured."""
    if meter.window is None or not meter.cpu_timed:
        return None
    start, end = meter.window
    ms = lambda t: (min(t, end) - start) * 1e3
    out, last = [], 0.0
    for name, a, b in phases:  # backward and optimizer never nest: in order of time
        out += [["forward", last, ms(a)]] * (name == "backward") + [[name, ms(a), ms(b)]]
        last = ms(b)
    return {"step_ms": ms(end), "phases": out,
            "comm": [[k, ms(a), ms(end if b is None else b)] for k, a, b in meter.spans if a < end],
            "blocked": [[ms(a), ms(b)] for a, b in meter.blocked if a < end]}


def plot_timeline(timelines, strategy, path):
    """The measured step per rank: its phases shaded (backward = inside loss.backward(); optimizer =
    inside optimizer.step()); the main thread, computing or blocked; each collective from issue to
    completion, one lane down if issued while another was still in flight."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch
    colours = {"all_reduce": "#4C72B0", "reduce_scatter": "#DD8452", "all_gather": "#55A868", "broadcast": "#8172B3"}
    phases = {"forward": "#DCE9F5", "backward": "#FBE3D2", "optimizer": "#DDEFDD"}
    fig, ax = plt.subplots(layout="constrained")
    y, ticks = 0.0, []
    for rank, tl in enumerate(timelines):
        ends = []  # per lane, when its last collective completes (spans come in issue order)
        for kind, a, b in tl["comm"]:
            lane = next((i for i, e in enumerate(ends) if e <= a), len(ends))
            ends[lane:lane + 1] = [b]
            ax.broken_barh([(a, max(b - a, 1e-3))], (y + 0.95 + 0.45 * lane, 0.38), linewidth=0.6,
                           facecolors=colours.get(kind, "tab:gray"), edgecolor="black")
        h = 1.0 + 0.45 * len(ends)
        for name, a, b in tl.get("phases", []):
            ax.broken_barh([(a, b - a)], (y, h), facecolors=phases[name], zorder=0)
            if b - a > 0.06 * tl["step_ms"]:
                ax.text((a + b) / 2, y + 0.17, name, ha="center", va="center", fontsize=8, color="dimgray")
        ax.broken_barh([(0, tl["step_ms"])], (y + 0.35, 0.5), facecolors="lightgray")
        ax.broken_barh([(a, b - a) for a, b in tl["blocked"]], (y + 0.35, 0.5), facecolors="tab:red")
        ticks += [(y + 0.6, f"rank {rank}: main thread"), (y + h / 2 + 0.45, "collectives" * bool(ends))]
        y += h + 0.3
    ax.set_yticks(*zip(*ticks), fontsize=8)
    ax.set_ylim(y - 0.3, -0.05)  # rank 0 on top
    kinds = {k for tl in timelines for k, *_ in tl["comm"]}
    handles = [Patch(facecolor=c, label=f"phase: {p}") for p, c in phases.items()] + [Patch(
        facecolor=c, label=f"main thread: {p}") for p, c in (("compute", "lightgray"), ("blocked on comm", "tab:red"))]
    fig.legend(handles=handles + [Patch(facecolor=c, edgecolor="black", label=f"{k}: issue to completion")
                                  for k, c in colours.items() if k in kinds], loc="outside lower center", ncol=3, fontsize=8)
    ax.set(xlabel="time since the measured step began (ms)", title=f"{strategy}: one step per rank, phases and collectives")
    fig.set_size_inches(11, 1.8 + 0.8 * y)
    fig.savefig(path, dpi=120)
    plt.close(fig)



def main():
    p = Parser("timelines", description=__doc__)
    p.add_argument("--out", default=os.path.join(ROOT, "docs", "figures"), help="where the charts go")
    p.add_argument("--nproc", type=at_least(1), default=2)
    a = p.parse_args()
    p.folder("--out", a.out)
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
    sys.exit(tool_main("timelines", main))
