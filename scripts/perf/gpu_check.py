"""The GPU check: every lesson on CUDA with NCCL, one table, on any machine with GPUs.

    make gpu-check                     # with the project's .venv
    PYTHON=python3 make gpu-check      # with the machine's own Python and torch (no .venv, no network)
    python3 -m scripts.perf.gpu_check --quick          # a small model, a few steps: a smoke test

Runs every lesson at world 1, and at world = the number of GPUs when there are two or more, in
fp32, bf16 and fp16 (fp16: the lessons that take it, scripts/runs.FP16_LESSONS; bf16: on GPUs
that compute in it, compute capability 8.0 and up: a T4 runs fp32 and fp16, and --quick runs
fp32 and one of the 2-byte precisions, bf16 where the GPUs have it, else fp16), on a GPT of
29.7M parameters, and prints per run: the final loss and its largest
distance, over every step, from the same training in one process on the CPU and on one GPU
(bf16's real check: the two devices' bf16 differs by as much as bf16 from fp32), the median
step time, tokens/s, the GPU's peak allocated memory in the measured step beside the model
states the ZeRO formula gives, the bytes each rank issued per step (the payloads its collectives
asked for times the ring factor, a count: NCCL's wire bytes are not readable) against theory,
and the share of communication hidden behind compute (from the GPU's kernel times; at world 1
there is no communication). Then lesson 00's ring collectives at world = the number of GPUs (its grouped
sends and receives on NCCL; with one GPU it says in one line that it is skipped), and 06 saved on
the GPUs and resumed at another world size on another device (CPU at world 2, or 1 GPU after N),
and 06 with --activation-checkpointing block against without on one device (the same losses
and bytes sent; the activation bytes measured beside the formula and the peak allocated). 07's
lines give its tiers, its copies each way and how much of their time was hidden. 08 runs as two
"nodes" of N / 2 GPUs (scripts/runs.grid_args; 1 x 1 at world 1), its shard and replicate groups
NCCL sub-groups of one machine.
And fp16 at a loss scale of 2^40 for 3 steps, each overflowing by far: every run must skip them all
(the found-inf flag on the device; 07's beside its host gradients), back off, and keep its weights:
its losses those of the untouched model (OVERFLOW_SCALE). (An overflow on one rank only, which only
the flag's all-reduce tells the others, is tests/test_fp16.py's, injected on the CPU.)
Exits non-zero if any run fails, a loss is NaN or infinite at any step, two runs compared differ
in length, a loss is off by more than its tolerance at any step, an fp16 run skipped other steps
than its reference, or a check fails. On a machine without a GPU it says so and exits 0.
(--device cpu runs the same checks on CPU with gloo: how the test suite checks this script.)

No run with the CUDA caching allocator off (PYTORCH_NO_CUDA_MEMORY_CACHING=1), as an earlier
version had: with caching off every free is a cudaFree, which synchronizes the device, so a
collective still using a freed buffer has finished before the memory can be reused. That run
hid the use-after-free it was meant to show. With caching on, NCCL's process group keeps an
async collective's tensors from reuse until it is done (record_stream or stashing them), and the
lessons run all their own work on the current stream, so freeing early is safe; what remains is
reading an output or changing an input before wait(), a timing race that one GPU run shows only
sometimes. The test suite checks that on CPU, where a stand-in for NCCL's stream semantics makes
it deterministic. A lesson that adds a CUDA side stream must record_stream what crosses it.
"""
import json
import math
import os
import statistics
import sys
import tempfile

from lessonkit import summary
from scripts.runs import FP16_LESSONS, LESSONS, Parser, device_and_host, launch, mib, usable_cpus, why_failed

CHECKED = list(LESSONS)
PRECISIONS = ["fp32", "bf16", "fp16"]

