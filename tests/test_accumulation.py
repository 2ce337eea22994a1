"""One gradient-accumulation convention for every lesson (issue 25): in bf16, micro-steps'
gradients add up in fp32, never in bf16. 01-04 hand the collective the fp32 sum rounded once to
bf16 (ddp.FP32Accumulation); 05 and 06 add each micro-step's reduce-scattered slice into an fp32
gradient shard. Why: a bf16 running sum keeps 8 significant bits, so a micro-step whose gradient
is below half a unit in the last place of the sum so far vanishes from it whole.

The probe: K = 4 micro-steps, the first one's gradient about 2^9 times the others', each small
one below half an ulp of the first, together one ulp. bf16 accumulation then hands the optimizer
the first gradient alone, fp32 accumulation that plus one ulp: every element differs."""
import re

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from graded import ROOT
from harness import PEAKS, held, memory_theory, run_lesson, spawn
from lessons import build

CONVENTION = "In bf16, micro-steps' gradients add up in fp32, never in bf16"
FILES = {"01": "01_vanilla_dp", "02": "02_async_allreduce", "03": "03_buckets", "04": "04_zero1",
         "05": "05_zero2", "06": "06_zero3"}
K, STEPS = 4, 2
# 05-08 reducing once a step (--reduce-every step; 08: --all-reduce-every step): the whole gradient's
# fp32 sum rounded once to bf16 for the reduce-scatter (08: my shard's, for the all-reduce), as 01-04
ONCE = {"05": "reduce_every", "06": "reduce_every", "08": "all_reduce_every"}
SIZES = (5, 7, 3)  # the root's parameter, then two children (06's units); 15 elements, odd


class Scale(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.w = nn.Parameter(torch.randn(n))

    def forward(self, x):  # (rows, n): the gradient of w is the mean of the rows
        return (self.w * x).mean(0).sum()


class Probe(nn.Module):
    """forward(x, _) whose gradient is the mean of x's rows, over three parameters."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.w = nn.Parameter(torch.randn(SIZES[0]))
        self.a, self.b = Scale(SIZES[1]), Scale(SIZES[2])

    def forward(self, x, _):
        x0, x1, x2 = x.split(SIZES, dim=1)
        return (self.w * x0).mean(0).sum() + self.a(x1) + self.b(x2)


def micro_batches(step):
    """(K, 2, n) bf16: micro-step k's two rows (row r is rank r's at world 2; one rank takes
    both), such that micro-step k's gradient, the mean of its rows, is big at k = 0 and below
    half an ulp of that after, the small ones adding up to exactly one ulp. Every value, and
    every mean over one rank's rows or over both, is exact in bf16."""
    g = torch.Generator().manual_seed(100 + step)
    n = sum(SIZES)
    exponent = torch.randint(-3, 4, (n,), generator=g).float()
    sign = torch.randint(0, 2, (n,), generator=g).float() * 2 - 1
    big = sign * (1 + torch.randint(0, 16, (n,), generator=g).float() / 16) * 2 ** exponent
    ulp = 2 ** (exponent - 7)  # bf16: 7 stored significand bits
    small = {0: (3 / 8, 3 / 8, 2 / 8), 1: (2 / 8, 3 / 8, 3 / 8)}  # x ulp; each rank's sum is 1 ulp
    rows = torch.stack([torch.stack([big, big])] +
                       [torch.stack([sign * small[r][k] * ulp for r in (0, 1)]) for k in range(K - 1)])
    return (rows * K).to(torch.bfloat16)  # the trainers divide each micro-step's loss by K


def expected(step):
    """One process, micro-step by micro-step over the whole global batch: {name: (sum of the
    micro-steps' bf16 gradients in fp32, the same rounded once to bf16, added up in bf16)}."""
    model = Probe().to(torch.bfloat16)
    total, running = {}, {}
    for x in micro_batches(step):
        model.zero_grad()
        (model(x, None) / K).backward()
        for n, p in model.named_parameters():
            total[n] = total[n] + p.grad.float() if n in total else p.grad.float()
            running[n] = running[n] + p.grad if n in running else p.grad.clone()
    return {n: (total[n], total[n].to(torch.bfloat16), running[n]) for n in total}


