"""What the two notebooks share: running the measurements, and one figure style for a projector.

Not part of any lesson. The notebooks call
    sweeps()            every lesson at every world size, in one torchrun launch (scripts/perf/sweep.py)
    bandwidth(world)    all-reduce / reduce-scatter / all-gather by message size, gloo's and lesson
                        00's ring (scripts/perf/bandwidth.py --ring)
    zero3_timelines(world)  ZeRO-3's parameter bytes over a step, with and without prefetch
    activation_runs()   activations beside the model states; 06 at a large batch, with and without
                        checkpointing
    style(), save(fig, name)

Environment (set by `make figures` through scripts/perf/figures.py, and by tests/test_notebooks.py):
    NOTEBOOK_QUICK=1    fewer world sizes and message sizes (the test suite's budget)
    FIGURES_DIR=path    also write every figure there as PNG
    NOTEBOOK_CACHE=dir  where sweep results are kept (default runs/notebook_cache)
"""
import hashlib
import json
import os
import sys

import matplotlib as mpl
import matplotlib.pyplot as plt

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # the notebook runs in notebooks/; the lessons and tools live one up
    sys.path.insert(0, ROOT)

from scripts.runs import LESSONS, available_lessons, launch  # noqa: E402

QUICK = os.environ.get("NOTEBOOK_QUICK") == "1"
FIGURES_DIR = os.environ.get("FIGURES_DIR")
CACHE = os.environ.get("NOTEBOOK_CACHE") or os.path.join(ROOT, "runs", "notebook_cache")
# 8 ranks on a 2-core machine are slow (oversubscribed 4x): only for `make figures`
WORLDS = [1, 2, 4] if QUICK else [1, 2, 4, 8]
# A small GPT (Psi = 106,240) in the ZeRO paper's mixed precision (bf16 parameters and
# gradients, fp32 master weights and Adam moments: 2 + 2 + 12 bytes per parameter). Step 0
# creates Adam's moments, so the measured step is a later one.
FLAGS = ["--n-layer", "2", "--d-model", "64", "--seq-len", "32", "--global-batch", "8",
         "--steps", "3", "--measure-step", "2", "--precision", "bf16", "--log-every", "100"]
# ZeRO-3's timeline, with and without prefetch, at 4 ranks: more blocks show the pattern
# better (a separate model then, kept apart from the comparison of lessons)
TIMELINE_WORLD = 4
TIMELINE = ["06_zero3", "06_zero3 --prefetch 0"] if QUICK else \
    ["06_zero3 --n-layer 6", "06_zero3 --n-layer 6 --prefetch 0"]

# Activations beside the model states (memory.ipynb's Figure 1c), at ACT_WORLD ranks with the
# activations tracked (per-operation sampling: only these runs); then 06 at a batch ACT_BATCH
# times larger, where they dominate, with and without recomputing each block
ACT_WORLD, ACT_BATCH = 2, 64
ACT_BIG = [f"06_zero3 --global-batch {ACT_BATCH}", f"06_zero3 --global-batch {ACT_BATCH} --activation-checkpointing block"]
ACT_RUNS = (["06_zero3"] if QUICK else list(LESSONS)) + ACT_BIG

MIB = 2 ** 20
KIB = 2 ** 10
NAMES = {"01_vanilla_dp": "01 DP", "02_async_allreduce": "02 async", "03_buckets": "03 buckets",
         "04_zero1": "04 ZeRO-1", "05_zero2": "05 ZeRO-2", "06_zero3": "06 ZeRO-3", "07_offload": "07 offload",
         "08_hybrid": "08 HSDP"}
# model-state categories, in stacking order, with one colour each in every figure
CATEGORIES = [("params", "parameters (bf16; 06, 08: fp32 shards)", "#4C72B0"),
              ("grads", "gradients (bf16; 06, 08: fp32 shards)", "#DD8452"),
              ("moments", "Adam moments (fp32)", "#55A868"), ("master_weights", "master weights (fp32 copy)", "#8172B3"),
              ("other", "other buffers", "#937860")]
COLLECTIVES = [("all_reduce", "all-reduce", "#4C72B0"), ("reduce_scatter", "reduce-scatter", "#DD8452"),
               ("all_gather", "all-gather", "#55A868")]