# 29,747,200 parameters, 4,096 tokens a step: big enough to time on a GPU, small enough for the
# single-process CPU reference of 10 steps (its time on a GPU machine's CPU is not yet measured)
MODEL = ["--n-layer", "6", "--d-model", "640", "--n-head", "10", "--seq-len", "256", "--global-batch", "16"]
QUICK = ["--n-layer", "2", "--d-model", "64", "--n-head", "2", "--seq-len", "32", "--global-batch", "8"]
# How far a loss may be from each reference, at any step: {reference: {precision: bound}}.
# Measured on 1 x H100 (torch 2.11, CUDA 13.0), world 1, the 29.7M model, 10 steps (docs/gpus.md):
# - "CPU" (the same training, one process on the CPU). fp32: 6.4e-5 apart at most; CUDA's kernels
#   sum in other orders than the CPU's (TF32 stays off), and a bug (a batch read before its copy
#   landed, a unit read while freed, a missing reduction) moves the loss by 1e-2 or more. 1e-3 sits
#   15x above the one and 10x below the other. bf16: 2.7e-2 apart, as far as bf16 on the GPU is
#   from fp32 on the GPU (3.4e-2): the two devices' bf16 kernels round at other points. No bound
#   there can tell a bug from round-off, so 0.1 only catches garbage (a NaN, a loss gone wild).
# - "1 GPU" (the same training, one process on the GPU: what tells bugs in bf16). fp32: 1.9e-6 at
#   most, 01 against another launch of itself included (CUDA's atomics, as in the embedding's
#   backward, sum in a different order each run; 5.7e-6 in a second run); 1e-4 is 17x above, room
#   for world N's orders of summation (the CPU tests see <= 5e-7 between them). bf16: the
#   lessons' own orders of summation, 1.1e-3 apart at most (04 and 06 against 01), 2.4e-3 for 07
#   (its AdamW on the CPU rounds otherwise); 5e-3, between that and a bug's 1e-2 rather than 10x
#   above. Neither is measured yet at world 2 or more.
# fp16: set by reasoning from bf16's before any GPU run, then measured on 1 x H200 (world 1): 3.8e-3
# from the CPU, 6.6e-4 from one GPU (04, 06, 08; 07 3.0e-4). fp16 keeps 11 significant bits (10
# stored), bf16 8 (7): each rounding 8x finer, so fp16 runs should sit up to 8x closer than bf16's;
# on this CPU (--quick, gloo against one process) they sit 3x closer (fp16 5.4e-5, bf16 1.6e-4,
# 01-05), so the bounds took bf16's distances / 3. "1 GPU": bf16's 1.1e-3 (07: 2.4e-3) / 3 = 3.7e-4
# (8e-4); 2e-3, 3x above what the H200 measured, 5x below a bug's 1e-2. "CPU": bf16's 2.7e-2 / 3 =
# 9e-3 (the devices' kernels round at other points); 2e-2, 5x above the H200's: as bf16's, a
# guard against garbage, the one-GPU reference being the check. (Loss scaling adds no rounding:
# x 2^k is exact. A step skipped in one run and not in another, a gradient at fp16's overflow,
# moves a loss by a whole step's change: the fp16 line under the table lists the skipped steps.)
# fp16's table runs start at GradScaler's scale, 2^16, where no gradient of the check's model
# overflowed on an H200, 4x below the edge (at 2^20 the first steps overflow, the scale settles at
# 2^18 and on the CPU step 5 tips over: a scaler always settles within 2x of an overflow, where
# two devices' kernels, or two orders of summation, may decide a later step otherwise). So the
# skipping has its own check (overflow()): 2^40 for OVERFLOW_STEPS steps, each overflowing by far
# (a gradient above 2^-22 does), nothing at the edge: every run must skip them all and leave its
# weights as they were. A GPU run that skipped other steps than the CPU reference is
# held to the one-GPU reference alone ("other skips"), as the fuzzer compares fp16 runs.
OVERFLOW_SCALE, OVERFLOW_STEPS = 2 ** 40, 3
TOLERANCE = {"CPU": {"fp32": 1e-3, "bf16": 1e-1, "fp16": 2e-2}, "1 GPU": {"fp32": 1e-4, "bf16": 5e-3, "fp16": 2e-3}}


