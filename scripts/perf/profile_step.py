"""Profile a lesson's training steps: where the time goes, by Python function or by torch op.

    .venv/bin/python -m scripts.perf.profile_step 03_buckets                  # 2 ranks, the default model
    .venv/bin/python -m scripts.perf.profile_step 01_vanilla_dp --config many-small
    .venv/bin/python -m scripts.perf.profile_step 04_zero1 --tool torch       # torch.profiler's op table
    .venv/bin/python -m scripts.perf.profile_step torch:ddp                   # PyTorch's counterpart
    .venv/bin/python -m scripts.perf.profile_step 06_zero3 --nproc 1 --n-layer 8   # other flags: the lesson's

Runs the lesson's own main() (under torchrun when --nproc > 1) and profiles a window of
`--count` steps after 3 warm-up steps; `--count` more steps follow unprofiled (their median is
printed next to the profiled steps', so the profiler's own cost shows), then the measured step
(the last, not profiled). Rank 0 prints:
- cprofile (default): the functions with the most time of their own per step, then the
  project's own functions (lessons, bucket.py and the support modules) by cumulative
  time per step: the lesson's Python overhead, and what measurement costs when not measuring;
- torch: torch.profiler's table of operators by self CPU time per step (aten::cat, aten::empty,
  copies, the collectives' c10d:: calls...).
cProfile adds a few microseconds to every Python call, so Python-heavy code looks heavier
than it is: compare functions with each other, not with the unprofiled step time.
docs/profiling.md holds what these showed and what was changed.
"""
import cProfile
import importlib.util
import io
import os
import pstats
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager

from scripts.runs import ROOT, Parser, at_least

WARMUP = 3
OWN = ("0", "bucket.py", "checkpoint.py", "comm_meter.py", "common.py", "ddp.py", "lifecycle.py", "measure.py",
       "memory_ledger.py", "model.py", "optimizers.py", "reshard.py")  # the project's files, by name


def load(name):
    """A lesson (`03_buckets`) or a PyTorch counterpart (`torch:ddp`) as (module, extra argv)."""
    if name.startswith("torch:"):
        path, extra = os.path.join(ROOT, "scripts", "perf", "torch_reference.py"), ["--impl", name.split(":", 1)[1]]
    else:
        path, extra = os.path.join(ROOT, f"{name}.py"), []
    if not os.path.exists(path):
        sys.exit(f"error: no {os.path.relpath(path, ROOT)}")
    spec = importlib.util.spec_from_file_location(name.replace(":", "_"), path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # nothing runs at import
    return module, extra


def profile(a, lesson_argv):
    import torch.distributed as dist

    from lessonkit import measure
    module, extra = load(a.lesson)
    window = range(WARMUP, WARMUP + a.count)
    steps = WARMUP + 2 * a.count + 1
    rank = int(os.environ.get("RANK", "0"))
    prof = cProfile.Profile() if a.tool == "cprofile" else None
    torch_prof = None
    step_wall = {}
    original = measure.Run.step

    @contextmanager
    def profiled_step(run, step):  # Run.step, the whole of it: the loss all-reduce and logging too
        nonlocal torch_prof
        if step == window.start and a.tool == "torch":
            from torch.profiler import ProfilerActivity
            from torch.profiler import profile as torch_profile
            torch_prof = torch_profile(activities=[ProfilerActivity.CPU])
            torch_prof.__enter__()
        if step in window and prof:
            prof.enable()
        t0 = time.perf_counter()
        with original(run, step) as losses:
            yield losses
        step_wall[step] = time.perf_counter() - t0
        if step in window and prof:
            prof.disable()
        if step == window.stop - 1 and torch_prof:
            torch_prof.__exit__(None, None, None)

    measure.Run.step = profiled_step
    argv = [*extra, *lesson_argv, "--steps", str(steps), "--measure-step", str(steps - 1),
            "--peak-params", "0", "--log-every", str(10 ** 6)]
    run = module.main(argv)
    measure.Run.step = original
    if rank != 0:
        return
    profiled = statistics.median(step_wall[s] for s in window)
    plain = statistics.median(step_wall[s] for s in range(window.stop, steps - 1))
    print(f"\n{a.lesson} {' '.join(lesson_argv)} | world {dist.get_world_size() if dist.is_initialized() else 1} "
          f"| Psi = {run.psi:,} | steps {window.start}..{window.stop - 1} profiled ({a.tool}): median "
          f"{1e3 * profiled:.1f} ms per step; steps {window.stop}..{steps - 2} unprofiled: {1e3 * plain:.1f} ms")
    if prof:
        out = io.StringIO()
        stats = pstats.Stats(prof, stream=out)
        print(f"\ntop {a.top} functions by own time (ms per step; cProfile's own cost included)")
        _print(stats, "tottime", a.count, a.top, lambda f: True)
        print("\nthe project's own functions by cumulative time (ms per step)")
        _print(stats, "cumtime", a.count, a.top, lambda f: os.path.basename(f[0]).startswith(OWN)
               and os.path.dirname(os.path.abspath(f[0])) == ROOT)
    else:
        table = torch_prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=a.top)
        print(f"\ntorch.profiler, {a.count} steps together (divide by {a.count} for one step)\n{table}")


def _print(stats, key, count, top, keep):
    rows = [(f, s) for f, s in stats.stats.items() if keep(f)]
    idx = {"tottime": 2, "cumtime": 3}[key]
    rows.sort(key=lambda fs: fs[1][idx], reverse=True)
    print(f"{'own ms':>8} {'cum ms':>8} {'calls':>7}  function")
    for (path, line, name), (cc, nc, tt, ct, _) in rows[:top]:
        where = f"{os.path.relpath(path, ROOT) if path.startswith(ROOT) else os.path.basename(path)}:{line}"
        print(f"{1e3 * tt / count:8.2f} {1e3 * ct / count:8.2f} {nc / count:7.0f}  {name} ({where})")


def main():
    p = Parser("profile_step", description=__doc__)
    p.add_argument("lesson", help="e.g. 03_buckets, or torch:ddp / torch:zero_redundancy / torch:fsdp2")
    p.add_argument("--nproc", type=at_least(1), default=2, help="ranks (torchrun); 1 runs in this process")
    p.add_argument("--config", choices=["default", "many-small"], default="default",
                   help="bench.py's model configurations")
    p.add_argument("--tool", choices=["cprofile", "torch"], default="cprofile")
    p.add_argument("--count", type=at_least(1), default=5, help="steps profiled (and as many unprofiled)")
    p.add_argument("--top", type=at_least(1), default=25)
    a, lesson_argv = p.parse_known_args()
    from scripts.perf.bench import CONFIGS
    lesson_argv = ["--device", "cpu"] + CONFIGS[a.config] + lesson_argv  # the lesson's own flags last: they win
    if a.nproc > 1 and "RANK" not in os.environ:  # start the ranks, each running this file
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={a.nproc}",
               "-m", "scripts.perf.profile_step", *sys.argv[1:]]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        sys.exit(subprocess.run(cmd, cwd=ROOT, env=env).returncode)
    from lessonkit import lifecycle
    lifecycle.run_main(lambda: profile(a, lesson_argv))


if __name__ == "__main__":
    main()