# ----------------------------------------------------------------------------- measurements
def _code_hash(extra):
    """Everything a sweep's result depends on: its arguments and the code that produced it."""
    import torch
    h = hashlib.sha256(json.dumps([extra, torch.__version__]).encode())
    files = sorted(n for n in os.listdir(ROOT) if n.endswith(".py")) + ["scripts/perf/sweep.py"]  # every module
    for name in files:
        path = os.path.join(ROOT, name)
        if os.path.exists(path):
            with open(path, "rb") as f:
                h.update(name.encode() + f.read())
    return h.hexdigest()[:16]


def sweeps(worlds=None, flags=FLAGS):
    """{world: {run name: report}}: every lesson at every world size, in ONE torchrun launch of
    max(worlds) ranks (scripts/perf/sweep.py re-forms the group for the smaller sizes); the ZeRO-3
    timeline runs ride along at TIMELINE_WORLD ranks.

    Kept in CACHE under a hash of the arguments and of every source file that could change the
    result, so the second notebook (or a re-run) reuses a fresh result and never a stale one."""
    worlds = sorted(worlds or WORLDS)
    lessons = available_lessons()
    extra = [r for r in TIMELINE if r not in lessons] if TIMELINE_WORLD in worlds else []
    # per-operation sampling of parameter bytes (~2 ms an operation) only where it is plotted
    track = [r for r in lessons + extra if r.startswith("06_zero3")]
    argv = [*flags, "--worlds", *map(str, worlds), "--lessons", *lessons, "--track-peak", *track]
    if extra:
        argv += ["--at", str(TIMELINE_WORLD), *extra]
    return _sweep(max(worlds), argv)


def zero3_timelines(world=TIMELINE_WORLD):
    """{run: report} for the ZeRO-3 timeline runs (TIMELINE) at `world` ranks: sweeps()' own at
    TIMELINE_WORLD, else one launch of just those two runs (about 20 s at 2-8 ranks, cached)."""
    if world == TIMELINE_WORLD:
        return {name: sweeps()[world][name] for name in TIMELINE}
    return _sweep(world, [*FLAGS, "--lessons", *TIMELINE, "--track-peak", *TIMELINE])[world]


def activation_runs():
    """{run: report} for ACT_RUNS at ACT_WORLD ranks, activations measured (one launch, cached)."""
    runs = [r for r in ACT_RUNS if r.split()[0] in available_lessons()]
    return _sweep(ACT_WORLD, [*FLAGS, "--lessons", *runs, "--track-peak", *runs])[ACT_WORLD]


MUON_WORLD = 4  # memory.ipynb's Figure 4: 04 and 09 side by side


def muon_runs(world=MUON_WORLD):
    """{run: report} for 04 (AdamW over flat shards) and 09 (Muon, whole matrices per owner) at
    `world` ranks (one launch, cached)."""
    return _sweep(world, [*FLAGS, "--lessons", "04_zero1", "09_muon"])[world]


# memory.ipynb's Figure 5: one rank of N simulated (--simulate-world), the default GPT (Psi = 0.81M)
SIM_LESSONS = ["01_vanilla_dp", "04_zero1", "05_zero2", "06_zero3"]
SIM_WORLDS = [64] if QUICK else [1, 8, 64, 1024]  # (quick: the N both panels show)


def simulated_runs(worlds=SIM_WORLDS):
    """{(lesson, N): report} of rank 0 of N, simulated alone (lessonkit/simulate.py), bf16, the second
    step measured (AdamW's moments exist by then); cached as the sweeps are. (Rank 0: the last rank's
    shards end in each flat buffer's padding, up to N - 1 elements, which at N = 1024 is most of them.)"""
    out = {}
    for lesson in SIM_LESSONS:
        for n in worlds:
            argv = ["--seq-len", "8", "--global-batch", n, "--steps", "2", "--measure-step", "1", "--peak-params", "0",
                    "--precision", "bf16", "--simulate-world", n, "--simulate-rank", 0]
            path = os.path.join(CACHE, f"simulated_{_code_hash([lesson, argv])}.json")
            if not os.path.exists(path):
                os.makedirs(CACHE, exist_ok=True)
                with open(path + ".tmp", "w") as f:
                    json.dump(launch(lesson, 1, argv), f)
                os.replace(path + ".tmp", path)
            with open(path) as f:
                out[lesson, n] = json.load(f)
    return out