def compare(got, want, tol):
    """Two runs' losses, step for step: (the largest |got - want|, None) when within tol, else
    (that distance or inf, why not in one line). Not `max(...) > tol` over zip(): a NaN compares
    False with everything, max() over a list holding one returns it or not by its position, and
    zip() drops the steps of the longer run."""
    if len(got) != len(want):
        return math.inf, f"{len(got)} steps against {len(want)}"
    if not got:
        return math.inf, "no steps"
    for step, (a, b) in enumerate(zip(got, want)):
        if not all(isinstance(v, (int, float)) and math.isfinite(v) for v in (a, b)):
            return math.inf, f"loss {a} against {b} at step {step}"
    gap = max(abs(a - b) for a, b in zip(got, want))
    return gap, None if gap <= tol else f"{gap:.1e} apart (tolerance {tol:g})"


def parse():
    p = Parser("gpu-check", description=__doc__)
    p.add_argument("--steps", type=int, default=10, help="optimizer steps per run")
    p.add_argument("--quick", action="store_true", help="a small model and 4 steps, fp32 and one 2-byte precision")
    p.add_argument("--precision", nargs="+", choices=PRECISIONS, metavar="PRECISION",
                   help="only these, of fp32 bf16 fp16 (default: all three; --quick: fp32, and bf16 where "
                        "the GPUs compute in it, else fp16)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cpu: the same checks on CPU with gloo, 2 ranks (the test suite's way in)")
    p.add_argument("--out", default="runs/gpu_check", help="where the table and every report go")
    p.add_argument("--results", action="store_true", help="also write the table into docs/results.md (make gpu-check)")
    p.add_argument("--lessons", nargs="+", default=CHECKED, choices=CHECKED, metavar="LESSON",
                   help="only these (default: all, 01_vanilla_dp ... 08_hybrid)")
    a = p.parse_args()
    if a.steps < 2:
        p.error("--steps must be at least 2 (a save at step 2 is resumed)")
    return p, a


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


def has_bf16(device):
    """Whether every GPU here computes in bf16: compute capability 8.0 (Ampere) or later. A T4
    (7.5) or a V100 (7.0) only emulates it, slowly, and torch.cuda.is_bf16_supported() answers
    True there all the same (it counts emulation); fp16 is their 2-byte precision. CPU: yes."""
    import torch
    if device == "cpu" or torch.version.hip:
        return True
    return all(torch.cuda.get_device_capability(i) >= (8, 0) for i in range(torch.cuda.device_count()))


def precisions(a, bf16):
    """The precisions to run, and the line that says bf16 was left out (GPUs without it), or None."""
    wanted = a.precision or (["fp32", "bf16" if bf16 else "fp16"] if a.quick else PRECISIONS)
    if bf16 or (a.precision and "bf16" not in a.precision):
        return wanted, None
    return [p for p in wanted if p != "bf16"], ("  bf16: skipped, these GPUs have no bf16 arithmetic (compute "
                                                "capability below 8.0: torch would emulate it, slowly); fp16 is "
                                                "their 2-byte precision")


def sweep(worlds, lessons, flags, env=None):
    """The lessons at each world size, in one torchrun launch: {world: {lesson: report}}."""
    out = launch("scripts.perf.sweep", max(worlds), ["--worlds", *worlds, "--lessons", *lessons, *flags], env=env)
    return {int(w): r["reports"] for w, r in out["worlds"].items()}


def cpu_reference(flags):
    """The same training on the CPU, one process: the report whose losses every GPU run is compared with."""
    return launch("01_vanilla_dp", 1, [*flags, "--device", "cpu"], threads=usable_cpus())


def median_step(r):
    times = r["step_time_s"][1:] or r["step_time_s"]  # after warm-up
    return statistics.median(times) if times else math.nan


