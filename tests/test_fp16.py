"""`--precision fp16` (issue 30; lessons 01-05 so far, 06-08 refuse it: test_cli.py): fp16
parameters, gradients and collectives, fp32 master weights and moments, and dynamic loss
scaling written once (lessonkit/loss_scale.py), held to:

- single-process fp16 training on the whole batch with the same scaler (harness.reference):
  01-03, 04, and 05 with 2 micro-steps (its gradient shards add up in fp32);
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
- an inf put at step 2 into rank 1's gradient where only rank 1 sees it: 01-03's after the
  all-reduce, 04's and 05's into rank 1's gradient shard after the reduce-scatter, so that only
  the flag's all-reduce tells rank 0. Every rank skips that step (each rank's scaler records
  it): parameters, masters and AdamW's state (its step count too) unchanged, the scale halved,
  the ranks still equal after the step after it;
- 2 + 2 + 12 bytes at rest (04, 05: the paper's sharding, plus padding), the flag's 4 bytes
  beside the gradients' collectives, and with 2 micro-steps their fp32 sum kept as in bf16
  (03: ddp.FP32Accumulation, 4 bytes more per parameter; 05: fp32 shards, 4 Psi / N);
- GradScaler's growth and backoff, step by step, on a plain torch.optim optimizer (no launch).

fp16 on CPU: torch 2.13's CPU kernels run this GPT in fp16, forward and backward: the linear
layers' matmuls, LayerNorm, GELU, scaled_dot_product_attention (its softmax), the embeddings;
the cross-entropy runs on the logits cast to fp32, as in every precision (model.py), and fp16
cross-entropy runs on CPU as well (test_fp16_kernels_run_on_this_cpu).
"""
import torch
import torch.distributed as dist

from harness import close, comm_ops, held, launches, memory_theory, reference, run_lesson
from tolerances import FP16_LOSS_TOL, FP16_PARAM_TOL

LESSONS = ("01_vanilla_dp", "02_async_allreduce", "03_buckets")
SHARDED = ("04_zero1", "05_zero2")
ARGV = ["--steps", "6", "--n-layer", "2", "--d-model", "32", "--seq-len", "16",
        "--global-batch", "8", "--log-every", "100", "--precision", "fp16"]
# 04 and 05 beside DDP bit for bit: clipping at 256, which the true gradients' norms here (0.9 to
# 1.3) never reach and the scaled ones (x 2^16: 60,000 and more) always pass, so it must see them
# unscaled; there it multiplies by exactly 1 (the shards' norm is summed in another order than
# DDP's, over tensors: where clipping bites, the last bits differ)
CLIP_UNREACHED = ARGV + ["--grad-clip", "256"]
INF_AT, INF_ON = 2, 1  # the step, and the rank whose gradient gets an inf
# 4 steps: the one skipped and one after it. Without clipping: were one rank to step where another
# skips, 04's and 05's would wait in clipping's all-reduce for good (a hang), not fail an assert
INF_ARGV = ARGV[:1] + ["4"] + ARGV[2:] + ["--grad-clip", "0"]
# 05: buckets of 0.02 MiB (4 here), and 2 micro-steps (its gradient shards then add up in fp32)
BUCKETS = ["--bucket-mb", "0.02"]
EXTRA = {"05_zero2": BUCKETS + ["--grad-accum", "2"]}


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
    scaler = torch.amp.GradScaler("cpu")
    losses = []
    for step in range(args.steps):
        optimizers.set_learning_rate(opt, args, step)
        loss = ddp(*get_batch(args, env, step, 0))
        scaler.scale(loss).backward()
        opt.master_grads()  # fp32 gradients on the masters: what GradScaler unscales (it refuses fp16 ones)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        dist.all_reduce(mean := loss.detach().clone())
        losses.append(mean.item() / env.world_size)
    return {"losses": losses, "params": {n: p.detach().float().clone() for n, p in model.named_parameters()},
            "scale": scaler.get_scale()}


def with_an_inf(lesson, argv):
    """main(), with an inf put into rank INF_ON's gradient at step INF_AT where no other rank
    sees it: 01-03's first gradient after the all-reduce (as LossScaler.step begins), 04's and
    05's gradient shard after the reduce-scatter (as ShardOptimizer.step begins); everything the
    step could change copied just before it and just after it, and this rank's skipped steps."""
    from lessonkit import loss_scale, optimizers
    original, shard_step, seen = loss_scale.LossScaler.step, optimizers.ShardOptimizer.step, {}

    def state(opt):
        inner = getattr(opt, "shard_optimizer", opt)  # 04, 05: the step on my shards
        masters = inner.masters if hasattr(inner, "masters") else inner.master
        return {"params": [p.detach().clone() for p in opt.params], "masters": [m.detach().clone() for m in masters],
                "adamw": [{k: v.clone() for k, v in s.items()} for s in inner.optim.state.values()]}

    def step(self, opt):
        seen["step"] = self.steps
        if self.steps == INF_AT and dist.get_rank() == INF_ON and not hasattr(opt, "shard_optimizer"):
            opt.params[0].grad.view(-1)[0] = float("inf")
        before = state(opt) if self.steps == INF_AT else None
        original(self, opt)
        if before is not None:
            seen["before"], seen["after"] = before, state(opt)
        seen["skipped_steps"] = list(self.skipped_steps)

    def sharded_step(self, grad_shards, unscale=None):
        if seen["step"] == INF_AT and dist.get_rank() == INF_ON:
            grad_shards[0][0] = float("inf")  # my shard of the first flat buffer (05: bucket 0)
        return shard_step(self, grad_shards, unscale)

    loss_scale.LossScaler.step, optimizers.ShardOptimizer.step = step, sharded_step
    try:
        return {**run_lesson(lesson, argv), **seen}
    finally:
        loss_scale.LossScaler.step, optimizers.ShardOptimizer.step = original, shard_step


