"""The GPU path, as far as a CPU can check it: which device `--device auto` picks (with the GPU
count faked), the torch API the lessons use on every supported version, measurement that says
"unavailable" rather than a CPU-clock number on NCCL, the data path, checkpoints read to the CPU,
bf16 gradient accumulation in fp32 (05, 06), and `scripts/perf/gpu_check.py` end to end on gloo."""
import glob
import json
import os
import re
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from lessonkit import common
from model import get_batch, global_batch
from lessonkit import comm_meter, optimizers
from graded import lesson_file, load_lesson
from harness import ROOT, spawn
from scripts.perf.timelines import gpu_overlap, timeline

ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")


# ----------------------------------------------------------------------------- device choice
@pytest.mark.parametrize("requested, ranks, gpus, kind, why", [
    ("auto", 1, 0, "cpu", "no CUDA GPU here"),
    ("auto", 1, 1, "cuda", None),
    ("auto", 2, 1, "cpu", "2 ranks on this node but only 1 GPU"),  # the one-GPU laptop, torchrun x2
    ("auto", 4, 8, "cuda", None),
    ("auto", 8, 8, "cuda", None),
    ("auto", 8, 4, "cpu", "8 ranks on this node but only 4 GPUs"),
    ("cpu", 2, 8, "cpu", None),  # the CPU tools on a GPU box
    ("cuda", 2, 2, "cuda", None),
])
def test_auto_takes_cuda_only_with_a_gpu_per_local_rank(requested, ranks, gpus, kind, why):
    got_kind, got_why = common.choose_device(requested, ranks, gpus)
    assert got_kind == kind
    assert (got_why is None) == (why is None) and (why is None or got_why.startswith(why)), got_why