def row(world, precision, lesson, r, ref_reports):
    m, tiers = r["memory"]["per_rank"][0], r["memory"].get("theory_tiers")
    comm, ov = r["comm"], r["comm"]["overlap"]
    gpu_peak = m.get("cuda_step_peak")
    hidden = ("n/a (world 1)" if world == 1 else f"{ov['hidden_share']:.0%}" if ov else "unavailable")
    gaps, whys = {}, []  # ref_reports: {"CPU": report, "1 GPU": report (on CUDA)}
    for name, ref in ref_reports.items():
        if name != strict(ref_reports) and skips(r) != skips(ref):  # (fp16: OVERFLOW_SCALE's comment)
            gaps[name] = None  # the devices' kernels overflowed at other steps: a step's change apart
            continue
        gaps[name], why = compare(r["losses"], ref["losses"], TOLERANCE[name][precision])
        whys += [f"against {'the CPU' if name == 'CPU' else name}: {why}"] if why else []
    return {"lesson": lesson, "world": world, "precision": precision,
            "loss": r["losses"][-1] if r["losses"] else math.nan, "vs": gaps, "ok": not whys, "why": whys,
            "step_ms": 1e3 * median_step(r),
            "tok_s": r["config"]["global_batch"] * r["config"]["seq_len"] / median_step(r),
            "gpu_peak": "unavailable" if gpu_peak is None else f"{mib(gpu_peak):.0f}",
            # on the device: 07's device tier (its host's: offload_line), every other lesson's all
            "states": f"{mib(device_and_host(m)[0]):.0f}",
            "theory": f"{mib(sum(tiers['device'].values()) if tiers else r['memory']['theory']['total']):.0f}",
            "issued": f"{mib(comm['issued_ring_bytes_per_step']):.1f} / {mib(comm['theory_ring_bytes_per_step']):.1f}",
            "hidden": hidden}


COLUMNS = [("lesson", "lesson"), ("world", "N"), ("precision", "precision"), ("loss", "final loss"),
           ("vs CPU", "vs CPU"), ("vs 1 GPU", "vs 1 GPU"), ("step_ms", "step ms"), ("tok_s", "tokens/s"),
           ("gpu_peak", "GPU peak MiB"), ("states", "model states MiB"), ("theory", "ZeRO formula MiB"),
           ("issued", "issued / theory MiB"), ("hidden", "comm hidden")]


def table(rows, brief=False):
    """The runs as a markdown table; a distance beyond its tolerance is marked ✗ (one reference
    only, the CPU, where the runs are on the CPU). brief: at world 1 only, without the columns
    of the wire (nothing crossed it)."""
    fmt = {"loss": "{:.4f}", "step_ms": "{:.1f}", "tok_s": "{:,.0f}"}
    wireless = brief and all(r["world"] == 1 for r in rows)
    columns = [(k, title) for k, title in COLUMNS if (not k.startswith("vs ") or k[3:] in rows[0]["vs"])
               and not (wireless and k in ("issued", "hidden"))]
    lines = ["| " + " | ".join(title for _, title in columns) + " |",
             "|" + "|".join("---" if k in ("lesson", "precision") else "---:" for k, _ in columns) + "|"]
    for r in rows:
        def cell(k):
            if not k.startswith("vs "):
                return fmt.get(k, "{}").format(r[k])
            gap = r["vs"][k[3:]]
            if gap is None:
                return "other skips"
            return f"{gap:.1e}" + (" ✗" if gap > TOLERANCE[k[3:]][r["precision"]] else "")
        lines.append("| " + " | ".join(cell(k) for k, _ in columns) + " |")
    return "\n".join(lines)


def spread(rows):
    """Per reference and precision, the largest distance over every run: what a GPU measures
    for the tolerances above. {reference: {precision: (distance, "lesson world N")}}."""
    out = {}
    for r in rows:
        for name, gap in r["vs"].items():
            widest = out.setdefault(name, {})
            if gap is not None and math.isfinite(gap) and gap >= widest.get(r["precision"], (-1.0, ""))[0]:
                widest[r["precision"]] = (gap, f"{r['lesson']} world {r['world']}")
    return out


