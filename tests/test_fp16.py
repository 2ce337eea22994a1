"""`--precision fp16` (issue 30), every lesson, in one 2-rank launch: fp16 parameters, gradients
and collectives, fp32 master weights and moments, and dynamic loss scaling written once
(lessonkit/loss_scale.py), held to:

- single-process fp16 training on the whole batch with the same scaler (harness.reference):
  01-03, 04, 05 and 06 with 2 micro-steps (their gradient shards add up in fp32); 06, 07 and 08
  at --shard-group 1 (2 replicas of one shard: 5b)'s all-reduce; the 2 x 2 grid, 4 ranks, is
  tests/test_08_hybrid.py's)
  with 2 micro-steps and clipping unreached (CLIP_UNREACHED), as beside FSDP2;
- PyTorch's DistributedDataParallel with torch.amp.GradScaler("cpu"), in the lessons' own loop,
  bit for bit. GradScaler unscales the gradients of the optimizer's param_groups, and refuses
  fp16 ones ("Attempting to unscale FP16 gradients": divided by the scale in fp16 they would
  underflow again), and PyTorch has no optimizer that keeps fp32 master weights for fp16
  parameters (its fp16 recipe is autocast over fp32 parameters: other arithmetic, 4 + 4 + 8
  bytes). So DDP's loop steps the lessons' optimizer, optimizers.MixedPrecisionAdamW, whose
  param_groups are its fp32 masters, and casts the gradients to them first
  (`opt.master_grads()`, the one line it adds); found-inf, unscaling, skipping and the scale's
  updates are then GradScaler's own. Under DDP every rank holds the same all-reduced gradient,
  so GradScaler needs no collective for its flag (loss_scale.py says why the lessons' has one).
  04 and 05 are held to the same DDP loop bit for bit too (their fp16 reduce-scatter adds the
  same two halves as the all-reduce; AdamW is elementwise, on a shard as on a tensor), with
  clipping at a norm only the scaled gradients reach (CLIP_UNREACHED). Not to PyTorch's
  ZeroRedundancyOptimizer with GradScaler: over fp16 parameters it runs AdamW in fp16, with no
  fp32 masters or moments (GradScaler refuses to unscale its fp16 gradients anyway), and over
  fp32 parameters it is another recipe (autocast, 4 + 4 + 8 bytes): no same-loop counterpart;
- 06 against PyTorch's FSDP2 (fully_shard per block, then the root, on a CPU mesh) with
  MixedPrecisionPolicy(param_dtype=fp16, reduce_dtype=fp16) and its ShardedGradScaler("cpu"),
  in 06's loop (unscale_, clip, step, update), 2 micro-steps, bit for bit where clipping does not
  bite (CLIP_UNREACHED). It runs on CPU/gloo in torch 2.13: ShardedGradScaler takes "cpu" (its
  replicator serves CPU tensors, its flag is all-reduced on the CPU) and gloo reduce-scatters
  fp16. The arithmetic is the same: FSDP2's shards are the fp32 masters, as 06's; in fp16 it
  divides by about sqrt(N) before its reduce-scatter and by the rest after, which at 2 ranks is
  06's division by N before it (exact: a power of two); the reduced fp16 shard is cast to fp32
  and micro-steps add up there; torch's AdamW steps both. 07 and 08 (--shard-group 1) do 06's
  arithmetic, moved to the host or regrouped, and are held to the same FSDP2 run bit for bit
  (FSDP2 with CPUOffloadPolicy(pin_memory=False), and HSDP on a 2 x 1 mesh, give those bits as
  well: measured, not run here, to keep the launch short);
- an inf put at step 2 into rank 1's gradient where only rank 1 sees it: 01-03's after the
  all-reduce, 04's and 05's into rank 1's gradient shard after the reduce-scatter, 06's and 07's
  into its fp32 gradient shard, 08's after 5b)'s all-reduce across the replicas, so that only
  the flag's all-reduce (over the world, also in 08) tells rank 0. Every rank skips that step
  (each rank's scaler records it): parameters, masters and AdamW's state (its step count too)
  unchanged, the scale halved, the ranks still equal after the step after it;
- a checkpoint keeps the loss scale: 06's inf run saved after step 3 and resumed from there
  continues bit for bit, its scaler's state (scale, growth tracker, steps, skipped steps) the
  uninterrupted run's;
- 2 + 2 + 12 bytes at rest (04, 05: the paper's sharding, plus padding), the flag's 4 bytes
  beside the gradients' collectives, and with 2 micro-steps their fp32 sum kept as in bf16
  (03: ddp.FP32Accumulation, 4 bytes more per parameter; 05: fp32 shards, 4 Psi / N); 06 at
  rest fp32 shards (4 + 4 + 8 bytes / N, FSDP2's convention, as in bf16), its gathers and
  reduce-scatters 2 bytes an element;
- GradScaler's growth and backoff, step by step, on a plain torch.optim optimizer (no launch).

fp16 on CPU: torch 2.13's CPU kernels run this GPT in fp16, forward and backward: the linear
layers' matmuls, LayerNorm, GELU, scaled_dot_product_attention (its softmax), the embeddings;
the cross-entropy runs on the logits cast to fp32, as in every precision (model.py), and fp16
cross-entropy runs on CPU as well (test_fp16_kernels_run_on_this_cpu).
"""
import contextlib
import io
import json
import os
import shutil
import tempfile