@pytest.mark.parametrize("ranks, gpus, message", [
    (1, 0, "no CUDA GPU is available"),
    (2, 1, "--device cuda: 2 ranks on this node but only 1 GPUs; NCCL needs one GPU per rank"),
])
def test_explicit_cuda_without_a_gpu_per_rank_is_an_error(ranks, gpus, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        common.choose_device("cuda", ranks, gpus)


def test_auto_with_too_few_gpus_trains_on_cpu_and_says_why_once():
    # A one-GPU machine under `torchrun --nproc_per_node=2`, faked: torch sees 1 GPU and this
    # node runs 2 ranks. The run must go to the CPU (not stop), with one line saying why.
    code = ("import runpy, sys, torch; torch.cuda.device_count = lambda: 1; "
            f"sys.argv = ['01', '--steps', '2', '--n-layer', '1', '--d-model', '32', '--seq-len', '16']; "
            f"runpy.run_path({lesson_file('01_vanilla_dp')!r}, run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=dict(ENV, LOCAL_WORLD_SIZE="2"),
                          text=True, capture_output=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    said = [line for line in proc.stderr.splitlines() if line.startswith("device:")]
    assert said == ["device: cpu, as --device auto found 2 ranks on this node but only 1 GPU, and NCCL "
                    "needs one per rank (--nproc_per_node=1 runs on the GPUs)"], proc.stderr
    assert "world 1 gloo" in proc.stdout


def device_in_existing_group(argv):
    args = common.parse_args(argv)
    return str(common.init_distributed(args).device), args.device


def test_in_an_existing_group_the_device_follows_its_backend():
    # the harness's group is gloo: even an explicit --device cuda then means the CPU (on a GPU
    # machine gloo would otherwise be handed CUDA tensors)
    for argv in ([], ["--device", "cuda"]):
        assert spawn(2, device_in_existing_group, argv) == [("cpu", "cpu")] * 2


# ----------------------------------------------------------------------------- torch versions
# Every torch.distributed name the lessons, bucket.py and the support modules use, each checked
# present in torch 2.6.0, 2.11.0, 2.13.0 and 2.15.0 (dir(torch.distributed) of 2.6, 2.11 and
# 2.13; distributed_c10d.py and __init__.py of the 2.15 wheel, from `pip download --no-deps`).
# all_gather_single / reduce_scatter_single are not here: torch 2.11 does not have them.
# P2POp and batch_isend_irecv (00's grouped exchange) date from torch 1.8, irecv from 1.0; the
# ring transport's new_group (backend, timeout), group.WORLD and ReduceOp from 1.0; reduce (07's
# --layout uneven) from 1.0; get_process_group_ranks (00's Ring over 08's sub-groups, global ranks
# of its neighbours) from 2.0, in distributed_c10d's __all__ since.
SUPPORTED = {"HashStore", "P2POp", "all_gather_into_tensor", "all_gather_object", "all_reduce", "barrier",
             "batch_isend_irecv", "broadcast", "broadcast_object_list", "destroy_process_group", "get_backend",
             "get_rank", "get_world_size", "init_process_group", "irecv", "is_initialized", "isend", "recv",
             "reduce", "reduce_scatter_tensor", "new_group", "group", "ReduceOp", "get_process_group_ranks",
             "distributed_c10d._get_default_store", "distributed_c10d._abort_process_group"}
FILES = [os.path.relpath(p, ROOT)[:-3] for p in sorted(glob.glob(os.path.join(ROOT, "*.py")))
         + sorted(glob.glob(os.path.join(ROOT, "lessonkit", "*.py")))] + ["scripts/perf/ring_collectives"]


def test_lessons_use_only_collectives_every_supported_torch_has():
    used = {}
    for name in FILES:
        with open(os.path.join(ROOT, f"{name}.py")) as f:
            for m in re.finditer(r"\bdist\.((?:distributed_c10d\.)?\w+)", f.read()):
                used.setdefault(m.group(1), name)
    assert {n: f for n, f in used.items() if n not in SUPPORTED} == {}


def sharded_lessons_without_the_2_13_names():
    """In a spawned rank: torch before 2.13, simulated (no *_single names in torch.distributed):
    04, 05 and 06 still train and the meter still counts their collectives."""
    for name in ("all_gather_single", "reduce_scatter_single"):
        if hasattr(dist, name):
            delattr(dist, name)
    argv = ["--steps", "2", "--n-layer", "1", "--d-model", "32", "--seq-len", "16", "--global-batch", "4",
            "--measure-step", "1", "--peak-params", "0", "--device", "cpu"]
    return {lesson: load_lesson(lesson).main(argv).comm.ops for lesson in ("04_zero1", "05_zero2", "06_zero3")}


def test_sharded_lessons_run_and_are_metered_without_the_2_13_names():
    ops = spawn(2, sharded_lessons_without_the_2_13_names)[0]
    assert ops["04_zero1"]["reduce_scatter"]["calls"] == 1 and ops["04_zero1"]["all_gather"]["calls"] == 1
    assert ops["05_zero2"]["reduce_scatter"]["calls"] == 1 and ops["05_zero2"]["all_gather"]["calls"] == 1
    assert ops["06_zero3"]["reduce_scatter"]["calls"] == 2 and ops["06_zero3"]["all_gather"]["calls"] == 4


# ----------------------------------------------------------------------------- measurement on CUDA
def test_gpu_overlap_from_kernel_times(tmp_path):
    # A trace as torch.profiler writes it on a GPU: NCCL kernels 0-100 us and 200-300 us,
    # compute kernels 50-250 us. NCCL runs 200 us, of which 100 (50-100, 200-250) beside compute.
    kernels = [("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL", 0, 100), ("ampere_sgemm_128x64_nn", 50, 150),
               ("ncclDevKernel_AllGather_RING_LL", 200, 100), ("vectorized_elementwise_kernel", 150, 100)]
    events = [{"cat": "kernel", "name": n, "ts": ts, "dur": dur} for n, ts, dur in kernels]
    events.append({"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 400})  # CPU ops do not count
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    got = gpu_overlap(str(path))
    assert got["comm_ms"] == pytest.approx(0.2) and got["exposed_ms"] == pytest.approx(0.1)
    assert got["hidden_share"] == pytest.approx(0.5)
    path.write_text(json.dumps({"traceEvents": events[1:2]}))
    assert gpu_overlap(str(path)) is None  # no NCCL kernel: nothing to say, not 0 %


def test_a_meter_not_on_the_cpu_clock_reports_unavailable_not_a_number():
    meter = comm_meter.CommMeter(2, cpu_timed=False)  # what Run makes for NCCL
    meter.spans, meter.blocked, meter.window = [["all_reduce", 0.0, 1.0]], [[0.5, 1.0]], (0.0, 1.0)
    assert meter.overlap() is None and timeline(meter) is None
    gloo = comm_meter.CommMeter(2)
    gloo.spans, gloo.blocked, gloo.window = meter.spans, meter.blocked, meter.window
    assert gloo.overlap()["hidden_share"] == pytest.approx(0.5)


def test_a_step_batch_is_made_once_and_each_micro_step_gets_its_rows():
    args = common.parse_args(["--global-batch", "8", "--grad-accum", "2", "--seq-len", "16"])
    tokens = global_batch(args.seed, 3, 8, 16, args.vocab_size)
    env = common.Dist(1, 2, torch.device("cpu"), "gloo")  # rank 1 of 2: rows 4..7, 2 per micro-step
    for micro in range(2):
        x, y = get_batch(args, env, 3, micro)
        rows = tokens[4 + 2 * micro:6 + 2 * micro]
        assert torch.equal(x, rows[:, :-1]) and torch.equal(y, rows[:, 1:])
    first = get_batch(args, env, 3, 0)[0]
    assert get_batch(args, env, 3, 1)[0].untyped_storage().data_ptr() == first.untyped_storage().data_ptr()


# ----------------------------------------------------------------------------- checkpoints
def test_checkpoint_files_are_read_to_the_cpu(tmp_path, monkeypatch):
    # A checkpoint written on GPUs holds tensors tagged with the GPU they came from; torch.load
    # without map_location would put them back there, and fail on a CPU or a smaller machine.
    proc = subprocess.run([sys.executable, lesson_file("04_zero1"), "--device", "cpu", "--steps", "2",
                           "--save-every", "2", "--checkpoint-dir", str(tmp_path), "--n-layer", "1",
                           "--d-model", "32", "--seq-len", "16", "--peak-params", "0"],
                          cwd=ROOT, env=ENV, text=True, capture_output=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    from lessonkit import checkpoint
    seen, load = [], torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **k: seen.append(k.get("map_location")) or load(*a, **k))
    checkpoint.read(checkpoint.latest(str(tmp_path)))
    assert seen == ["cpu"]


# ----------------------------------------------------------------------------- bf16 accumulation
ACCUM = ["--precision", "bf16", "--grad-accum", "4", "--global-batch", "8", "--n-layer", "2",
         "--d-model", "32", "--seq-len", "16", "--grad-clip", "0", "--device", "cpu"]


def fp32_sum_of_bf16_micro_grads(argv):
    """Single process, bf16 model: each micro-step's bf16 gradient, summed in fp32."""
    args = common.parse_args(argv)
    env = common.Dist(0, 1, torch.device("cpu"), "gloo")
    model = common.GPT(common.model_config(args), seed=args.seed).to(torch.bfloat16)
    total = {}
    for micro in range(args.grad_accum):
        x, y = get_batch(args, env, 0, micro)
        (model(x, y) / args.grad_accum).backward()
        for name, p in model.named_parameters():
            total[name] = p.grad.float() if name not in total else total[name] + p.grad.float()
            p.grad = None
    return total


def first_step_gradients(lesson, argv):
    """In a spawned rank: the full fp32 gradient the optimizer of 05 or 06 uses at step 0,
    gathered from every rank's shards, by parameter name."""
    args = common.parse_args(argv)
    env = common.init_distributed(args)
    if lesson == "05_zero2":
        model = common.build_model(args, env)
        opt = load_lesson(lesson).ZeRO2Optimizer(model.parameters(), torch.optim.AdamW, **optimizers.adamw_kwargs(args))
        # (params, their flat offsets, [(elements lo .. hi of my shard, their gradient)], numel_padded)
        layouts = [(b.params, [b.offsets[p][0] for p in b.params], ps, b.numel_padded)
                   for b, ps in zip(opt.grad_buckets.buckets, opt.shard_optimizer.pieces)]
        names = model
    else:  # 06: the caller's optimizer steps the shards; backward leaves their gradients
        model = load_lesson(lesson).build_model(args, env)
        opt, names = torch.optim.AdamW(model.parameters()), model.module
    grads = {}

    def capture():  # instead of the first optimizer step
        if lesson == "06_zero3":
            held = [(u.params, u.offsets, [(lo, hi, s.grad) for s, (lo, hi) in zip(u.sharded, u.ranges)
                                           if s.grad is not None], u.numel_padded) for u in model.units]
        else:
            start = lambda n: env.rank * (n // env.world_size)  # noqa: E731 (my shard's first flat element)
            held = [(params, offsets, [(offset + lo - start(n), offset + hi - start(n), piece.grad)
                                       for p, offset, lo, hi, piece in pieces], n) for params, offsets, pieces, n in layouts]
        for params, offsets, pieces, numel_padded in held:
            shard = torch.zeros(numel_padded // env.world_size)
            for lo, hi, grad in pieces:  # what the optimizer steps, placed in my shard
                shard[lo:hi] = grad
            flat = torch.empty(numel_padded)
            dist.all_gather_into_tensor(flat, shard)
            for p, offset in zip(params, offsets):
                grads[p] = flat[offset:offset + p.numel()].view(p.shape).clone()
    inner = opt.shard_optimizer.optim if lesson == "05_zero2" else opt
    inner.step = capture
    for micro in range(args.grad_accum):
        x, y = get_batch(args, env, 0, micro)
        (model(x, y) / args.grad_accum).backward()  # (05's and 06's reduce-scatters end inside it)
    opt.step()
    return {name: grads[p] for name, p in names.named_parameters()}


@pytest.mark.parametrize("lesson", ["05_zero2", "06_zero3"])
def test_bf16_micro_step_gradients_accumulate_in_fp32(lesson):
    want = fp32_sum_of_bf16_micro_grads(ACCUM)
    # One rank does the reference's arithmetic op for op: each micro-step's bf16 gradient (a
    # reduce-scatter over one rank copies it), then an fp32 sum in the same order. Bit for bit;
    # a bf16 sum rounds to 8 bits at every micro-step and misses.
    got = spawn(1, first_step_gradients, lesson, ACCUM)[0]
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name
    # Two ranks: each rank's backward over its own rows rounds in bf16 at other points than the
    # reference's over the whole batch, and the reduce-scatter sums in bf16 (the collective in
    # the working precision, as FSDP2 with reduce_dtype=bf16). Measured: 2.6e-3 relative over
    # all gradients, 7.2e-3 for the worst tensor, noise as large as what a bf16 sum of the
    # micro-steps would add (2.6e-3), so only world 1 can tell the two apart. Here the bound
    # 1e-2 catches what a wrong gradient (a micro-step lost, a slice from the wrong rank) does:
    # errors of order 1.
    for got in spawn(2, first_step_gradients, lesson, ACCUM):
        diff = sum(((got[n] - want[n]) ** 2).sum() for n in want) ** 0.5
        assert diff <= 1e-2 * sum((want[n] ** 2).sum() for n in want) ** 0.5


# ----------------------------------------------------------------------------- make gpu-check
def test_gpu_check_without_a_gpu_says_so_and_exits_0():
    proc = subprocess.run([sys.executable, "-m", "scripts.perf.gpu_check"], cwd=ROOT,
                          env=dict(ENV, CUDA_VISIBLE_DEVICES=""), text=True, capture_output=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip().splitlines() == [
        "gpu-check: no CUDA GPU on this machine (torch sees none): nothing to check"], proc.stdout + proc.stderr


def test_gpu_check_runs_its_checks_on_cpu(tmp_path):
    # The script's whole path on gloo (2 ranks): lessons in fp16 (fp32 and bf16: the same path, less its
    # loss scaler) against the CPU reference, 00's ring at world 2, a save resumed at another world
    # size, fp16's overflow at a loss scale of 2^40, the table. (How it fails: tests/test_gpu_check.py.)
    # Two lessons of the eight (--lessons): a replicated one and 07 (06's units, and its tier
    # lines); every lesson runs on CPU in its own tests, and this is the script's path.
    proc = subprocess.run([sys.executable, "-m", "scripts.perf.gpu_check", "--device", "cpu", "--quick",
                           "--lessons", "01_vanilla_dp", "07_offload", "--precision", "fp16",
                           "--out", str(tmp_path / "out")],
                          cwd=ROOT, env=dict(ENV, TMPDIR=str(tmp_path)), text=True, capture_output=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not glob.glob(str(tmp_path / "gpu_check_*")), os.listdir(tmp_path)  # (it once left a folder a precision)
    tmp_path = tmp_path / "out"
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert len(result["rows"]) == 2 * 2  # world 1 and 2, two lessons
    assert all(r["ok"] for r in result["rows"])
    assert [(c["check"].split(",")[0], c["ok"]) for c in result["checks"]] == [
        ("00_collectives at world 2", True), ("06_zero3 saved and resumed", True),
        ("fp16 at a loss scale of 2^40", True)]  # (--quick: no checkpointing twin)
    table = (tmp_path / "gpu_check.md").read_text()
    assert table.count("| 07_offload |") == 2 and "2 CPU ranks -> 1" in table  # (the resume check runs 06)
    assert table.count("- 07_offload world ") == 2 and "exposed: all (plain copies on the CPU" in table  # its tiers
    assert "4 runs skipped steps [0, 1, 2] on every rank, the scale 2^40 -> 2^37" in table