def offload_line(world, precision, r):
    """07's tiers and copies (rank 0, measured step) in one line."""
    m, c = r["memory"]["per_rank"][0], (r.get("copies_per_rank") or [None])[0] or {}
    tiers = " | ".join(f"{tier} {mib(sum(m[tier][k] for k in ('params', 'grads', 'optimizer'))):.1f} MiB "
                       f"(optimizer {mib(m[tier]['optimizer']):.1f})" for tier in ("device", "host") if tier in m)
    return (f"- 07_offload world {world} {precision}: {tiers}; copied {copies(c)}; "
            + (summary.copies_hidden(c, r.get("device")) if c else "no copies"))


def copies(c):
    """07's copies of one step (one rank's counters, {} if none): up and down, bytes and time."""
    return (f"up {mib(c.get('h2d_bytes', 0)):.1f} MiB in {c.get('h2d_s', 0) * 1e3:.1f} ms, "
            f"down {mib(c.get('d2h_bytes', 0)):.1f} MiB in {c.get('d2h_s', 0) * 1e3:.1f} ms")


def caption(worlds):
    """What results.md's table shows, in a line (gpu_check.md's distance lines say it at length)."""
    alone = " World 1 only (one GPU): nothing crossed NCCL, nothing was issued." if worlds == [1] else ""
    return ('"vs CPU", "vs 1 GPU": the largest loss difference from one process on the CPU and on one GPU, '
            f"each within its [tolerance](gpus.md).{alone}")


def brief_offload(reports, worlds):
    """07's copies in one line per world (offload_line's facts, for results.md)."""
    lines = []
    for world in worlds:
        runs = [(p, ((by_world[world]["07_offload"].get("copies_per_rank") or [None])[0] or {}))
                for p, by_world in reports.items() if "07_offload" in by_world[world]]
        lines += [f"- 07 at world {world}, copies per step (CUDA events): " + "; ".join(
            f"{p} {copies(c)}, exposed {c.get('exposed_s', 0) * 1e3:.1f} ms" for p, c in runs)] if runs else []
    return lines


def skips(r):
    return (r.get("loss_scale") or {}).get("skipped_steps", [])


def strict(ref_reports):
    """The reference whose skipped steps fp16 runs must match: the one GPU's, on the CPU the CPU's."""
    return "1 GPU" if "1 GPU" in ref_reports else "CPU"


def skipped_apart(by_world, ref_reports):
    """fp16: the runs that skipped other steps than the strict reference."""
    name = strict(ref_reports)
    want = skips(ref_reports[name])
    return [f"{lesson} world {world} fp16 skipped steps {skips(r)}, the {'one-GPU' if name == '1 GPU' else 'CPU'} "
            f"reference {want}" for world, reports in by_world.items() for lesson, r in reports.items() if skips(r) != want]


def skipped_line(by_world, ref_reports):
    """fp16's loss scaling in one line: the steps each run skipped (an inf or NaN in a gradient),
    grouped, the references' among them. A run that skipped another step than a reference is
    a whole step's change away from it: this says why, when its loss is."""
    groups = {}
    named = [(f"{lesson} world {world}", r) for world, reports in by_world.items() for lesson, r in reports.items()]
    named += [(f"the {'CPU' if name == 'CPU' else 'one-GPU'} reference", r) for name, r in ref_reports.items()]
    for name, r in named:
        groups.setdefault(tuple(skips(r)), []).append(name)
    if list(groups) == [()]:
        return "- fp16 loss scaling: no run skipped a step (no gradient overflowed at the scale they started with)"
    return "- fp16 loss scaling, the steps each run skipped: " + "; ".join(
        f"{', '.join(map(str, steps)) or 'none'}: {', '.join(names)}" for steps, names in groups.items())