import torch
import torch.distributed as dist

from graded import load_lesson
from harness import PEAKS, close, comm_ops, held, launches, memory_theory, reference, run_lesson
from lessonkit.common import model_config, parse_args
from lessonkit.summary import print_summary
from model import GPT
from tolerances import FP16_LOSS_TOL, FP16_PARAM_TOL

LESSONS = ("01_vanilla_dp", "02_async_allreduce", "03_buckets")
SHARDED = ("04_zero1", "05_zero2")
ARGV = ["--steps", "6", "--n-layer", "2", "--d-model", "32", "--seq-len", "16",
        "--global-batch", "8", "--log-every", "100", "--precision", "fp16"]
# 04 and 05 beside DDP bit for bit: clipping at 256, which the true gradients' norms here (0.9 to
# 1.3) never reach and the scaled ones (x 2^16: 60,000 and more) always pass, so it must see them
# unscaled; there it multiplies by exactly 1 (the shards' norm is summed in another order than
# DDP's, over tensors: where clipping bites, the last bits differ). These runs and INF_ARGV's are
# not held to memory: --peak-params 0 skips the measured step's sampling after every op, most of
# a run's time here (0.5-0.9 s a run with it, 0.05-0.25 s without)
CLIP_UNREACHED = ARGV + ["--grad-clip", "256", "--peak-params", "0"]
INF_AT, INF_ON = 2, 1  # the step, and the rank whose gradient gets an inf
# 4 steps: the one skipped and one after it. Without clipping: were one rank to step where another
# skips, 04's and 05's would wait in clipping's all-reduce for good (a hang), not fail an assert
INF_ARGV = ARGV[:1] + ["4"] + ARGV[2:] + ["--grad-clip", "0", "--peak-params", "0"]
# 05: buckets of 0.02 MiB (4 here), and 2 micro-steps (its gradient shards then add up in fp32)
BUCKETS = ["--bucket-mb", "0.02"]
ZERO3 = ("06_zero3", "07_offload", "08_hybrid")
# 06 with 2 micro-steps (its fp32 gradient shards add them up); 08 at 2 ranks as 2 replicas of one
# shard (--shard-group 1): what 5b)'s all-reduce and the flag's over the world are for
EXTRA = {"05_zero2": BUCKETS + ["--grad-accum", "2"], "06_zero3": ["--grad-accum", "2"],
         "08_hybrid": ["--shard-group", "1"]}
# 06, 07 and 08 beside FSDP2 with ShardedGradScaler: 2 micro-steps, clipping unreached
ZERO3_CLIP = CLIP_UNREACHED + ["--grad-accum", "2"]
SAVED_AT = 4  # 06's inf run saved after step 3: the scale halved at step 2, its growth tracker then at 1
# --loss-scale 2^20: this model's scaled gradients overflow fp16 at steps 0, 1 and 5 (measured);
# step 1 measured, skipped, with no step applied before it, as --measure-step 0 at GradScaler's
# default scale (no overflow here): the two runs hold the same bytes at rest, moments not yet made
SCALED, SCALED_SKIPS = ARGV + ["--loss-scale", str(2 ** 20), "--measure-step", "1", "--peak-params", "0"], [0, 1, 5]
AT_STEP_0 = ARGV + ["--measure-step", "0", "--peak-params", "0"]