# ----------------------------------------------------------------------------- what the optimizer is handed
def handed(lesson, trainer):
    """[(name, lo, hi, tensor)]: elements lo..hi of the named parameter's (flattened) gradient,
    in the tensor whose .grad the lesson's inner torch.optim optimizer steps; and that optimizer."""
    if lesson in ("01", "02", "03"):  # MixedPrecisionAdamW: fp32 masters, .grad = p.grad.float()
        names = {p: n for n, p in trainer.module.named_parameters()}
        return [(names[p], 0, p.numel(), m) for p, m in zip(trainer.opt.params, trainer.opt.master)], trainer.opt.optim
    if lesson in ("04", "05"):  # my shards' pieces (shard.ShardOptimizer): p's elements lo..hi
        names = {p: n for n, p in trainer.model.named_parameters()}
        shard_optimizer = trainer.opt.shard_optimizer
        return ([(names[p], lo, hi, piece) for pieces in shard_optimizer.pieces for p, _, lo, hi, piece in pieces],
                shard_optimizer.optim)
    z = trainer.model  # 06, 08: a unit's shard holds unit-flat elements start .. start + shard_numel
    names = {p: n for n, p in z.module.named_parameters()}
    out = []
    for u in z.units:
        for p, shard, offset, (lo, hi) in zip(u.params, u.sharded, u.offsets, u.ranges):
            if hi > lo:
                out.append((names[p], u.start + lo - offset, u.start + hi - offset, shard))
    return out, trainer.opt