def ring(ngpu, flags, device):
    """Lesson 00 at world = ngpu: on every rank its ring reduce-scatter, all-gather and
    all-reduce equal torch's and send what the ring should. On NCCL this is where its grouped
    sends and receives count: an isend then a blocking recv deadlocks at 2 ranks, which NCCL's
    watchdog turns into a failed run at --timeout. Returns (name, None or why it failed)."""
    name = f"00_collectives at world {ngpu}, ring against torch and bytes against theory"
    try:  # the model's shape (its Psi) only: 00 trains nothing, and refuses the flags of training
        per_rank = launch("00_collectives", ngpu, ["--device", device, *flags])["comm"]["per_rank"]
    except RuntimeError as e:
        return name, f"the run failed: {why_failed(e)}"
    wrong = [f"rank {rank} {kind}" for rank, out in enumerate(per_rank) for kind, o in out.items()
             if not o["equal_to_torch"] or o["sent_bytes"] != o["ring_bytes"]]
    return name, (f"wrong on {', '.join(wrong)}" if wrong else None)


def resume_elsewhere(ngpu, flags, device, tmp):
    """06 saved at step 2 on the GPUs, resumed at another world size and device; its losses
    against the uninterrupted run's. Returns (where, resumed losses, uninterrupted losses)."""
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
    return where, resumed["losses"], whole[first:]


def overflow(worlds, lessons, flags, device):
    """Every fp16 lesson with the loss scale at 2^40 for OVERFLOW_STEPS steps: each overflows by
    far, on every rank, so every run must skip them all (a rank that stepped would move the next
    step's mean loss), backing off to 2^37, and its losses are the untouched model's: the
    reference's (one process on one GPU; on the CPU, the CPU's), within fp16's tolerance.
    Returns (name, None or why it failed, what was measured)."""
    argv = [*flags, "--precision", "fp16", "--loss-scale", str(OVERFLOW_SCALE), "--steps", str(OVERFLOW_STEPS),
            "--measure-step", "0"]  # (after the check's own: they win)
    name, want = "CPU" if device == "cpu" else "1 GPU", list(range(OVERFLOW_STEPS))
    ref = cpu_reference(argv) if device == "cpu" else launch("01_vanilla_dp", 1, [*argv, "--device", "cuda"])
    wrong = [f"the reference skipped {skips(ref)}"] if skips(ref) != want else []
    by_world = sweep(worlds, lessons, ["--device", device, *argv])
    for world, reports in by_world.items():
        for lesson, r in reports.items():
            scale = (r.get("loss_scale") or {}).get("final_scale")
            if skips(r) != want:
                why = f"skipped {skips(r)}"
            elif scale != OVERFLOW_SCALE / 2 ** OVERFLOW_STEPS:
                why = f"ended at a scale of {scale}"
            else:
                why = compare(r["losses"], ref["losses"], TOLERANCE[name]["fp16"])[1]
            wrong += [f"{lesson} world {world}: {why}"] if why else []
    runs = sum(map(len, by_world.values()))
    return (f"fp16 at a loss scale of 2^40, {OVERFLOW_STEPS} steps that overflow, against "
            f"{'the CPU' if name == 'CPU' else 'one GPU'}", "; ".join(wrong) or None,
            f"{runs} runs skipped steps {want} on every rank, the scale 2^40 -> 2^{40 - OVERFLOW_STEPS}, "
            f"the untouched model's losses")