def figure1_at_scale():
    """[(lesson "01", Psi, N, measured bytes per rank, formula bytes)] from docs/results.md's table that
    `make figure1` writes (one rank of N simulated at the paper's size); [] where it has not run."""
    path = os.path.join(ROOT, "docs", "results.md")
    text = open(path).read() if os.path.exists(path) else ""
    section = text[text.find("<!-- figure1 -->"):text.find("<!-- /figure1 -->")] if "<!-- figure1 -->" in text else ""
    rows = [line.split("|")[1:-1] for line in section.splitlines() if line.startswith("| 0")]
    return [(r[0].strip(), float(r[2].strip()[:-1]) * 1e9, int(r[3]), float(r[4]) * 1e9, float(r[5]) * 1e9) for r in rows]


def _sweep(nproc, argv):
    """scripts/perf/sweep.py on `nproc` ranks, kept in CACHE under a hash of argv and the code."""
    path = os.path.join(CACHE, f"sweep_{_code_hash([nproc, argv])}.json")
    if not os.path.exists(path):
        result = launch("scripts.perf.sweep", nproc, argv)  # torchrun ... sweep.py --report ...
        os.makedirs(CACHE, exist_ok=True)
        with open(path + ".tmp", "w") as f:
            json.dump(result, f)
        os.replace(path + ".tmp", path)  # whole or not at all
    with open(path) as f:
        return {int(w): r["reports"] for w, r in json.load(f)["worlds"].items()}


def bandwidth(world=2):
    """scripts/perf/bandwidth.py at `world` ranks: a timing, so it is measured afresh every time."""
    return launch("scripts.perf.bandwidth", world, ["--ring"] + (["--quick"] if QUICK else []))


# ----------------------------------------------------------------------------- figures
def style():
    """Large type and thick lines: the figures are read from the back of a lecture room."""
    mpl.rcParams.update({
        "figure.figsize": (13, 6.5), "figure.dpi": 80, "savefig.dpi": 110,
        "font.size": 16, "axes.titlesize": 19, "axes.labelsize": 17, "legend.fontsize": 14,
        "xtick.labelsize": 15, "ytick.labelsize": 15, "lines.linewidth": 3, "lines.markersize": 10,
        "axes.spines.top": False, "axes.spines.right": False, "axes.grid": True, "grid.alpha": 0.3,
        "hatch.linewidth": 1.5, "figure.constrained_layout.use": True,
    })


def save(fig, name):
    """Show the figure; with FIGURES_DIR set, also write it as FIGURES_DIR/name.png."""
    if FIGURES_DIR:
        os.makedirs(FIGURES_DIR, exist_ok=True)
        fig.savefig(os.path.join(FIGURES_DIR, f"{name}.png"), facecolor="white")
    plt.show()


def held(mem):
    """A report's memory entry as the figure's categories: the optimizer state split into Adam's
    moments (and step counters) and the fp32 master weights."""
    return {"params": mem["params"], "grads": mem["grads"],
            "moments": mem["optimizer"] - mem["master_weights"],
            "master_weights": mem["master_weights"], "other": mem.get("other", 0)}


def tiers(report, rank=0):
    """{"device": (measured, formula), "host": (...)}: bytes of model states per tier on `rank`.
    07 reports its tiers; every other lesson keeps all of its model states on its device."""
    mem, t = report["memory"]["per_rank"][rank], report["memory"]["theory"]
    if "host" not in mem:
        return {"device": (mem["params"] + mem["grads"] + mem["optimizer"], t["total"]), "host": (0, 0)}
    return {tier: (sum(mem[tier][k] for k in ("params", "grads", "optimizer")),
                   sum(report["memory"]["theory_tiers"][tier].values())) for tier in ("device", "host")}


def theory_split(report):
    """A report's ZeRO formula for its stage, world size and precision, as held()'s categories."""
    t = report["memory"]["theory"]
    return {"params": t["params"], "grads": t["grads"], "moments": t["optimizer"] - t["master_weights"],
            "master_weights": t["master_weights"], "other": 0}