def accumulate(lesson, **once):
    """In a spawned rank: STEPS steps of K micro-steps on the probe in bf16; per step, what the
    lesson's optimizer is handed, [(name, lo, hi, fp32 gradient)]. once: build's reduce_every or
    all_reduce_every (08: one rank per shard group, so that its replicas all-reduce)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if lesson in ("06", "08"):  # as 06's main(): fp32 shards, gathered and reduced in bf16
        from torch.distributed.fsdp import MixedPrecisionPolicy
        trainer = build(lesson, Probe(), mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16), shard_group=1, **once)
    else:
        trainer = build(lesson, Probe().to(torch.bfloat16), **once)
    pieces, optim = handed(lesson, trainer)
    steps, step = [], optim.step

    def record_then_step(*a, **kw):
        steps.append([(n, lo, hi, t.grad.float().clone()) for n, lo, hi, t in pieces if t.grad is not None])
        return step(*a, **kw)
    optim.step = record_then_step
    for s in range(STEPS):
        rows = micro_batches(s)[:, [rank] if world == 2 else [0, 1]]
        trainer.train_step([(x, None) for x in rows])
    return steps


# A bf16 GPT of odd size (zero_parity's: no world size divides Psi) with 2 micro-steps, for memory.
MEMORY_ARGV = ["--steps", "2", "--measure-step", "1", "--n-layer", "2", "--d-model", "33", "--n-head", "3",
               "--vocab-size", "65", "--seq-len", "16", "--global-batch", "8", "--log-every", "100",
               "--precision", "bf16", "--grad-accum", "2"]
PSI = 29_733


def suite(world):
    out = {lesson: accumulate(lesson) for lesson in FILES}
    out.update({f"{lesson}_once": accumulate(lesson, **{kw: "step"}) for lesson, kw in ONCE.items()})
    if world == 2:
        out["memory"] = {n: run_lesson(FILES[n], MEMORY_ARGV + PEAKS)["report"] for n in ("01", "02", "03", "04", "05")}
    return out


@pytest.fixture(scope="module")
def results():
    return {world: spawn(world, suite, world) for world in (1, 2)}


def check(recorded, exact, tol=None):
    """Every piece of every step equals (tol None: bit for bit) the expected gradient: the fp32
    sum for 05 and 06, rounded once to bf16 for 01-04. Returns how many elements of each
    parameter were handed over, per step."""
    assert len(recorded) == STEPS
    covered = []
    for step, pieces in enumerate(recorded):
        want = expected(step)
        covered.append({n: 0 for n in want})
        for name, lo, hi, got in pieces:
            total, rounded, _ = want[name]
            w = (total if exact else rounded.float()).flatten()[lo:hi]
            if tol is None:
                assert torch.equal(got, w), f"step {step} {name}[{lo}:{hi}]: {got} != {w}"
            else:
                torch.testing.assert_close(got, w, **tol, msg=f"step {step} {name}[{lo}:{hi}]")
            covered[-1][name] += hi - lo
    return covered


def whole(ranks_covered):
    """Over the ranks, every element of every parameter handed over once at every step (each
    rank all of them, for the replicated lessons: pass one rank's)."""
    numel = dict(zip(("w", "a.w", "b.w"), SIZES))
    for step in range(STEPS):
        assert {n: sum(c[step][n] for c in ranks_covered) for n in numel} == numel, step


# ----------------------------------------------------------------------------- the tests
def test_the_probe_loses_every_small_micro_step_in_a_bf16_sum():
    for step in range(STEPS):
        for name, (total, rounded, running) in expected(step).items():
            assert (rounded != running).all(), name  # one ulp apart, every element


@pytest.mark.parametrize("lesson", ["01", "02", "03", "04"])
def test_one_rank_hands_the_optimizer_the_fp32_sum_rounded_once(results, lesson):
    whole([check(results[1][0][lesson], exact=False)])


@pytest.mark.parametrize("lesson", ["05", "06"])
def test_one_rank_hands_the_optimizer_the_fp32_sum_of_its_shard(results, lesson):
    whole([check(results[1][0][lesson], exact=True)])


@pytest.mark.parametrize("lesson", list(FILES))
def test_two_ranks_match_a_process_that_accumulates_the_same_way(results, lesson):
    # The probe's micro-step gradients, per rank and averaged over both, are exact in bf16 and
    # their fp32 sums are bf16 values: the ranks' rounding, sums and divisions by 2 lose
    # nothing, so this is bit for bit (bf16 accumulation is an ulp, 2^-8 relative and more, away
    # on every element).
    covered = [check(recorded[lesson], exact=lesson in ("05", "06")) for recorded in results[2]]
    for ranks in [covered[:1], covered[1:]] if lesson in ("01", "02", "03") else [covered]:
        whole(ranks)


@pytest.mark.parametrize("lesson", ["01", "02", "03", "04"])
def test_the_fp32_sums_are_held_and_in_theory(results, lesson):
    # measured from the live tensors at rest (before optimizer.step()) and at their peak during
    # backward: the bf16 gradients (04: its flat buffer, padded to a multiple of N) and, beside
    # them, an fp32 sum of every parameter's micro-steps: 4 Psi more (K = 1 holds none: the
    # lessons' own memory tests)
    report = results[2][0]["memory"][lesson]
    assert report["n_params"] == PSI
    assert memory_theory(report)["grads"] == memory_theory(report)["peak_grads"] == (2 + 4) * PSI
    bf16_grads = 2 * (PSI + 1 if lesson == "04" else PSI)
    for m in held(report):
        assert m["grads"] == m["peak_grads"] == bf16_grads + 4 * PSI


def test_zero2_holds_fp32_gradient_slices_between_micro_steps_and_theory_says_so(results):
    # 05 keeps my slice of every bucket's gradient in fp32 from the second micro-step on: 4 Psi / N
    # at rest, not the 2 Psi / N of bf16 (plus padding: under N elements per bucket, one bucket here)
    report = results[2][0]["memory"]["05"]
    assert memory_theory(report)["grads"] == 4 * PSI / 2
    for m in held(report):
        assert 0 <= m["grads"] - 4 * PSI / 2 <= 4


@pytest.mark.parametrize("lesson", ["01", "02", "03", "04", "05", "06"])
def test_every_lesson_states_the_convention(lesson):
    with open(f"{ROOT}/{FILES[lesson]}.py", encoding="utf-8") as f:
        text = re.sub(r"\s+", " ", f.read())
    assert CONVENTION in text


@pytest.mark.parametrize("lesson", list(ONCE))
def test_reducing_once_hands_the_optimizer_the_fp32_sum_rounded_once(results, lesson):
    # 05, 06: every micro-step kept whole in fp32, rounded once for the one reduce-scatter; 08 at
    # 1 x 2: each rank's shard (all of it) summed in fp32 over the micro-steps, rounded once for
    # the one all-reduce. A bf16 running sum in any of them is an ulp off on every element.
    whole([check(results[1][0][f"{lesson}_once"], exact=False)])
    covered = [check(recorded[f"{lesson}_once"], exact=False) for recorded in results[2]]
    for ranks in [covered[:1], covered[1:]] if lesson == "08" else [covered]:
        whole(ranks)