def activations(flags, device):
    """06 at world 1 with and without --activation-checkpointing block: the same losses (the
    recomputation repeats forward's operations on the same inputs), and each run's activation
    bytes, measured, beside the formula (and on CUDA the step's peak allocated: kernels there may
    keep a few bytes the CPU's do not). Returns (name, None or why it failed, what was measured)."""
    runs = {mode: launch("06_zero3", 1, ["--device", device, *flags, "--peak-params", "1",
                                         "--activation-checkpointing", mode]) for mode in ("none", "block")}
    diff, why = compare(runs["block"]["losses"], runs["none"]["losses"], TOLERANCE["1 GPU"]["fp32"])
    sent = {mode: r["comm"]["issued_ring_bytes_per_step"] for mode, r in runs.items()}
    why = why or (None if sent["none"] == sent["block"] else f"bytes sent {sent['block']} != {sent['none']}")
    parts = []
    for mode, r in runs.items():
        m = r["memory"]["per_rank"][0]
        peak = m.get("cuda_step_peak") and f", peak allocated {mib(m['cuda_step_peak']):.1f} MiB"
        parts.append(f"{mode}: activations {mib(m['peak_activations']):.2f} MiB measured, "
                     f"{mib(r['memory']['theory_activations'][mode]):.2f} theory{peak or ''}")
    return ("06_zero3 with --activation-checkpointing block against without, 1 device", why,
            f"loss difference {diff:.1e}; " + "; ".join(parts))