# ----------------------------------------------------------------------------- in the ranks
def ddp_with_grad_scaler(argv):
    """PyTorch's DDP and torch.amp.GradScaler, in the loop main() runs (the module docstring
    says why the optimizer is the lessons' and why it casts the gradients first)."""
    from lessonkit import common, optimizers
    from model import get_batch
    args = common.parse_args(argv)
    env = common.Dist(dist.get_rank(), dist.get_world_size(), torch.device("cpu"), "gloo")
    model = common.build_model(args, env)
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=args.bucket_mb)
    opt = optimizers.MixedPrecisionAdamW(optimizers.decay_groups(model, args.weight_decay), args.grad_clip,
                                         **optimizers.adamw_kwargs(args))
    scaler = torch.amp.GradScaler("cpu", **({"init_scale": args.loss_scale} if args.loss_scale else {}))
    losses, skipped = [], []
    for step in range(args.steps):
        optimizers.set_learning_rate(opt, args, step)
        loss = ddp(*get_batch(args, env, step, 0))
        scaler.scale(loss).backward()
        opt.master_grads()  # fp32 gradients on the masters: what GradScaler unscales (it refuses fp16 ones)
        scaler.step(opt)
        before = scaler.get_scale()
        scaler.update()
        skipped += [step] if scaler.get_scale() < before else []  # (it backs off after a skipped step only)
        opt.zero_grad()
        dist.all_reduce(mean := loss.detach().clone())
        losses.append(mean.item() / env.world_size)
    return {"losses": losses, "params": {n: p.detach().float().clone() for n, p in model.named_parameters()},
            "scale": scaler.get_scale(), "skipped": skipped}


