"""The GPU check: every lesson on CUDA with NCCL, one table, on any machine with GPUs.

    make gpu-check                     # with the project's .venv
    PYTHON=python3 make gpu-check      # with the machine's own Python and torch (no .venv, no network)
    python3 -m scripts.perf.gpu_check --quick          # a small model, a few steps: a smoke test

Runs every lesson at world 1, and at world = the number of GPUs when there are two or more, in
fp32 and bf16, on a GPT of 29.7M parameters, and prints per run: the final loss and its
distance from the same training on the CPU (single process, gloo), the median step time,
tokens/s, the GPU's peak allocated memory in the measured step beside the model states the ZeRO
formula gives, the ring bytes sent per rank against theory, and the share of communication
hidden behind compute (from the GPU's kernel times; at world 1 there is no communication).
Then 05 and 06 again with the CUDA caching allocator off (PYTORCH_NO_CUDA_MEMORY_CACHING=1: a
buffer freed while a collective still uses it is then really gone, not kept by the cache), and
06 saved on the GPUs and resumed at another world size on another device (CPU at world 2, or
1 GPU after N). Exits non-zero if any run fails or a loss is off by more than its tolerance.
On a machine without a GPU it says so and exits 0. (--device cpu runs the same checks on CPU
with gloo: how the test suite checks this script.)
"""
import argparse
import json
import os
import statistics
import sys
import tempfile

from scripts.runs import LESSONS, launch, mib

# 29,747,200 parameters, 4,096 tokens a step: big enough to time on a GPU, small enough for the
# single-process CPU reference of 10 steps (its time on a GPU machine's CPU is not yet measured)
MODEL = ["--n-layer", "6", "--d-model", "640", "--n-head", "10", "--seq-len", "256", "--global-batch", "16"]
QUICK = ["--n-layer", "2", "--d-model", "64", "--n-head", "2", "--seq-len", "32", "--global-batch", "8"]
# How far a loss may be from the CPU's after the run. fp32: CUDA's kernels sum in other orders
# than the CPU's (TF32 stays off, PyTorch's default for matmuls), round-off of ~1e-7 relative
# per operation that Adam amplifies little over a few steps; the lessons' own tests see <= 5e-7
# between orders of summation on the CPU. 1e-3 leaves room for that and catches what breaks on a
# GPU: a batch read before its non_blocking copy landed, a unit read while freed or before its
# gather finished (garbage or NaN), a missing reduction, each of which moves the loss by 1e-2 or
# more in the first steps (it falls by ~0.1 a step here). bf16: 8 significant bits, rounded at
# other points by other kernels, as the bf16 tests bound at 5e-4 per run on a small model;
# here 20x that for a 30M model's longer sums. Both bounds were set before a GPU run, by
# reasoning: a run that exceeds them is printed, and the table says by how much.
TOLERANCE = {"fp32": 1e-3, "bf16": 1e-2}


def parse():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=10, help="optimizer steps per run")
    p.add_argument("--quick", action="store_true", help="a small model and 4 steps")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cpu: the same checks on CPU with gloo, 2 ranks (the test suite's way in)")
    p.add_argument("--out", default="runs/gpu_check", help="where the table and every report go")
    return p.parse_args()


def machine(device):
    import torch
    if device == "cpu":
        return 2, f"CPU (gloo) | torch {torch.__version__}"
    names = sorted({torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())})
    try:  # a tuple (major, minor, patch) on every supported torch
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception:
        nccl = "unknown"
    return torch.cuda.device_count(), (f"{torch.cuda.device_count()} x {' / '.join(names)} | torch "
                                       f"{torch.__version__} | CUDA {torch.version.cuda} | NCCL {nccl}")


def sweep(worlds, flags, env=None):
    """Every lesson at each world size, in one torchrun launch: {world: {lesson: report}}."""
    out = launch("scripts.perf.sweep", max(worlds), ["--worlds", *worlds, "--lessons", *LESSONS, *flags], env=env)
    return {int(w): r["reports"] for w, r in out["worlds"].items()}


def cpu_reference(flags):
    """The same training on the CPU, one process: the losses every GPU run is compared with."""
    return launch("01_vanilla_dp", 1, [*flags, "--device", "cpu"], threads=os.cpu_count())["losses"]


def row(world, precision, lesson, r, ref):
    m = r["memory"]["per_rank"][0]
    comm, ov = r["comm"], r["comm"]["overlap"]
    gpu_peak = m.get("cuda_step_peak")
    hidden = ("n/a (world 1)" if world == 1 else f"{ov['hidden_share']:.0%}" if ov else "unavailable")
    dist_ = abs(r["losses"][-1] - ref[-1])
    return {"lesson": lesson, "world": world, "precision": precision, "loss": r["losses"][-1],
            "cpu_diff": dist_, "ok": dist_ <= TOLERANCE[precision],
            "step_ms": 1e3 * statistics.median(r["step_time_s"][1:] or r["step_time_s"]),  # after warm-up
            "tok_s": r["config"]["global_batch"] * r["config"]["seq_len"] /
                     statistics.median(r["step_time_s"][1:] or r["step_time_s"]),
            "gpu_peak": "unavailable" if gpu_peak is None else f"{mib(gpu_peak):.0f}",
            "states": f"{mib(m['params'] + m['grads'] + m['optimizer']):.0f}",
            "theory": f"{mib(r['memory']['theory']['total']):.0f}",
            "sent": f"{mib(comm['ring_bytes_per_step']):.1f} / {mib(comm['theory_ring_bytes_per_step']):.1f}",
            "hidden": hidden}