def write(out_dir, lines, everything=None):
    """gpu_check.md (the lines), and gpu_check.json (everything) when given."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "gpu_check.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    if everything is not None:
        with open(os.path.join(out_dir, "gpu_check.json"), "w") as f:
            json.dump(everything, f, indent=1)


def main():
    p, a = parse()
    try:
        import torch
    except ImportError:
        sys.exit("gpu-check: this Python has no torch (PYTHON=... make gpu-check picks another)")
    if a.device == "cuda" and torch.cuda.device_count() == 0:
        print("gpu-check: no CUDA GPU on this machine (torch sees none): nothing to check")
        return 0
    p.folder("--out", a.out)  # before the first run, not after the last
    try:
        return check(a)
    except RuntimeError as e:  # a run failed: one line here, its command and whole output in a file
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "failed_run.log"), "w") as f:
            f.write(f"{e}\n")
        print(f"gpu-check: FAILED: a run failed: {why_failed(e)} (command and output: {a.out}/failed_run.log)")
        return 1


def check(a):
    """Every run and check; the exit code."""
    ngpu, where = machine(a.device)
    worlds = [1] + ([ngpu] if ngpu >= 2 else [])
    steps = 4 if a.quick else a.steps
    model = list(QUICK if a.quick else MODEL)
    batch = model.index("--global-batch") + 1
    model[batch] = str(-(-int(model[batch]) // ngpu) * ngpu)  # every world divides it: 3 or 6 GPUs take 18
    flags = [*model, "--steps", str(steps), "--log-every", str(steps),
             "--peak-params", "0", "--measure-step", str(steps // 2)]
    run_precisions, left_out = precisions(a, has_bf16(a.device))
    print(f"gpu-check: {where}\nevery lesson at world {' and '.join(map(str, worlds))}, {', '.join(run_precisions)}, "
          f"{steps} steps; each run's losses against the same training in one process, on the CPU"
          f"{' and on one GPU' if a.device == 'cuda' else ''}", flush=True)
    if left_out:
        print(left_out)
    rows, failures, reports, scaling = [], [], {}, []
    for precision in run_precisions:
        lessons = [x for x in a.lessons if precision != "fp16" or x in FP16_LESSONS]
        if len(lessons) < len(a.lessons):
            print(f"  fp16: {', '.join(x for x in a.lessons if x not in lessons)} skipped (they do not take "
                  "--precision fp16 yet)")
        if not lessons:
            continue
        pflags = [*flags, "--precision", precision]
        cpu = cpu_reference(pflags)
        ref_reports = {"CPU": cpu}
        if a.device == "cuda":  # the same training on one GPU: bf16's check (see TOLERANCE)
            ref_reports["1 GPU"] = launch("01_vanilla_dp", 1, [*pflags, "--device", "cuda"])
        if precision == "fp16":  # (each run's follow below, as they finish: the table comes last)
            print("  fp16 references, skipped steps: " + ", ".join(f"{'the ' if n == 'CPU' else ''}{n} {skips(r)}"
                                                              for n, r in ref_reports.items()), flush=True)
        traced = a.device == "cuda" and ngpu >= 2  # overlap from kernel times (gloo: the CPU clock)
        with tempfile.TemporaryDirectory(prefix="gpu_check_trace_") as trace:  # read by the runs, then gone
            by_world = sweep(worlds, lessons, ["--device", a.device, *pflags, *(["--trace", trace] if traced else [])])
        reports[precision] = by_world
        for world in worlds:
            for lesson in lessons:
                rows.append(row(world, precision, lesson, by_world[world][lesson], ref_reports))
                skipped = f", skipped steps {skips(by_world[world][lesson])}" if precision == "fp16" else ""
                print(f"  {lesson} world {world} {precision}: loss {rows[-1]['loss']:.4f}{skipped}", flush=True)
        if precision == "fp16":
            scaling.append(skipped_line(by_world, ref_reports))
            failures += skipped_apart(by_world, ref_reports)
    failures += [f"{r['lesson']} world {r['world']} {r['precision']} {why}" for r in rows for why in r["why"]]
    widest = spread(rows)
    offload = [offload_line(world, p, by_world[world]["07_offload"]) for p, by_world in reports.items()
               for world in worlds if "07_offload" in by_world[world]]
    out = [f"GPU check: {where}", "", table(rows), ""]
    out += [f"- largest distance from {'the CPU' if name == 'CPU' else name}, {p}: {d:.1e} ({at}), "
            f"tolerance {TOLERANCE[name][p]:g} (docs/gpus.md: how it was set)"
            for name, by_precision in widest.items() for p, (d, at) in by_precision.items()]
    out += offload + scaling
    print("\n" + "\n".join(out), flush=True)  # the table now, and in the file: a check cut short leaves it
    write(a.out, out)
    checks = []  # (name, None when it passed or why it failed, what was measured)
    if ngpu >= 2:
        shape = model[:batch - 1] + model[batch + 1:]  # the model's flags but --global-batch: 00 trains nothing
        checks.append((*ring(ngpu, shape, a.device), "ring == torch, its sends == theory, on every rank"))
    else:
        print("  00_collectives: skipped, 1 GPU (its ring sends between ranks: 2 or more GPUs run it)")
    with tempfile.TemporaryDirectory() as tmp:
        moved, resumed, whole = resume_elsewhere(ngpu, flags, a.device, tmp)
        diff, why = compare(resumed, whole, TOLERANCE["CPU"]["fp32"])
        checks.append((f"06_zero3 saved and resumed, {moved}, against uninterrupted", why,
                       f"loss difference {diff:.1e} (tolerance {TOLERANCE['CPU']['fp32']:g})"))
    fp16 = [x for x in a.lessons if x in FP16_LESSONS]
    if "fp16" in run_precisions and fp16:
        checks.append(overflow(worlds, fp16, flags, a.device))
    if not a.quick:  # (the test suite runs --quick on CPU: tests/test_gpu_check.py checks this one's logic)
        checks.append(activations(flags, a.device))
    done = [f"- {name}: {why or measured} {'✓' if why is None else '✗'}" for name, why, measured in checks]
    failures += [f"{name}: {why}" for name, why, _ in checks if why is not None]
    print("\n".join(done))
    write(a.out, out + done, {"machine": where, "rows": rows, "spread": widest,
                              "checks": [{"check": name, "ok": why is None, "why": why, "measured": measured}
                                         for name, why, measured in checks], "reports": reports})
    if a.results and a.device == "cuda" and not a.quick:  # the GPU's numbers, where README and docs link to them
        from scripts.learn import results
        results.write_section("gpu", "\n".join(["## On GPUs", "", f"Machine: {results.machine()}, {where}. "
                                                "`make gpu-check`.", "", caption(worlds), "", table(rows, brief=True), "",
                                                *brief_offload(reports, worlds), *scaling, *done]))
    if failures:
        print("gpu-check: FAILED: " + "; ".join(failures))
        return 1
    print(f"gpu-check: all {len(rows)} runs and {len(checks)} checks passed; table in {a.out}/gpu_check.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