def fsdp2_with_sharded_grad_scaler(argv):
    """PyTorch's FSDP2 (fully_shard per block, then the root, on a CPU mesh; fp16 gathers, compute
    and reduce-scatters: MixedPrecisionPolicy(fp16, fp16)) and its ShardedGradScaler("cpu"), in
    06's loop: unscale_ before clipping, step, update."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
    from lessonkit import common, optimizers
    from model import GPT, get_batch
    args = common.parse_args(argv)
    env = common.Dist(dist.get_rank(), dist.get_world_size(), torch.device("cpu"), "gloo")
    model = GPT(common.model_config(args), seed=args.seed)  # fp32: FSDP2's shards are the master weights
    options = dict(mesh=init_device_mesh("cpu", (env.world_size,)),
                   mp_policy=MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float16))
    for block in model.blocks:
        fully_shard(block, **options)
    fully_shard(model, **options)
    opt = torch.optim.AdamW(optimizers.decay_groups(model, args.weight_decay), **optimizers.adamw_kwargs(args))
    scaler, losses = ShardedGradScaler("cpu"), []
    for step in range(args.steps):
        optimizers.set_learning_rate(opt, args, step)
        loss = 0.0
        for micro in range(args.grad_accum):
            micro_loss = model(*get_batch(args, env, step, micro)) / args.grad_accum
            scaler.scale(micro_loss).backward()
            loss += micro_loss.detach()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(list(model.parameters()), args.grad_clip)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        dist.all_reduce(loss)
        losses.append(loss.item() / env.world_size)
    return {"losses": losses, "params": {n: p.full_tensor().float() for n, p in model.named_parameters()},
            "scale": scaler.get_scale()}


def with_an_inf(lesson, argv):
    """main(), with an inf put into rank INF_ON's gradient at step INF_AT where no other rank
    sees it: 01-03's first gradient after the all-reduce (as LossScaler.step begins), 04's and
    05's gradient shard after the reduce-scatter (as ShardOptimizer.step begins), 06's and 07's
    first fp32 gradient shard and 08's after 5b)'s all-reduce (as LossScaler.unscale_ begins);
    everything the step could change copied just before it and just after it, this rank's
    skipped steps and its scaler's state at the end (state_dict)."""
    from lessonkit import loss_scale
    shard_optimizer = load_lesson("shard").ShardOptimizer  # 04 and 05 step with it
    scaler_class, shard_step, seen = loss_scale.LossScaler, shard_optimizer.step, {}
    original = {name: getattr(scaler_class, name) for name in ("step", "unscale_", "update")}

    def here(scaler):  # the step and the rank that get the inf
        return scaler.steps == INF_AT and dist.get_rank() == INF_ON

    def state(opt):
        inner = getattr(opt, "shard_optimizer", opt)  # 04, 05: the step on my shards
        params = getattr(opt, "params", [p for g in opt.param_groups for p in g["params"]])  # 06-08: fp32 shards
        masters = inner.masters if hasattr(inner, "masters") else getattr(inner, "master", params)
        return {"params": [p.detach().clone() for p in params], "masters": [m.detach().clone() for m in masters],
                "adamw": [{k: v.clone() for k, v in s.items()} for s in getattr(inner, "optim", inner).state.values()]}

    def step(self, opt):
        seen["step"] = self.steps
        if here(self) and getattr(opt, "unscale_in_step", False) and not hasattr(opt, "shard_optimizer"):
            opt.params[0].grad.view(-1)[0] = float("inf")
        before = state(opt) if self.steps == INF_AT else None
        original["step"](self, opt)
        if before is not None:
            seen["before"], seen["after"] = before, state(opt)
        seen["skipped_steps"] = list(self.skipped_steps)

    def unscale_(self, opt):
        if here(self) and not self.unscaled:
            grad = next(p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None)
            grad.view(-1)[0] = float("inf")  # 06, 07: my fp32 shard's; 08 at G = 1: my replica's
        original["unscale_"](self, opt)

    def update(self):
        original["update"](self)
        seen["scaler"] = self.state_dict()

    def sharded_step(self, grad_shards, unscale=None):
        if seen["step"] == INF_AT and dist.get_rank() == INF_ON:
            grad_shards[0][0] = float("inf")  # my shard of the first flat buffer (05: bucket 0)
        return shard_step(self, grad_shards, unscale)

    scaler_class.step, scaler_class.unscale_, scaler_class.update = step, unscale_, update
    shard_optimizer.step = sharded_step
    try:
        return {**run_lesson(lesson, argv), **seen}
    finally:
        for name, fn in original.items():
            setattr(scaler_class, name, fn)
        shard_optimizer.step = shard_step


def interrupted(argv):
    """06's run with the inf (with_an_inf), saving at step SAVED_AT, and the same run resumed from
    that checkpoint, in another directory; and the loss scale its meta.json holds."""
    root = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(root, src=0)
    full, resumed = (os.path.join(root[0], name) for name in ("full", "resumed"))
    save, saved, out = ["--save-every", str(SAVED_AT)], f"step_{SAVED_AT:06d}", {}
    try:
        out["full"] = with_an_inf("06_zero3", argv + save + ["--checkpoint-dir", full])
        if dist.get_rank() == 0:
            shutil.copytree(os.path.join(full, saved), os.path.join(resumed, saved))
        dist.barrier()
        # (another --loss-scale: the checkpoint's scale wins, and the report says where the run began)
        out["resumed"] = with_an_inf("06_zero3", argv + save + ["--checkpoint-dir", resumed, "--resume",
                                                                "--loss-scale", "1024"])
        with open(os.path.join(resumed, saved, "meta.json")) as f:
            out["saved"] = json.load(f)["loss_scale"]
        dist.barrier()  # every rank has read it
    finally:
        if dist.get_rank() == 0:
            shutil.rmtree(root[0], ignore_errors=True)
    return out