def suite(world):
    out = {"ddp": ddp_with_grad_scaler(ARGV)}
    for lesson in LESSONS + SHARDED:
        out[lesson] = run_lesson(lesson, ARGV + EXTRA.get(lesson, []))
        out[lesson, "inf"] = with_an_inf(lesson, INF_ARGV + EXTRA.get(lesson, []))
    out["accum"] = run_lesson("03_buckets", ARGV + ["--grad-accum", "2"])  # micro-steps summed in fp32
    out["ddp", "clip_256"] = ddp_with_grad_scaler(CLIP_UNREACHED)
    for lesson in SHARDED:
        out[lesson, "clip_256"] = run_lesson(lesson, CLIP_UNREACHED + BUCKETS)
    return out


results = launches(suite)


# ----------------------------------------------------------------------------- the tests
def test_fp16_matches_single_process_with_the_same_scaler():
    want = reference(ARGV)
    for rank, rank_out in enumerate(results(2)):
        for key in LESSONS + SHARDED + ("accum",):
            torch.testing.assert_close(rank_out[key]["losses"], want["losses"], **FP16_LOSS_TOL, msg=f"rank {rank} {key}")
            for name, p in rank_out[key]["params"].items():
                torch.testing.assert_close(p, want["params"][name], **FP16_PARAM_TOL, msg=f"rank {rank} {key} {name}")


def test_fp16_matches_ddp_with_torch_grad_scaler_bit_for_bit():
    for rank_out in results(2):
        for lesson in LESSONS:
            close(rank_out[lesson], rank_out["ddp"], dict(rtol=0, atol=0))
    for lesson in LESSONS:  # (the report is rank 0's)
        assert results(2)[0][lesson]["report"]["loss_scale"]["final_scale"] == results(2)[0]["ddp"]["scale"]


def test_fp16_sharded_matches_ddp_with_torch_grad_scaler_bit_for_bit():
    for rank_out in results(2):
        for lesson in SHARDED:
            close(rank_out[lesson, "clip_256"], rank_out["ddp", "clip_256"], dict(rtol=0, atol=0))
    for lesson in SHARDED:
        scale = results(2)[0][lesson, "clip_256"]["report"]["loss_scale"]["final_scale"]
        assert scale == results(2)[0]["ddp", "clip_256"]["scale"]


def test_an_inf_on_one_rank_skips_that_step_on_every_rank():
    for lesson in LESSONS + SHARDED:
        ranks = [rank_out[lesson, "inf"] for rank_out in results(2)]
        for rank_out in ranks:
            before, after = rank_out["before"], rank_out["after"]
            for what in ("params", "masters"):  # the skipped step changed nothing, on every rank
                for b, a in zip(before[what], after[what]):
                    assert torch.equal(b, a), (lesson, what)
            for b, a in zip(before["adamw"], after["adamw"]):  # AdamW's moments and step count
                assert b.keys() == a.keys() and all(torch.equal(b[k], a[k]) for k in b), lesson
            assert rank_out["skipped_steps"] == [INF_AT], lesson  # every rank's scaler skipped it
        scale = ranks[0]["report"]["loss_scale"]
        assert scale["skipped_steps"] == [INF_AT], lesson
        assert scale["final_scale"] == scale["init_scale"] / 2, lesson  # backed off once, not grown back
        close(ranks[1], ranks[0], dict(rtol=0, atol=0))  # the replicas still equal, after the step after it


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
        assert 0 <= ops["all_gather"]["bytes"] - 2 * psi <= 2 * n_buffers, lesson
        micro_steps = 2 if lesson == "05_zero2" else 1  # 05 reduce-scatters at every micro-step
        assert ops["reduce_scatter"]["bytes"] == micro_steps * ops["all_gather"]["bytes"], lesson
        assert (theory["params"], theory["grads"], theory["optimizer"]) == (2 * psi, grad_bytes * psi, 6 * psi)
        for mem in held(report):  # measured at rest: the paper's, plus padding (and AdamW's step counts)
            assert 0 <= mem["params"] - theory["params"] <= 2 * n_buffers, lesson
            assert 0 <= mem["grads"] - theory["grads"] <= 4 * n_buffers, lesson
            assert 0 <= mem["optimizer"] - theory["optimizer"] <= 12 * n_buffers + 4 * (n_tensors + n_buffers), lesson


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