COLUMNS = [("lesson", "lesson"), ("world", "N"), ("precision", "precision"), ("loss", "final loss"),
           ("cpu_diff", "vs CPU"), ("step_ms", "step ms"), ("tok_s", "tokens/s"),
           ("gpu_peak", "GPU peak MiB"), ("states", "model states MiB"), ("theory", "ZeRO formula MiB"),
           ("sent", "sent / theory MiB"), ("hidden", "comm hidden")]


def table(rows):
    fmt = {"loss": "{:.4f}", "cpu_diff": "{:.1e}", "step_ms": "{:.1f}", "tok_s": "{:,.0f}"}
    lines = ["| " + " | ".join(title for _, title in COLUMNS) + " |",
             "|" + "|".join("---" if k in ("lesson", "precision") else "---:" for k, _ in COLUMNS) + "|"]
    for r in rows:
        cells = [fmt.get(k, "{}").format(r[k]) + (" ✗" if k == "cpu_diff" and not r["ok"] else "")
                 for k, _ in COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def resume_elsewhere(ngpu, flags, device, tmp):
    """06 saved at step 2 on the GPUs, resumed at another world size and device; its losses
    against the uninterrupted run's. Returns (where, max loss difference)."""
    save = ["--device", device, *flags, "--checkpoint-dir", tmp]
    first = 2
    launch("06_zero3", ngpu, [*save, "--steps", str(first), "--save-every", str(first)])
    whole = launch("06_zero3", ngpu, ["--device", device, *flags])["losses"]
    if ngpu >= 2:  # N ranks -> 1
        world, resumed_on = 1, device
        where = f"{ngpu} GPUs -> 1 GPU" if device == "cuda" else f"{ngpu} CPU ranks -> 1"
    else:          # 1 GPU -> 2 CPU ranks
        where, world, resumed_on = "1 GPU -> 2 CPU ranks", 2, "cpu"
    resumed = launch("06_zero3", world, [*save, "--device", resumed_on, "--resume"])
    return where, max(abs(a - b) for a, b in zip(resumed["losses"], whole[first:]))


def main():
    a = parse()
    try:
        import torch
    except ImportError:
        sys.exit("gpu-check: this Python has no torch (PYTHON=... make gpu-check picks another)")
    if a.device == "cuda" and torch.cuda.device_count() == 0:
        print("gpu-check: no CUDA GPU on this machine (torch sees none): nothing to check")
        return 0
    ngpu, where = machine(a.device)
    worlds = [1] + ([ngpu] if ngpu >= 2 else [])
    steps = 4 if a.quick else a.steps
    flags = [*(QUICK if a.quick else MODEL), "--steps", str(steps), "--log-every", str(steps),
             "--peak-params", "0", "--measure-step", str(steps // 2)]
    print(f"gpu-check: {where}\nevery lesson at world {' and '.join(map(str, worlds))}, fp32 and bf16, "
          f"{steps} steps; each run's final loss against the same training on the CPU", flush=True)
    rows, failures, reports = [], [], {}
    for precision in ("fp32", "bf16"):
        pflags = [*flags, "--precision", precision]
        ref = cpu_reference(pflags)
        trace = tempfile.mkdtemp(prefix="gpu_check_trace_")
        traced = a.device == "cuda" and ngpu >= 2  # overlap from kernel times (gloo: the CPU clock)
        by_world = sweep(worlds, ["--device", a.device, *pflags, *(["--trace", trace] if traced else [])])
        reports[precision] = by_world
        for world in worlds:
            for lesson in LESSONS:
                rows.append(row(world, precision, lesson, by_world[world][lesson], ref))
                print(f"  {lesson} world {world} {precision}: loss {rows[-1]['loss']:.4f}", flush=True)
    failures += [f"{r['lesson']} world {r['world']} {r['precision']}: loss {r['loss']:.4f} is "
                 f"{r['cpu_diff']:.1e} from the CPU's (tolerance {TOLERANCE[r['precision']]:g})"
                 for r in rows if not r["ok"]]
    # the allocator off: memory freed too early is then returned to the driver at once
    no_cache = sweep([1], ["--device", a.device, *flags, "--precision", "fp32"],
                     env={"PYTORCH_NO_CUDA_MEMORY_CACHING": "1"})[1]
    checks = []
    for lesson in ("05_zero2", "06_zero3"):
        diff = abs(no_cache[lesson]["losses"][-1] - reports["fp32"][1][lesson]["losses"][-1])
        checks.append((f"{lesson}, caching allocator off, against on", diff, TOLERANCE["fp32"]))
    with tempfile.TemporaryDirectory() as tmp:
        moved, diff = resume_elsewhere(ngpu, flags, a.device, tmp)
        checks.append((f"06_zero3 saved and resumed, {moved}, against uninterrupted", diff, TOLERANCE["fp32"]))
    out = [f"GPU check: {where}", "", table(rows), ""]
    out += [f"- {name}: loss difference {diff:.1e} (tolerance {tol:g}) {'✓' if diff <= tol else '✗'}"
            for name, diff, tol in checks]
    failures += [name for name, diff, tol in checks if diff > tol]
    print("\n" + "\n".join(out))
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "gpu_check.md"), "w") as f:
        f.write("\n".join(out) + "\n")
    with open(os.path.join(a.out, "gpu_check.json"), "w") as f:
        json.dump({"machine": where, "rows": rows, "checks": checks, "reports": reports}, f, indent=1)
    if failures:
        print("gpu-check: FAILED: " + "; ".join(failures))
        return 1
    print(f"gpu-check: all {len(rows)} runs and {len(checks)} checks passed; table in {a.out}/gpu_check.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