def suite(world):
    out = {"ddp": ddp_with_grad_scaler(ARGV)}
    for lesson in LESSONS + SHARDED:
        out[lesson] = run_lesson(lesson, ARGV + EXTRA.get(lesson, []))
        out[lesson, "inf"] = with_an_inf(lesson, INF_ARGV + EXTRA.get(lesson, []))
    out["06_zero3"] = run_lesson("06_zero3", ARGV + EXTRA["06_zero3"] + PEAKS)  # clipping bites: the true norm
    for lesson in ZERO3:
        out[lesson, "clip_256"] = run_lesson(lesson, ZERO3_CLIP + EXTRA.get(lesson, []))
    for lesson in ZERO3[1:]:  # (06's: in interrupted)
        out[lesson, "inf"] = with_an_inf(lesson, INF_ARGV + EXTRA.get(lesson, []))
    out["accum"] = run_lesson("03_buckets", ARGV + ["--grad-accum", "2"])  # micro-steps summed in fp32
    out["ddp", "clip_256"] = ddp_with_grad_scaler(CLIP_UNREACHED)
    for lesson in SHARDED:
        out[lesson, "clip_256"] = run_lesson(lesson, CLIP_UNREACHED + BUCKETS)
    out["fsdp2", "clip_256"] = fsdp2_with_sharded_grad_scaler(ZERO3_CLIP)
    # 06's inf run, 5 steps, saved at step 4 and resumed from there
    ckpt = interrupted(INF_ARGV + EXTRA["06_zero3"] + ["--steps", "5"])
    out["06_zero3", "inf"], out["06_zero3", "resumed"] = ckpt["full"], ckpt["resumed"]
    out["saved_loss_scale"] = ckpt["saved"]
    out["ddp", "scaled"] = ddp_with_grad_scaler(SCALED)
    for lesson in LESSONS + SHARDED + ZERO3:
        out[lesson, "scaled"], out[lesson, "step_0"] = run_lesson(lesson, SCALED), run_lesson(lesson, AT_STEP_0)
    return out


results = launches(suite)


# ----------------------------------------------------------------------------- the tests
def test_fp16_matches_single_process_with_the_same_scaler():
    zero3_clip = [(lesson, "clip_256") for lesson in ZERO3]  # (07, 08: only there)
    for argv, keys in [(ARGV, LESSONS + SHARDED + ("06_zero3", "accum")), (CLIP_UNREACHED, zero3_clip)]:
        want = reference(argv)
        for rank, rank_out in enumerate(results(2)):
            for key in keys:
                got = rank_out[key]
                torch.testing.assert_close(got["losses"], want["losses"], **FP16_LOSS_TOL, msg=f"rank {rank} {key}")
                assert got["params"].keys() == want["params"].keys(), key
                for name, p in got["params"].items():
                    torch.testing.assert_close(p, want["params"][name], **FP16_PARAM_TOL, msg=f"rank {rank} {key} {name}")


def test_fp16_matches_ddp_with_torch_grad_scaler_bit_for_bit():
    for rank_out in results(2):
        for lesson in LESSONS:
            close(rank_out[lesson], rank_out["ddp"], dict(rtol=0, atol=0))
    for lesson in LESSONS:  # (the report is rank 0's)
        assert results(2)[0][lesson]["report"]["loss_scale"]["final_scale"] == results(2)[0]["ddp"]["scale"]


def equal_to_the_counterpart(lessons, counterpart):
    """Every rank's losses and weights of each lesson's clip_256 run are the counterpart's, bit for
    bit, and so is the final loss scale (rank 0's report)."""
    for rank_out in results(2):
        for lesson in lessons:
            close(rank_out[lesson, "clip_256"], rank_out[counterpart, "clip_256"], dict(rtol=0, atol=0))
    for lesson in lessons:
        scale = results(2)[0][lesson, "clip_256"]["report"]["loss_scale"]["final_scale"]
        assert scale == results(2)[0][counterpart, "clip_256"]["scale"]


def test_fp16_sharded_matches_ddp_with_torch_grad_scaler_bit_for_bit():
    equal_to_the_counterpart(SHARDED, "ddp")


def test_fp16_zero3_matches_fsdp2_with_sharded_grad_scaler_bit_for_bit():
    # the same loop, 2 micro-steps (fp32 gradient shards add them up in both), clipping unreached
    # (CLIP_UNREACHED: a norm summed in another order than FSDP2's, over DTensors, differs in its
    # last bits; where clipping bites, so do the weights). 07 and 08 (--shard-group 1) do 06's
    # arithmetic, moved to the host or regrouped (at G = 1 a reduce-scatter over one rank, then
    # the all-reduce over two adds the same two halves): held to the same FSDP2 run. (FSDP2 with
    # CPUOffloadPolicy, and HSDP on a 2 x 1 mesh, give these bits too: measured, not run here.)
    equal_to_the_counterpart(ZERO3, "fsdp2")


def test_an_inf_on_one_rank_skips_that_step_on_every_rank():
    for lesson in LESSONS + SHARDED + ZERO3:
        ranks = [rank_out[lesson, "inf"] for rank_out in results(2)]
        for rank_out in ranks:
            before, after = rank_out["before"], rank_out["after"]
            for what in ("params", "masters"):  # the skipped step changed nothing, on every rank
                assert len(before[what]) == len(after[what]) > 0, (lesson, what)
                for b, a in zip(before[what], after[what]):
                    assert torch.equal(b, a), (lesson, what)
            assert len(before["adamw"]) == len(after["adamw"]) > 0, lesson
            for b, a in zip(before["adamw"], after["adamw"]):  # AdamW's moments and step count
                assert b.keys() == a.keys() and all(torch.equal(b[k], a[k]) for k in b), lesson
            assert rank_out["skipped_steps"] == [INF_AT], lesson  # every rank's scaler skipped it
        scale = ranks[0]["report"]["loss_scale"]
        assert scale["skipped_steps"] == [INF_AT], lesson
        assert scale["final_scale"] == scale["init_scale"] / 2, lesson  # backed off once, not grown back
        close(ranks[1], ranks[0], dict(rtol=0, atol=0))  # the replicas still equal, after the step after it


def test_loss_scale_flag_starts_there_and_a_skipped_measured_step_is_measured():
    # --loss-scale S: every lesson's scaler starts at S and skips what GradScaler(init_scale=S) does
    # beside DDP (01-03: bit for bit); at the measured step 1, skipped, every lesson measures its
    # bytes at rest (06-08 measured none before: optimizer.step() never came), the same as at step 0
    # with nothing skipped, and the summary says why the optimizer holds no moments yet
    ddp = results(2)[0]["ddp", "scaled"]
    assert ddp["skipped"] == SCALED_SKIPS
    for lesson in LESSONS + SHARDED + ZERO3:
        for rank_out in results(2):
            if lesson in LESSONS:
                close(rank_out[lesson, "scaled"], rank_out["ddp", "scaled"], dict(rtol=0, atol=0))
        report, at_step_0 = (results(2)[0][lesson, key]["report"] for key in ("scaled", "step_0"))
        assert report["loss_scale"]["init_scale"] == 2.0 ** 20 and report["loss_scale"]["skipped_steps"] == SCALED_SKIPS
        assert report["loss_scale"]["final_scale"] == ddp["scale"], lesson
        assert at_step_0["loss_scale"]["skipped_steps"] == [], lesson
        at_rest = [[{k: v for k, v in m.items() if k != "max_rss"} for m in held(r)] for r in (report, at_step_0)]
        assert at_rest[0] == at_rest[1] and at_rest[0][0]["params"] > 0, lesson  # (max_rss: the process's)
        for r, line in ((report, "fp16 skipped every step before step 1"), (at_step_0, "step 0 measures before it")):
            with contextlib.redirect_stdout(io.StringIO()) as printed:
                print_summary(r)
            assert f"AdamW makes its moments at its first step, and {line}" in printed.getvalue(), lesson


def test_fp16_report_memory_and_bytes():
    for lesson in LESSONS:
        report = results(2)[0][lesson]["report"]
        psi = report["n_params"]
        assert report["precision"] == "fp16"
        assert report["loss_scale"] == {"init_scale": 2.0 ** 16, "final_scale": 2.0 ** 16, "growth_interval": 2000,
                                        "skipped_steps": []}
        # fp16 gradients, plus the found-inf flag: one 4-byte fp32 all-reduce per step
        assert comm_ops(report)["all_reduce"]["bytes"] == 2 * psi + 4
        theory = memory_theory(report)
        assert (theory["params"], theory["grads"], theory["optimizer"]) == (2 * psi, 2 * psi, 12 * psi)
        for mem in held(report):  # measured at rest, before the optimizer casts its fp32 gradients
            assert mem["params"] == 2 * psi and mem["grads"] == 2 * psi
            # (+ torch's AdamW's 4-byte step counter per tensor, as in bf16: harness.replicated_bf16_memory)
            assert mem["optimizer"] == 12 * psi + 4 * len(results(2)[0][lesson]["params"])
    # 2 micro-steps: their fp32 sum is kept beside the fp16 gradient, as in bf16 (ddp.FP32Accumulation)
    accum = results(2)[0]["accum"]["report"]
    assert memory_theory(accum)["grads"] == held(accum)[0]["grads"] == 6 * accum["n_params"]


def test_fp16_sharded_report_memory_and_bytes():
    """04, and 05 with 2 micro-steps: 2 + 2 + 12 bytes with the optimizer state (05: and the
    gradients) divided by N, 05's gradient shards kept in fp32 between micro-steps (theory.MIXED);
    fp16 collectives, and beside clipping's all-reduce the found-inf flag's, 4 bytes each."""
    for lesson, grad_bytes in (("04_zero1", 2), ("05_zero2", 4 / 2)):  # 05: fp32 shards, 1/N each
        out = results(2)[0][lesson]
        report, n_tensors = out["report"], len(out["params"])
        psi, ops, theory = report["n_params"], comm_ops(report), memory_theory(report)
        assert report["loss_scale"]["skipped_steps"] == [], lesson
        assert ops["all_reduce"] == {"calls": 2, "bytes": 8}, lesson  # the squared norm, the found-inf flag
        # fp16 each way; every flat buffer (05: each of its buckets) padded to a multiple of N = 2
        n_buffers = ops["all_gather"]["calls"]
        micro_steps = 2 if lesson == "05_zero2" else 1  # 05 reduce-scatters at every micro-step
        # 04: one flat buffer; 05: each bucket gathered once, reduce-scattered once a micro-step
        assert n_buffers == (1 if lesson == "04_zero1" else ops["reduce_scatter"]["calls"] / micro_steps), lesson
        assert 0 <= ops["all_gather"]["bytes"] - 2 * psi <= 2 * n_buffers, lesson
        assert ops["reduce_scatter"]["bytes"] == micro_steps * ops["all_gather"]["bytes"], lesson
        assert (theory["params"], theory["grads"], theory["optimizer"]) == (2 * psi, grad_bytes * psi, 6 * psi)
        for mem in held(report):  # measured at rest: the paper's, plus padding (and AdamW's step counts)
            assert 0 <= mem["params"] - theory["params"] <= 2 * n_buffers, lesson
            assert 0 <= mem["grads"] - theory["grads"] <= 4 * n_buffers, lesson
            assert 0 <= mem["optimizer"] - theory["optimizer"] <= 12 * n_buffers + 4 * (n_tensors + n_buffers), lesson


def test_a_resumed_fp16_run_continues_with_its_loss_scale():
    """06's inf run (the scale halved at step 2) saved at step 4 and resumed there: the same last
    step bit for bit, and the scaler's state at the end (scale, growth tracker, steps seen, steps
    skipped) the uninterrupted run's, though the resumed run was given another --loss-scale;
    meta.json holds it as GradScaler's state_dict names it, and the scale the run began with."""
    saved = results(2)[0]["saved_loss_scale"]
    assert saved == {"init_scale": 2.0 ** 16, "scale": 2.0 ** 15, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000,
                     "_growth_tracker": 1, "steps": SAVED_AT, "skipped_steps": [INF_AT]}
    for rank_out in results(2):
        full, resumed = rank_out["06_zero3", "inf"], rank_out["06_zero3", "resumed"]
        close(resumed, {**full, "losses": full["losses"][SAVED_AT:]}, dict(rtol=0, atol=0))  # step 4 of each
        assert resumed["scaler"] == full["scaler"] == {**saved, "_growth_tracker": 2, "steps": SAVED_AT + 1}
    full, resumed = results(2)[0]["06_zero3", "inf"], results(2)[0]["06_zero3", "resumed"]
    assert resumed["report"]["loss_scale"] == full["report"]["loss_scale"]  # what the summary prints


def test_fp16_zero3_memory_and_bytes():
    """06 (2 micro-steps): at rest fp32 shards, as in bf16 (FSDP2's convention: the shards are the
    master weights; 4 + 4 + 8 bytes / N, plus padding); the units gathered, computed and
    reduce-scattered in fp16, 2 bytes an element; beside clipping's all-reduce the flag's."""
    from lessonkit.theory import theory_memory
    report = results(2)[0]["06_zero3"]["report"]
    psi, ops, theory = report["n_params"], comm_ops(report), memory_theory(report)
    gpt = GPT(model_config(parse_args(ARGV)), seed=None)
    blocks = [sum(p.numel() for p in b.parameters()) for b in gpt.blocks]
    units = [-(-n // 2) * 2 for n in [psi - sum(blocks)] + blocks]  # the root, then each block: padded to N = 2
    padded_psi = sum(units)
    assert {k: theory[k] for k in ("params", "grads", "optimizer")} == {"params": 2 * psi, "grads": 2 * psi,
                                                                        "optimizer": 4 * psi}
    assert theory == theory_memory("zero3", psi, 2, "bf16", grad_accum=2)
    for mem in held(report):
        assert mem["params"] == mem["grads"] == 2 * padded_psi  # fp32 shards (and their fp32 .grad): Psi / 2 x 4
        assert mem["master_weights"] == 0  # the shards are the masters: no copy
        # my fp32 shards, the root (gathered through each pass) and two blocks (prefetch), in fp16
        assert mem["peak_params"] == 2 * padded_psi + 2 * units[0] + 2 * 2 * max(units[1:])
    micro_steps = 2  # each gathers every unit twice and reduce-scatters it once, in fp16
    assert ops == {"all_gather": {"calls": micro_steps * 2 * len(units), "bytes": micro_steps * 2 * padded_psi * 2},
                   "reduce_scatter": {"calls": micro_steps * len(units), "bytes": micro_steps * padded_psi * 2},
                   "all_reduce": {"calls": 2, "bytes": 8}}  # the squared norm, the found-inf flag
    assert report["loss_scale"]["skipped_steps"] == []


def test_loss_scaler_follows_grad_scaler_step_by_step():
    """No launch: the same gradients, an inf at steps 1 and 5, growth every 3 clean steps;
    LossScaler and torch.amp.GradScaler, each with SGD over fp32 parameters, must agree on the
    scale after every step, on which steps were skipped and on the parameters."""
    from lessonkit.loss_scale import LossScaler
    runs = []
    for make in (lambda: LossScaler("cpu", init_scale=2.0 ** 4, growth_interval=3),
                 lambda: torch.amp.GradScaler("cpu", init_scale=2.0 ** 4, growth_interval=3)):
        w = torch.nn.Parameter(torch.linspace(-1, 1, 5))
        opt, scaler, scales = torch.optim.SGD([w], lr=0.1, momentum=0.9), make(), []
        for step in range(9):
            scaler.scale((w * torch.arange(5.0) * (step + 1)).sum()).backward()
            if step in (1, 5):
                w.grad[2] = float("inf")
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            scales.append(scaler.get_scale())
        runs.append((scales, w.detach().clone()))
    (ours, w_ours), (theirs, w_theirs) = runs
    assert ours == theirs == [16, 8, 8, 8, 16, 8, 8, 8, 16]
    assert torch.equal(w_ours, w_theirs)


def test_disabled_is_the_identity():
    from lessonkit.loss_scale import LossScaler
    scaler, loss = LossScaler("cpu", enabled=False), torch.tensor(2.0)
    assert scaler.scale(loss) is loss and scaler.get_scale() == 1.0 and scaler.report() is None
    w = torch.nn.Parameter(torch.ones(2))
    w.grad = torch.tensor([float("inf"), 1.0])
    scaler.step(torch.optim.SGD([w], lr=1.0))  # not checked, not skipped: what one asked for
    scaler.update()
    assert torch.isinf(w).any() and scaler.skipped_steps == []


def test_fp16_kernels_run_on_this_cpu():
    logits = torch.randn(8, 16, dtype=torch.float16, requires_grad=True)
    torch.nn.functional.cross_entropy(logits, torch.arange(8)).backward()
    assert logits.grad.dtype == torch.float16 and torch.isfinite(logits.grad).all()
