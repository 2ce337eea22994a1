"""The differential fuzzer: Hypothesis draws cases (a model, its routing, a world size and the
training settings); each lesson 01-08 trains the case beside its PyTorch counterpart and
single-process training on the whole batch, all driven by the same loop; every replica must be
identical and every lesson must match both within tolerances.FUZZ_*.

    make fuzz                                   # FUZZ_EXAMPLES cases (default 300), every failure listed
    FUZZ_SEED=7 FUZZ_EXAMPLES=40 make fuzz      # another (reproducible) draw
    FUZZ_SHRINK=1 make fuzz                     # stop at the first failure, Hypothesis shrinks it
    python -m tests.fuzz --case '<json>'        # one case, as a failure prints it
    python -m tests.fuzz --lessons 04,05        # only these lessons (their counterparts still run)

Counterparts: DDP(find_unused_parameters=True) for 01-03, DDP + ZeroRedundancyOptimizer for 04
(in bf16 FSDP2 without resharding instead: ZeroRedundancyOptimizer keeps no fp32 master weights),
FSDP2 fully_shard without resharding (the whole model one group) for 05 and with resharding
(each block a unit) for 06 and 07 (offload changes where it computes, not what), where FSDP2 can
run the case (fsdp2_can_run). fp16 (the lessons that take it, FP16) adds a loss scaler to every
run (LOSS_SCALES): the lessons' LossScaler; torch.amp.GradScaler for DDP, which is then 04's
counterpart too, over the lessons' MixedPrecisionAdamW (GradScaler unscales fp32 gradients only,
and PyTorch has no optimizer with fp32 masters for fp16 parameters: tests/test_fp16.py); FSDP2's
ShardedGradScaler; GradScaler for one process. Every run uses find_unused; FSDP2 reduce-scatters
zeros for a parameter its rank did not reach, and the loop drops the gradient of one no rank reached (the
reference knows which), as DDP's None: so every run has one semantics, the design's. Every
lesson runs under tests/stream_semantics.py, the CPU stand-in for NCCL's stream semantics: an
output read before its wait(), or an input changed before it, fails the run, and ranks that
issued different collectives, or the same in another order over all their process groups, are
a finding ("collectives differ"). A case may checkpoint (case["resume"] = k): after k steps each
lesson saves, is built again from other weights and loads (lessonkit/checkpoint.py, as --resume),
which must bring back every tensor it saved bit for bit ("resumed"), and trains on.

Cost: starting ranks is most of it, so one launch of `world` ranks runs several cases
(FUZZ_BATCH, default 4), each case's reference and runs inside it. Each run gets a process
group of its own with a short timeout (FUZZ_COLLECTIVE_TIMEOUT, 20 s), so a lesson that raises
or mismatches its collectives fails that run only; one that gloo aborts ends the launch, and a
new one goes on without that run.
"""
import contextlib
import datetime
import json
import math
import os
import sys
import time
import traceback

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
for _path in (ROOT, TESTS):  # as conftest.py: python -m tests.fuzz runs outside pytest
    if _path not in sys.path:
        sys.path.insert(0, _path)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from hypothesis import HealthCheck, Phase, given, settings, strategies as st  # noqa: E402
import hypothesis  # noqa: E402

from scripts.perf import ring_collectives  # noqa: E402
from scripts.runs import FP16_LESSONS, Parser  # noqa: E402
from lessonkit import checkpoint, optimizers, reshard  # noqa: E402
from lessonkit.loss_scale import LossScaler  # noqa: E402
from stream_semantics import StreamSemantics, first_difference  # noqa: E402
from fuzz_models import block_slot, global_batch, make_model, micro_batches, routing_slots  # noqa: E402
import harness  # noqa: E402
from lessons import MUON, Scaled, adamw, build, evaluate, fsdp2_reduces_unused, handles, replicated_optimizer  # noqa: E402
from scripts.learn.muon_gaps import fp32_newton_schulz  # noqa: E402
from tolerances import (FUZZ_BF16_ADAM_EPS, FUZZ_BF16_FLOOR_ULPS, FUZZ_BF16_LOSS_ATOL,  # noqa: E402
                        FUZZ_BF16_PYTORCH_SPREAD, FUZZ_BF16_UPDATE_RTOL, FUZZ_FP16_ADAM_EPS,
                        FUZZ_FP16_LOSS_ATOL, FUZZ_FP16_UPDATE_RTOL, FUZZ_TOL)

LESSONS = ("01", "02", "03", "04", "05", "06", "07", "08", "09")
# the lessons an fp16 case runs: those that take --precision fp16 (scripts/runs.FP16_LESSONS: all;
# their counterparts scale with torch.amp.GradScaler, FSDP2's with ShardedGradScaler), and 09
FP16 = tuple(name[:2] for name in FP16_LESSONS) + ("09",)
LOW = {"bf16": torch.bfloat16, "fp16": torch.float16}  # the 2-byte precisions: parameters, gradients
# per 2-byte precision: (its significant bits, tolerances.FUZZ_*'s update and loss bounds, AdamW's eps)
BOUNDS = {"bf16": (8, FUZZ_BF16_UPDATE_RTOL, FUZZ_BF16_LOSS_ATOL, FUZZ_BF16_ADAM_EPS),
          "fp16": (11, FUZZ_FP16_UPDATE_RTOL, FUZZ_FP16_LOSS_ATOL, FUZZ_FP16_ADAM_EPS)}
FSDP2 = ("fsdp2", "fsdp2_noreshard")
OPTIMIZERS = {"adamw": (torch.optim.AdamW, adamw(1e-2)),
              "sgd": (torch.optim.SGD, dict(lr=0.5)),
              "momentum": (torch.optim.SGD, dict(lr=0.5, momentum=0.9))}
# Muon (PyTorch 2.9 and later) as 09 runs it: on 09's muon_groups' matrices, AdamW (the case's
# "adamw") on the rest, at AdamW's step size. Only 09 runs it (04 and 05 refuse it; 01-03's and
# 06-08's optimizers step every parameter with one class); in the other cases 09 runs the case's
# optimizer on every parameter, by whole parameters (or --zero3 1's units). Its Newton-Schulz runs in fp32 in such a
# case, in every run (muon_gaps.fp32_newton_schulz): torch's bf16 iteration moves the update where
# a gradient element rounds to another bf16 value than one process's (tests/test_09_muon.py), and
# the fuzzer's bounds are fp32's.
if MUON is not None:
    OPTIMIZERS["muon"] = (MUON, dict(lr=1e-2, adjust_lr_fn="match_rms_adamw"))


def optimizer(case):
    """(optimizer_class, optimizer_kwargs) of a case; in bf16 and fp16 AdamW's eps is
    FUZZ_BF16_ADAM_EPS, FUZZ_FP16_ADAM_EPS (tolerances.py says why)."""
    opt_class, kwargs = OPTIMIZERS[case["optimizer"]]
    if case["precision"] in BOUNDS and opt_class is torch.optim.AdamW:
        kwargs = {**kwargs, "eps": BOUNDS[case["precision"]][3]}
    return opt_class, kwargs


def loss_scaler(name, case):
    """fp16: the run's loss scaler, with the case's GradScaler arguments: the lessons' own
    (lessonkit's LossScaler), FSDP2's ShardedGradScaler (which all-reduces its found-inf flag, as
    the lessons' does), torch.amp.GradScaler for DDP and for the single process: PyTorch's, not the
    lessons', so that a fault of LossScaler's (a scale not backed off, a step not skipped) cannot
    hide by being the reference's too. None otherwise."""
    if case["precision"] != "fp16":
        return None
    if name in LESSONS:
        return LossScaler("cpu", **case["loss_scale"])
    if name in FSDP2:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
        return ShardedGradScaler("cpu", **case["loss_scale"])
    return torch.amp.GradScaler("cpu", **case["loss_scale"])


def adamw_kwargs(case):
    """AdamW's arguments in the case: beside Muon, its optimizer's otherwise."""
    return optimizer({**case, "optimizer": "adamw"})[1]


def counterpart(lesson, case):
    if lesson == "09":  # with Muon, none (one process only); otherwise 04's (a ZeRO-1, by whole parameters) or 06's
        if case["optimizer"] == "muon":
            return None
        lesson = "06" if case.get("zero3") else "04"
    if lesson in ("01", "02", "03") or lesson == "04" and case["precision"] == "fp16":
        return "ddp"  # (04 in fp16: DDP and GradScaler, as tests/test_fp16.py; SKIPS says why)
    if lesson == "04":  # ZeroRedundancyOptimizer steps bf16 (fp16) parameters in 2 bytes (no master weights)
        return "zero_redundancy" if case["precision"] == "fp32" else "fsdp2_noreshard"
    # (07: FSDP2's results are its offload's; 08: FSDP2's are its HSDP's, the same sums regrouped)
    return "fsdp2_noreshard" if lesson == "05" else "fsdp2"


# ----------------------------------------------------------------------------- what Hypothesis draws
# Small odd and prime sizes: no world size divides Ψ or a parameter, and one element or row can
# be a whole shard or bucket. The first of each list is where Hypothesis shrinks to.
VOCABS, WIDTHS, HIDDEN, EXPERT = (5, 7, 11, 13), (3, 1, 2, 5, 7), (3, 0, 1, 5, 7, 11), (3, 1, 2, 5)
# bucket caps (MB) from one element per bucket to one bucket for the whole model (~1-20 KB)
BUCKET_MB = (25.0, 1e-6, 4e-5, 4e-4, 4e-3)
# fp16's loss scalers, as GradScaler's arguments: its defaults (2^16, halved after an overflow,
# doubled after 2000 clean steps); 2^8, doubled after every clean step (here no gradient comes
# near fp16's 65504: every run steps every step, and the scale grows); 2^40, which overflows in
# every run on every rank (every logit's gradient here is above 2^-24, so x 2^40 beyond 65504),
# backing off to 2^8: the first step skipped everywhere (parameters, moments and AdamW's step
# count unchanged), then trained.
LOSS_SCALES = ({}, {"init_scale": 2.0 ** 8, "growth_interval": 1},
               {"init_scale": 2.0 ** 40, "backoff_factor": 2.0 ** -32})
SKIPS_AT = {2.0 ** 8: [], 2.0 ** 40: [0]}  # by the initial scale, the steps every run must skip (else unknown)
# SKIPS. Under GradScaler's defaults these small models' gradients (O(1), few tokens, x 2^16) sit
# at fp16's overflow, and where a gradient overflows depends on the recipe, each correct: a rank's
# gradient (the mean of fewer tokens) overflows where the whole batch's does not; 01-04 (and DDP)
# round their fp32 sum of micro-steps into the fp16 gradient before dividing by N, 05 (and FSDP2)
# reduce-scatter each micro-step and sum in fp32. (Measured: 13 of 38 such cases had runs skip
# different steps, each lesson the same as its counterpart.) So in fp16 a run is compared with
# one process, and a lesson with its counterpart, only where the two skipped the same steps, and a
# lesson that skipped other steps than one process fails where its counterpart skipped those of one
# process (where it ran: FSDP2 cannot run every case for 06-08; where it skipped others, the case
# is at the edge for every recipe); its ranks must skip the same (replicas differ). With 2^8 and 2^40 every
# run must skip what SKIPS_AT says, one process and PyTorch's included. LATER: 05-08 over several
# micro-steps hold each micro-step's gradient in fp16 at 1/accum of the step's (the loss divided
# by accum) and sum them in fp32, so they overflow later than a recipe that holds the step's
# gradient in fp16 (one process; 01-04 and DDP, which round their sum into it; FSDP2, whose fp16
# reduce-scatter pre-divides by only ~sqrt(N)): they may skip fewer of one process's steps, and
# step there with a finite gradient, and from then on follow other weights, which may overflow at
# a step one process did not skip (skipped_later). (Seed 20261131 drew one: 4 ranks, 3 micro-steps,
# one process and FSDP2 skipped [1], 05-08 none; seed 20261212 one at 4 ranks, 2 micro-steps: one
# process and FSDP2 skipped [1], 05 [2].)
LATER = ("05", "06", "07", "08")


def block_spec(hidden, frozen, routed, experts):
    # A block may hold no parameter at all (hidden 0, no expert): a unit with nothing to shard,
    # which FSDP2 and 06 leave as a plain module. frozen "first": the dense layer's first
    # Linear, so there must be one.
    frozen = "none" if frozen == "first" and not hidden else frozen
    return {"hidden": hidden, "frozen": frozen, "routed": routed, "experts": experts}


blocks = st.builds(block_spec, st.sampled_from(HIDDEN), st.sampled_from(("none", "first", "all")), st.booleans(),
                   st.lists(st.sampled_from(EXPERT), max_size=2))


@st.composite
def specs(draw):
    tied = draw(st.booleans())
    return {"vocab": draw(st.sampled_from(VOCABS)), "d": draw(st.sampled_from(WIDTHS)), "tied": tied,
            "frozen_emb": not tied and draw(st.booleans()),  # a tied embedding is the head: it trains
            "root_expert": draw(st.sampled_from((0, 3, 2))), "blocks": draw(st.lists(blocks, min_size=1, max_size=3)),
            "unused": draw(st.sampled_from((0, 3))), "run_unused": draw(st.booleans())}


def route_bits(chunks):
    """One routed module in one step: a bitmask over the step's chunks (rank r's micro-step m is
    chunk r * accum + m): used by all of them, by none, or by some."""
    full = (1 << chunks) - 1
    kinds = [st.just(full), st.just(0)] + ([st.integers(1, full - 1)] if chunks > 1 else [])
    return st.one_of(kinds)


@st.composite
def cases(draw, world=None, fp16=True):
    world = world or draw(st.integers(1, 4))
    spec, accum, steps = draw(specs()), draw(st.integers(1, 3)), draw(st.integers(1, 3))
    slots = len(routing_slots(spec))
    routes = [[draw(route_bits(world * accum)) for _ in range(slots)] for _ in range(steps)]
    case = {"seed": draw(st.integers(0, 2 ** 16)), "world": world, "accum": accum, "steps": steps,
            "rows": draw(st.integers(1, 3)), "seq": draw(st.integers(1, 4)),
            "precision": draw(st.sampled_from(("fp32", "bf16"))), "optimizer": draw(st.sampled_from(tuple(OPTIMIZERS))),
            "clip": draw(st.sampled_from((0.0, 0.05, 1.0))),  # 0.05 acts at every step, 1.0 at some
            "weight_decay": draw(st.sampled_from((0.0, 0.1))), "bucket_mb": draw(st.sampled_from(BUCKET_MB)),
            "model": spec, "routes": routes,
            # the lessons' collectives: torch's, or lesson 00's ring (--collectives ring)
            "collectives": draw(st.sampled_from(("torch", "ring"))),
            # 07's placement: every unit cut evenly, or each whole on one rank (--layout uneven;
            # broadcasts and reduces, which the ring does not carry: torch's collectives only)
            "layout": draw(st.sampled_from(("even", "uneven")))}
    # --activation-checkpointing block: every block recomputed in backward (drawn last: the
    # cases drawn before it stay as they were)
    case["model"]["checkpoint"] = draw(st.booleans())
    # 08's grid: G ranks per shard group, a divisor of the world size (on torch's collectives or
    # the ring, which carries 08's sub-groups too)
    case["shard_group"] = draw(st.sampled_from([g for g in range(1, world + 1) if world % g == 0]))
    # fp16 (drawn last, as above): half of the 2-byte cases (fp16=False: none, when no lesson
    # asked for takes fp16), with a loss scaler's arguments (LOSS_SCALES)
    if fp16 and case["precision"] == "bf16" and draw(st.booleans()):
        case["precision"], case["loss_scale"] = "fp16", draw(st.sampled_from(LOSS_SCALES))
    # 06-08's units in chunks (drawn last, as above): every `chunk` consecutive blocks one unit,
    # gathered and reduced together (07's --chunk-mb), against FSDP2's fully_shard([...]) of them
    case["chunk"] = draw(st.sampled_from((1, 2)))
    # a checkpoint (drawn last, as above): after k steps the lessons save, start again from other
    # weights, load it and go on at step k (resumed); 0: none. Every optimizer's state: AdamW's moments and
    # step, SGD's momentum buffers (lessonkit/checkpoint.py; once AdamW's only: SGD's momentum ended in KeyError)
    if steps > 1:
        case["resume"] = draw(st.integers(0, steps - 1))
    # what a user's model and loop bring (drawn last, as above): a checkpoint placed around each
    # block call or around two; the blocks called in another order, or one twice; one block under
    # no_grad in some steps; an evaluation forward after each step; prefetch off; 08 built with
    # its defaults (no grid). A forward that calls the units out of the order listed is learned
    # from every rank's calls, which must then be the same (as FSDP2's in every forward): no block
    # routed whole there, none in a chunk; a checkpoint around several units, only where every
    # rank runs the same modules.
    n = len(spec["blocks"])
    if draw(st.booleans()):
        case["model"]["checkpoint"] = draw(st.sampled_from(("around", "around_pairs")))
    calls = draw(st.one_of(st.just(list(range(n))), st.permutations(range(n)),
                           st.lists(st.integers(0, n - 1), min_size=1, max_size=n + 2)))
    if calls != list(range(n)) or case["model"]["checkpoint"] == "around_pairs":
        case["model"]["calls"], case["chunk"] = calls, 1
        for b in spec["blocks"]:
            b["routed"] = False
        case["routes"] = [[draw(route_bits(world * accum)) for _ in range(len(routing_slots(spec)))]
                          for _ in range(steps)]
    case["model"]["no_grad_block"] = draw(st.one_of(st.none(), st.integers(0, n - 1)))
    case["no_grad_steps"] = [draw(st.booleans()) for _ in range(steps)]
    if case["model"]["checkpoint"] == "around_pairs" and partly_used(case):
        # a unit recomputed before its own backward is gathered when backward first unpacks a
        # tensor its checkpoint saved: ranks whose data ran other modules there gather it at
        # other times (FSDP2 then trains to other losses than one process: seed 20261129 drew one)
        case["model"]["checkpoint"] = "around"
    case["eval"], case["prefetch"], case["defaults"] = draw(st.booleans()), draw(st.booleans()), draw(st.booleans())
    # a checkpoint another lesson wrote (drawn last, as above): at the resume step every lesson that
    # runs after `resume_from` loads what that one saved there (lessonkit/checkpoint.py: any lesson
    # resumes any lesson's), and must hold that state bit for bit, whatever layout wrote it
    if case.get("resume"):
        case["resume_from"] = draw(st.sampled_from(LESSONS))
    # a collective once a step, not per micro-step (drawn last, as above): 05-08's --reduce-every
    # step (no_sync, set_requires_gradient_sync) and 08's --all-reduce-every step
    # (set_requires_all_reduce), their counterparts run with the same settings
    if accum > 1:
        case["reduce_every"], case["all_reduce_every"] = (draw(st.sampled_from(("micro", "step"))) for _ in "ra")
    # 09's layout (drawn last, as above): 04's flat buffer owner by owner, or --zero3 1's (06's units,
    # each laid out owner by owner), which trains as 06 does: beside FSDP2, in fp32 shards
    case["zero3"] = draw(st.booleans())
    return case
# Not drawn, as no lesson or counterpart runs it: ranks starting from different weights (FSDP2
# shards each rank's own weights; tests/toy.py covers the lessons), a MixedPrecisionPolicy's
# output_dtype (06 refuses it).


def unit_passes(case, step, chunk):
    """Per block call (an FSDP2/06 unit's), in one chunk of a step: (its forward runs, its input
    carries a gradient, its output does). A routed block no row of the chunk uses does not run
    (with run_unused: runs, and backward never reaches its dropped output); a block under no_grad
    runs, and backward never reaches it. The input carries a gradient after a trainable
    embedding, or a routed module or block that trained; the output also when the block uses a
    trainable parameter itself."""
    spec, bits = case["model"], case["routes"][step]

    def used(slot):
        return (bits[slot] >> chunk) & 1 == 1
    grad = spec["tied"] or not spec["frozen_emb"]
    if spec["root_expert"]:
        grad = grad or used(0)
    no_grad = spec.get("no_grad_block") if case.get("no_grad_steps", [False] * (step + 1))[step] else None
    out = []
    for i in spec.get("calls") or range(len(spec["blocks"])):
        b, slot = spec["blocks"][i], block_slot(spec, i)
        runs = True
        if b["routed"]:
            runs, slot = used(slot), slot + 1
        experts = [used(slot + e) for e in range(len(b["experts"]))]
        if not runs or i == no_grad:
            out.append((runs or spec["run_unused"], False, False))
            continue
        trains = b["frozen"] != "all" and (b["hidden"] > 0 or any(experts))  # (a dense's second Linear trains)
        grad_out = grad or trains
        out.append((True, grad, grad_out))
        grad = grad_out
    return out


def fsdp2_can_run(case):
    """Whether FSDP2 (with units) can train the case. It gathers a unit in the unit's forward and
    again when backward reaches its output; it reduce-scatters the unit's gradient when backward
    reaches its input, or, if the input carries no gradient, in a callback at the end of
    backward, in another order. A unit for which any of these differs between ranks in a
    micro-step (unit_passes) leaves the ranks' collectives mismatched, and gloo aborts: PyTorch
    cannot run the case with units. (06 then answers to one process only.)"""
    return passes_agree(case) and fsdp2_chunks_ok(case)


def passes_agree(case):
    """Whether every rank's forward and backward reach the same units in every micro-step."""
    world, accum = case["world"], case["accum"]
    return all(len({tuple(unit_passes(case, step, r * accum + m)) for r in range(world)}) == 1
               for step in range(case["steps"]) for m in range(accum))


def fsdp2_chunks_ok(case):
    """With units in chunks: FSDP2 gathers a group (fully_shard([...])) for backward when backward
    reaches the output of the group's last module to run forward. Where that output was dropped
    (a routed block run for nothing) while backward goes through an earlier block of the group,
    FSDP2 runs that block's backward on freed parameters ("setStorage: ... out of bounds for
    storage of size 0"): it cannot run the case. (06-08 hook every module of a chunk.)"""
    size = case.get("chunk", 1)
    for step in range(case["steps"]):
        for chunk in range(case["world"] * case["accum"]):
            passes = unit_passes(case, step, chunk)
            for ran in ([p for p in passes[i:i + size] if p[0]] for i in range(0, len(passes), size)):
                if ran and not ran[-1][2] and any(p[2] for p in ran[:-1]):
                    return False
    return True


def used_alike(case):
    """Whether every routed module is used in every micro-step of every rank of a step, or in
    none: all that an FSDP2 without set_reduce_scatter_unused_params (torch 2.11's) can run."""
    every = (1 << (case["world"] * case["accum"])) - 1
    return all(bits in (0, every) for step in case["routes"] for bits in step)


def partly_used(case):
    """Whether some routed module is used on some ranks and not others in some step."""
    world, accum = case["world"], case["accum"]
    rank_bits = [((1 << accum) - 1) << (r * accum) for r in range(world)]
    return any(len({bool(bits & rb) for rb in rank_bits}) > 1 for step in case["routes"] for bits in step)


def runs_of(case, lessons=LESSONS):
    """The runs a case needs: the lessons and their counterparts (FSDP2 where it can run; 06
    claims more: a unit some ranks skip is gathered and reduce-scattered there all the same).
    fp16: the lessons that take it (FP16) only."""
    lessons = [x for x in lessons if case["precision"] != "fp16" or x in FP16]
    # Muon: 09 alone (with AdamW beside it); otherwise 09 too, the case's optimizer on all (SGD sees a wrong scale)
    lessons = [x for x in lessons if x == "09" or case["optimizer"] != "muon"]
    names = [counterpart(x, case) for x in lessons if counterpart(x, case)] + list(lessons)
    return [x for x in dict.fromkeys(names) if (x != "fsdp2" or fsdp2_can_run(case))
            and (x not in FSDP2 or fsdp2_reduces_unused() or used_alike(case))]


# ----------------------------------------------------------------------------- in a spawned rank
def reference(case):
    """Single process, the whole batch each step, the same model, optimizer and clipping: the
    answer every lesson must give. Also which trainable parameters no row reached, per step.
    fp16: with torch.amp.GradScaler (loss_scaler says why not the lessons' LossScaler)."""
    model = make_model(case["model"], case["seed"], dtype=LOW.get(case["precision"]))  # fp32 masters, as 01-05
    opt_class, opt_kwargs = optimizer(case)
    groups = (harness.load_lesson("09_muon").muon_groups if case["optimizer"] == "muon" else optimizers.decay_groups)(
        model, case["weight_decay"])
    opt = replicated_optimizer(groups, case["clip"], opt_class, opt_kwargs, adamw_kwargs(case))
    scaler = Scaled(loss_scaler("reference", case))  # (fp32, bf16: the identity)
    losses, unused = [], []
    for step in range(case["steps"]):
        loss = model(*global_batch(case, step))
        scaler.scale(loss).backward()
        unused.append({n for n, p in model.named_parameters() if p.requires_grad and p.grad is None})
        scaler.step(opt)
        # every gradient dropped: a parameter no row reaches next step keeps None, skipped as in DDP.
        # By opt.zero_grad(), not p.grad = None: after a step GradScaler skipped (opt.step() never
        # ran) MixedPrecisionAdamW still holds its fp32 casts of them, which only zero_grad drops
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, **held_weights(model, opt, model.named_parameters()), "unused": unused,
            "skipped": scaler.skipped}


def maker(case, name):
    """make(seed, loss scaler) -> (model, trainer): `name` (a lesson or a counterpart) built through
    tests/lessons.py for `case`, around its model with the weights `seed` gives."""
    from torch.distributed.fsdp import MixedPrecisionPolicy
    low = LOW.get(case["precision"])  # bf16, fp16; None in fp32
    sharded_fp32 = name in FSDP2 or name in ("06", "07", "08") or name == "09" and case.get("zero3")  # fp32 shards,
    # computing in 2 bytes by a policy
    opt_class, opt_kwargs = optimizer(case)
    kw = dict(grad_clip=case["clip"], weight_decay=case["weight_decay"], bucket_mb=case["bucket_mb"],
              find_unused=True, optimizer_class=opt_class, optimizer_kwargs=opt_kwargs, adamw_kwargs=adamw_kwargs(case),
              layout=case.get("layout", "even") if case.get("collectives", "torch") == "torch" else "even",
              shard_group=None if case.get("defaults") else case.get("shard_group"), chunk=case.get("chunk", 1),
              prefetch=case.get("prefetch", True), defaults=case.get("defaults", False),
              reduce_every=case.get("reduce_every", "micro"), all_reduce_every=case.get("all_reduce_every", "micro"),
              zero3=case.get("zero3", False))
    if sharded_fp32 and low is not None:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=low)  # as 06's main()

    def make(seed, scaler):
        module = make_model(case["model"], seed, dtype=None if sharded_fp32 else low)
        return module, build(name, module, **{**kw, "loss_scaler": scaler})
    return make


def train(case, name, unused, checkpoint_dir):
    """In a process group: train `case` with `name` (a lesson or a counterpart); losses (the
    global mean per step) and the full parameters. A lesson resumes from a checkpoint in
    checkpoint_dir after step case["resume"] (resumed)."""
    # --collectives ring for the lessons (not the counterparts: FSDP2 calls dist's functions too)
    ring_collectives.use(case.get("collectives", "torch") if name in LESSONS else "torch")
    # the lessons under NCCL's stream semantics (tests/stream_semantics.py: an output is NaN until
    # its wait(), its inputs untouched until then), every call listed: findings holds every rank
    # to the same collectives in the same order, whatever its data did
    semantics = StreamSemantics() if name in LESSONS else None
    with semantics or contextlib.nullcontext():
        result = train_steps(case, name, maker(case, name), unused, checkpoint_dir)
    ring_collectives.use("torch")
    return {**result, "order": semantics.order} if semantics else result


def train_steps(case, name, make, unused, checkpoint_dir):
    """The case's steps with the trainer make() builds (train): losses, parameters, the steps
    skipped, and for a resumed lesson why the state it loaded is not the state it saved (or None)."""
    rank, low = dist.get_rank(), LOW.get(case["precision"])
    sharded_fp32 = name in FSDP2 or name in ("06", "07", "08") or name == "09" and case.get("zero3")
    model, trainer = make(case["seed"], loss_scaler(name, case))
    resumed_why = {}
    step_no = [0]
    if name in FSDP2:  # a parameter no rank reached: FSDP2 gave it zeros, DDP leaves it None
        step = trainer.opt.step

        def drop_unreached_then_step(*a, **k):
            for n, p in model.named_parameters():
                if n in unused[step_no[0]]:
                    p.grad = None
            return step(*a, **k)
        trainer.opt.step = drop_unreached_then_step
    losses = []
    for s in range(case["steps"]):
        step_no[0] = s
        if s and s == case.get("resume") and name in LESSONS:
            model, trainer, resumed_why["resumed"] = resumed(case, name, make, trainer, checkpoint_dir, s)
        loss = torch.tensor(trainer.train_step(micro_batches(case, s, rank)))
        if case.get("eval"):  # a forward under no_grad between steps: it changes nothing
            evaluate(trainer, *micro_batches(case, s, rank)[0])
        dist.all_reduce(loss)
        losses.append(loss.item() / case["world"])
    skipped = trainer.scaler.skipped  # fp16: the steps its loss scaler skipped
    if name in LESSONS[:3] + ("ddp",):  # the optimizer's fp32 master weights, as the reference's
        return {"losses": losses, **held_weights(model, trainer.opt, trainer.full_parameters().items()),
                "skipped": skipped, **resumed_why}
    masters = set() if low is not None and not sharded_fp32 else None  # 04, 05: 2-byte parameters only
    return {"losses": losses, "params": trainer.full_parameters(), "masters": masters, "skipped": skipped,
            **resumed_why}


def resumed(case, name, make, trainer, checkpoint_dir, step):
    """A lesson's checkpoint after `step` steps, loaded as --resume does into the run built anew
    from other weights: (model, trainer, why what it holds now is not what it saved, or None).
    Every tensor checkpoint.py sees must come back bit for bit, the loss scaler's state too; the
    steps after it are then held to one process's like any run's."""
    path = os.path.join(checkpoint_dir, f"step_{step:06d}")
    saved = handles(name, trainer)
    before = held_state(*saved)
    scaler = loss_scaler(name, case)  # (fp16; else None) its state saved in meta.json, as by Checkpointer
    checkpoint.save(path, step, *saved, {"strategy": name, "loss_scale": scaler and trainer.scaler.scaler.state_dict(),
                                         "skipped": list(trainer.scaler.skipped)})  # (fp16: what led to this state)
    dist.barrier()  # (rank 0 writes meta.json and COMPLETE after the others have returned from save)
    # another lesson's checkpoint of this step, where it ran before this one (case["resume_from"])
    other = os.path.join(checkpoint_dir[:-len(name)] + case.get("resume_from", name), f"step_{step:06d}")
    source = other if os.path.exists(os.path.join(other, "COMPLETE")) else path
    with open(os.path.join(source, "meta.json")) as f:
        meta = json.load(f)
    if scaler is not None:
        scaler.load_state_dict(meta["loss_scale"])
    model, new = make(case["seed"] + 1, scaler)
    # the loop's record: from another lesson's checkpoint, that lesson's steps skipped before it (fp16:
    # its history is the state's; a run that skipped other steps there is held to what it loaded)
    new.scaler.skipped, new.scaler.steps = list(meta.get("skipped", trainer.scaler.skipped)), trainer.scaler.steps
    loaded = handles(name, new)
    checkpoint.load(source, *loaded)
    if source != path:  # what it holds now, saved again, is the state the other lesson saved
        checkpoint.save(path + "_loaded", step, *loaded, {"strategy": name})
        dist.barrier()  # (as above)
        a, b = (reshard.whole(*checkpoint.read(p)) for p in (source, path + "_loaded"))
        differ = sorted(k for k in a.keys() | b.keys() if k not in a or k not in b or not torch.equal(a[k], b[k]))
        return model, new, (f"{differ[0]} of {meta['strategy']}'s checkpoint is not what it loaded" if differ else None)
    after = held_state(*loaded)
    differ = [i for i, (a, b) in enumerate(zip(before, after)) if a[0] != b[0] or not torch.equal(a[1], b[1])]
    why = (f"{len(after)} tensors after loading, {len(before)} saved" if len(before) != len(after) else
           f"{after[differ[0]][0]} is not what was saved" if differ else None)
    return model, new, why


def held_state(module, holder):
    """[(what, tensor)]: every tensor a strategy shows checkpoint.py (its shards of parameters and
    master weights, its optimizer's state of each), copied, in the shards' order."""
    out = []
    for i, s in enumerate(reshard.shards(module, holder)):
        out += [(f"shard {i} {kind}", t.detach().clone()) for kind, (_, t) in s.tensors.items()]
        master = reshard.master_of(s)
        state = s.optim.state.get(master[1], {}) if master is not None else {}
        out += [(f"shard {i} {kind}", v.detach().clone()) for kind, v in sorted(state.items()) if torch.is_tensor(v)]
    return out


def held_weights(model, opt, named):
    """{"params": {name: fp32 tensor}, "masters": the names whose values are fp32 master weights,
    None: all are}. A MixedPrecisionAdamW (the reference's, 01-03's, DDP's) holds bf16 (fp16)
    parameters and fp32 masters of the trainable ones: those are what it trains. 06 and FSDP2
    hold fp32 shards (all masters); 04 and 05 show only their 2-byte parameters (no masters)."""
    params = {n: p.detach().float().clone() for n, p in named}
    if not getattr(opt, "mixed", False):
        return {"params": params, "masters": None}
    name_of = {p: n for n, p in model.named_parameters()}
    masters = {name_of[p]: m.detach().float().clone() for p, m in zip(opt.params, opt.master)}
    return {"params": {**params, **masters}, "masters": set(masters)}


@contextlib.contextmanager
def process_group(store, tag, timeout_s):
    """A default process group of its own for one run, over the launch's store: a run that fails
    (or leaves a collective unmatched, which the timeout turns into an error) leaves nothing
    behind for the next."""
    dist.init_process_group("gloo", store=dist.PrefixStore(tag, store), rank=int(os.environ["RANK"]),
                            world_size=int(os.environ["WORLD_SIZE"]),
                            timeout=datetime.timedelta(seconds=timeout_s))
    try:
        yield
    finally:
        dist.destroy_process_group()


def run_cases(rank, world, port, cases, lessons, timeout_s, out_dir, skip):
    """In each launched rank: every case's reference and runs (but skip[c], which crashed a
    launch before), each case's results saved as it ends (case{c}_rank{r}.pt: {run: {"losses",
    "params"} or {"error"}, "reference", "seconds"}), and the run under way in rank{r}.at, so a
    rank that dies names what killed it."""
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False,
                          timeout=datetime.timedelta(seconds=timeout_s))
    for c, case in enumerate(cases):
        start = time.monotonic()
        with fp32_newton_schulz() if case["optimizer"] == "muon" else contextlib.nullcontext():  # (OPTIMIZERS)
            ref = reference(case)
            results = {"reference": ref}
            for name in [x for x in runs_of(case, lessons) if x not in skip.get(c, ())]:
                with open(os.path.join(out_dir, f"rank{rank}.at"), "w") as f:
                    f.write(f"{c} {name}")
                try:
                    with process_group(store, f"{c}/{name}", timeout_s):
                        results[name] = train(case, name, ref["unused"], os.path.join(out_dir, f"case{c}_{name}"))
                except Exception:
                    results[name] = {"error": traceback.format_exc(limit=-6)}
        results["seconds"] = time.monotonic() - start
        torch.save(results, os.path.join(out_dir, f"case{c}_rank{rank}.pt"))


def _rank_main(rank, world, port, cases, lessons, timeout_s, out_dir, skip):
    """A launched rank (as harness._worker, without its process group: each run makes its own).
    Its stderr goes to rank{r}.log: gloo aborts the process on some mismatches, and the parent
    quotes the log to say why the rank died."""
    import random
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    torch.seed()
    random.seed()
    log = open(os.path.join(out_dir, f"rank{rank}.log"), "w", buffering=1)
    sys.stderr.flush()
    os.dup2(log.fileno(), 2)
    code = 0
    try:
        run_cases(rank, world, port, cases, lessons, timeout_s, out_dir, skip)
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # as harness._worker: avoids gloo's rare abort at interpreter exit


def launch(cases, lessons, timeout_s, crashed=None):
    """Run `cases` (one world size) on one launch of ranks, forked as harness.spawn's are. A rank
    that dies (gloo aborts on some mismatched collectives) ends the launch: the run it was in is
    marked crashed ({case index: {run: why}}) and a new launch goes on from that case without it.
    Returns [(per-rank results or None, why not)] per case; a crashed run's results: {"crashed"}."""
    crashed = crashed or {}
    import multiprocessing as mp
    import tempfile
    world = cases[0]["world"]
    assert all(c["world"] == world for c in cases)
    elsewhere = os.path.abspath(os.environ.get("DP_LESSONS") or ROOT) != ROOT
    ctx = mp.get_context("spawn") if elsewhere else harness._FORKSERVER  # (harness.spawn says why)
    store = dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False)
    with tempfile.TemporaryDirectory() as out_dir:
        skip = {c: set(runs) for c, runs in crashed.items()}
        procs = [ctx.Process(target=_rank_main, args=(r, world, store.port, cases, lessons, timeout_s, out_dir, skip))
                 for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + 60 + timeout_s * (len(LESSONS) + 4) * len(cases)
        while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
            if any(p.exitcode not in (None, 0) for p in procs):
                time.sleep(1)  # the others are waiting on the dead one: nothing more will come
                break
            time.sleep(0.05)
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
        out = []
        for c in range(len(cases)):
            paths = [os.path.join(out_dir, f"case{c}_rank{r}.pt") for r in range(world)]
            if all(os.path.exists(x) for x in paths):
                ranks = [torch.load(x, weights_only=False) for x in paths]
                for results in ranks:
                    results.update({run: {"crashed": why} for run, why in crashed.get(c, {}).items()})
                out.append((ranks, None))
                continue
            run, check, why = _why_dead(out_dir, procs, c, time.monotonic() >= deadline)
            later = {i - c: runs for i, runs in crashed.items() if i >= c}
            if run in runs_of(cases[c], lessons):  # again from this case, without that run
                later[0] = {**later.get(0, {}), run: why}
                return out + launch(cases[c:], lessons, timeout_s, later)
            out.append((None, (run, check, why)))
            return out + (launch(cases[c + 1:], lessons, timeout_s, {i - 1: r for i, r in later.items() if i})
                          if c + 1 < len(cases) else [])
        return out


def _why_dead(out_dir, procs, c, timed_out):
    """(run, check, detail) for case c, which did not finish on every rank."""
    def read(name):
        path = os.path.join(out_dir, name)
        return open(path, errors="replace").read() if os.path.exists(path) else ""
    dead = [r for r, p in enumerate(procs) if p.exitcode not in (0, -9)]  # -9: killed by launch
    for r in dead or range(len(procs)):
        at = read(f"rank{r}.at").split()
        if len(at) == 2 and at[0] == str(c):
            lines = [x.strip() for x in read(f"rank{r}.log").splitlines() if x.strip()]
            said = [x for x in lines if "what()" in x or "Error" in x or "error" in x] or lines or ["(nothing)"]
            what = "hung" if timed_out and not dead else f"rank {r} died (exit {procs[r].exitcode})"
            return (at[1], "crashed", f"{what}: {said[-1][:300]}")
    return ("launch", "crashed", "ranks died before the case started: " +
            "; ".join(f"rank {r}: {read(f'rank{r}.log').strip()[-300:]}" for r in dead))


# ----------------------------------------------------------------------------- checks, in the parent
def mismatch(got, want, case, init, loss_atol=None):
    """Why run `got` does not match `want` (tolerances.FUZZ_*), or None. In bf16 (fp16) a parameter
    is compared as fp32 master weights where both runs hold them, else as bf16 (fp16) working
    copies (the fp32 values rounded), each element less one ulp of that precision."""
    g, w = got["params"], want["params"]
    if g.keys() != w.keys():
        return f"parameters {sorted(g.keys() ^ w.keys())} in one run only"
    losses_g, losses_w = torch.tensor(got["losses"]), torch.tensor(want["losses"])
    if case["precision"] == "fp32":
        if not torch.allclose(losses_g, losses_w, **FUZZ_TOL):  # (a NaN is close to nothing)
            return f"losses {got['losses']} vs {want['losses']}"
        for n in w:
            if not torch.allclose(g[n], w[n], **FUZZ_TOL):
                return (f"{n}: max |diff| {(g[n] - w[n]).abs().max().item():.3g} "
                        f"(|want| max {w[n].abs().max().item():.3g})")
        return None
    p = case["precision"]
    _, update_rtol, default_loss_atol, _ = BOUNDS[p]
    if not (losses_g - losses_w).abs().max() <= (loss_atol or default_loss_atol):  # (not >: a NaN fails)
        return f"losses {got['losses']} vs {want['losses']} ({p})"
    for n in w:
        both = all(r["masters"] is None or n in r["masters"] for r in (got, want))
        gn, wn, i0 = (g[n], w[n], init[n]) if both else (rounded(g[n], p), rounded(w[n], p), rounded(init[n], p))
        # less one ulp per element: a rounding flip, or a difference the 2-byte weight cannot show;
        # within a share of the update; in bf16, or FUZZ_BF16_FLOOR_ULPS ulps if more (tolerances.py)
        ulps = ulp(rounded(wn, p), p)
        diff = ((gn - wn).abs() - ulps).clamp(min=0)
        floor = FUZZ_BF16_FLOOR_ULPS * ulps.norm().item() if p == "bf16" else 0.0
        update, error = (wn - i0).norm().item(), diff.norm().item()
        if not error <= max(update_rtol * update, floor) + FUZZ_TOL["atol"]:  # (a NaN or an inf fails)
            shown = f", {FUZZ_BF16_FLOOR_ULPS} ulps {floor:.3g}" if floor else ""
            return (f"{n}: |diff| {error:.3g}, the update {update:.3g}{shown} "
                    f"(less one {p} ulp each, {'fp32 masters' if both else f'{p} working copies'})")
    return None


def rounded(t, precision="bf16"):
    """t rounded to bf16 (fp16), back in fp32."""
    return t.to(LOW[precision]).float()


def ulp(t, precision="bf16"):
    """The spacing of bf16 (fp16) values at each element of t (valued in that precision): with b
    significant bits (bf16 8, fp16 11), 2^(exponent - b) for t = m 2^exponent, 0.5 <= |m| < 1;
    fp16's subnormals (below 2^-14) are 2^-24 apart whatever their exponent."""
    spacing = torch.ldexp(torch.ones_like(t), torch.frexp(t).exponent - BOUNDS[precision][0])
    if precision != "fp16":
        return spacing.where(t != 0, torch.zeros_like(t))  # (bf16's smallest spacing is fp32's)
    return spacing.clamp(min=2.0 ** -24).where(t != 0, torch.full_like(t, 2.0 ** -24))


def first_line(error):
    lines = [x for x in error.strip().splitlines() if x.strip()]
    return lines[-1].strip()[:300] if lines else error


def findings(case, ranks, lessons=LESSONS):
    """Everything wrong with one case's runs ({run: result} per rank): [(run, check, detail)]."""
    ref = ranks[0]["reference"]
    init = {n: p.detach() for n, p in make_model(case["model"], case["seed"]).named_parameters()}
    out = []
    ran = [x for x in runs_of(case, lessons)]
    skipped = {name: ranks[0][name].get("skipped", []) for name in ran if "skipped" in ranks[0][name]}
    skipped["reference"] = ref.get("skipped", [])
    must = SKIPS_AT.get(case.get("loss_scale", {}).get("init_scale")) if case["precision"] == "fp16" else None
    for name, steps in skipped.items():  # every run, one process and PyTorch's included
        if must is not None and steps != must:
            out.append((name, "skipped steps", f"{steps}, where its first scale makes every run skip {must}"))
    # in bf16 (fp16), at least twice as far as PyTorch's own runs (tolerances.py)
    loss_atol = BOUNDS[case["precision"]][2] if case["precision"] in BOUNDS else None
    for name in ran:
        if (name not in LESSONS and case["precision"] in BOUNDS and not {"error", "crashed"} & set(ranks[0][name])
                and skipped[name] == skipped["reference"]):
            spread = max(abs(a - b) for a, b in zip(ranks[0][name]["losses"], ref["losses"]))
            loss_atol = max(loss_atol, FUZZ_BF16_PYTORCH_SPREAD * spread)
    for name in ran:
        if "crashed" in ranks[0][name]:
            out.append((name, "crashed", ranks[0][name]["crashed"]))
            continue
        errors = [(r, rk[name]["error"]) for r, rk in enumerate(ranks) if "error" in rk[name]]
        if errors:  # the first rank's own error, not the others' "connection closed" that follows it
            r, e = min(errors, key=lambda re: ("Connection closed" in re[1] or "Timed out" in re[1], re[0]))
            out.append((name, "raised", f"rank {r}: {first_line(e)}"))
            continue
        for r in range(1, len(ranks)):
            for n, p in ranks[0][name]["params"].items():
                if not torch.equal(p, ranks[r][name]["params"][n]):
                    out.append((name, "replicas differ", f"rank {r} vs rank 0: {n}"))
                    break
            differ = first_difference([ranks[0][name].get("order", []), ranks[r][name].get("order", [])])
            if differ:  # (NCCL: a hang, or one collective's bytes read by another)
                out.append((name, "collectives differ", f"rank 0 and rank {r} at call {differ[0]}: {differ[1]}"))
            if ranks[r][name].get("skipped") != ranks[0][name].get("skipped"):
                out.append((name, "replicas differ", f"rank {r} skipped steps {ranks[r][name]['skipped']}, "
                                                     f"rank 0 {ranks[0][name]['skipped']}"))
        resumed_wrong = [(r, rk[name]["resumed"]) for r, rk in enumerate(ranks) if rk[name].get("resumed")]
        if resumed_wrong:  # (each rank checked what it holds)
            out.append((name, "resumed", "rank {}: {}".format(*resumed_wrong[0])))
        # fp16: runs are held to runs that skipped the same steps (SKIPS says why), one process included
        if skipped.get(name) == skipped["reference"]:
            why = mismatch(ranks[0][name], ref, case, init, loss_atol)
            if why:
                out.append((name, "vs single process", why))
        if name in LESSONS:
            other = counterpart(name, case)
            ran_well = other in ranks[0] and not {"error", "crashed"} & set(ranks[0][other])
            alike = ran_well and skipped.get(name) == skipped.get(other)
            if alike and not any(f[0] == other for f in out):
                why = mismatch(ranks[0][name], ranks[0][other], case, init, loss_atol)
                if why:
                    out.append((name, f"vs {other}", why))
            # (unchecked where the counterpart did not run, or skipped other steps than one process:
            # then the case sits at fp16's overflow for every recipe, SKIPS; seed 20261127 drew one
            # where one process skipped [0], FSDP2 [1] and 05, 05's counterpart within bounds at step 0, none)
            settled = ran_well and skipped.get(other) == skipped["reference"]
            later = (name in LATER or name == "09" and case.get("zero3")) and case["accum"] > 1 and \
                skipped_later(skipped.get(name, []), skipped["reference"])
            # a run that loaded another lesson's checkpoint took that lesson's steps before it (resumed)
            writer = case.get("resume_from")
            inherited = writer in ran and LESSONS.index(writer) < LESSONS.index(name) and \
                set(skipped.get(name, [])) ^ set(skipped["reference"]) <= set(range(case["resume"]))
            if skipped.get(name) != skipped["reference"] and settled and not alike and not later and not inherited:
                out.append((name, "skipped steps", f"{skipped[name]}, where one process skipped "
                            f"{skipped['reference']} and {other} {skipped.get(other, '(did not run)')}"))
            why = stepped_later(ranks[0][name], ref, skipped, name, loss_atol) if later else None
            if why:  # LATER's: it stepped with finite numbers, on one process's run until then
                out.append((name, "stepped later", why))
    return out


def skipped_later(steps, reference):
    """Whether a run's skipped steps first part from one process's at a step one process skipped
    and the run did not (LATER: it stepped there; what it skipped after that follows its weights)."""
    apart = sorted(set(steps) ^ set(reference))
    return bool(apart) and apart[0] in reference


def stepped_later(run, ref, skipped, name, loss_atol):
    """Why a LATER run (05-08, skipped_later) is wrong, or None: every loss and parameter finite,
    and the losses one process's (within loss_atol) up to and at the first step it stepped where
    one process skipped (the same parameters until then)."""
    if not all(math.isfinite(l) for l in run["losses"]) or not all(p.isfinite().all() for p in run["params"].values()):
        return "a loss or a parameter is not finite"
    first = min(set(skipped["reference"]) - set(skipped[name]))
    gap = max(abs(a - b) for a, b in zip(run["losses"][:first + 1], ref["losses"][:first + 1]))
    return None if gap <= loss_atol else f"loss {gap:.1e} from one process's by step {first} (bound {loss_atol:.1e})"


def run_batch(cases, lessons=LESSONS, timeout_s=None):
    """Run the cases (one world size) in one launch: ([findings per case], [seconds per case])."""
    timeout_s = timeout_s or int(os.environ.get("FUZZ_COLLECTIVE_TIMEOUT", 20))
    found, seconds = [], []
    for case, (ranks, why) in zip(cases, launch(cases, tuple(lessons), timeout_s)):
        found.append([why] if why else findings(case, ranks, lessons))
        seconds.append(ranks[0]["seconds"] if ranks else None)
    return found, seconds


# ----------------------------------------------------------------------------- reporting
def reproducer(case, lessons=LESSONS):
    only = "" if tuple(lessons) == LESSONS else f" --lessons {','.join(lessons)}"
    python = os.path.relpath(sys.executable) if sys.executable.startswith(ROOT) else "python"
    return f"{python} -m tests.fuzz{only} --case '{json.dumps(case, separators=(',', ':'))}'"


def describe(case):
    m = case["model"]
    experts = sum(len(b["experts"]) for b in m["blocks"]) + bool(m["root_expert"])
    scale = ""  # fp16's loss scaler: "(init 2^40, backoff 2^-32)"
    if "loss_scale" in case:
        words = [f"growth every {v}" if k == "growth_interval" else f"{k.split('_')[0]} 2^{math.log2(v):g}"
                 for k, v in case["loss_scale"].items()]
        scale = " (" + (", ".join(words) or "GradScaler's defaults") + ")"
    return (f"world {case['world']} accum {case['accum']} {case['precision']}{scale} {case['optimizer']} clip {case['clip']} "
            f"wd {case['weight_decay']} bucket {case['bucket_mb']} MB{', ring' if case.get('collectives') == 'ring' else ''}"
            f"{', 07 uneven' if case.get('layout') == 'uneven' and case.get('collectives') != 'ring' else ''}; "
            f"{len(m['blocks'])} blocks, {experts} experts"
            f"{', tied' if m['tied'] else ''}{', frozen emb' if m['frozen_emb'] else ''}"
            f"{', a frozen unit' if any(b['frozen'] == 'all' for b in m['blocks']) else ''}"
            f"{', checkpointed' if m.get('checkpoint') else ''}"
            f"{', 08 at G = ' + str(case['shard_group']) if case.get('shard_group') else ''}"
            f"{', units in chunks of 2' if case.get('chunk', 1) > 1 else ''}"
            f"{', 09 --zero3 1' if case.get('zero3') else ''}"
            f"{', resumed at step ' + str(case['resume']) if case.get('resume') else ''}"
            f"{' (after ' + case['resume_from'] + ': from its checkpoint)' if case.get('resume_from') else ''}"
            + "".join(f", --{k.replace('_', '-')} step" for k in ("reduce_every", "all_reduce_every") if case.get(k) == "step"))


def report(case, found, lessons=LESSONS):
    lines = [f"FAIL {describe(case)}"]
    lines += [f"  {name}: {check}: {detail}" for name, check, detail in found]
    lines.append(f"  reproduce: {reproducer(case, lessons)}")
    return "\n".join(lines)


def gist(detail):
    """An error's message without the rank, gloo's source paths and the sizes: one line per kind."""
    import re
    detail = re.sub(r"^rank \d+( died \(exit -?\d+\))?: |\[[^\]]*\] ?|what\(\): *|\d+ vs \d+\. ", "", detail)
    return detail.strip()[:90]


def summary(failures):
    """{(run, check, the error's gist): count}, the reader's table of kinds."""
    kinds = {}
    for _, found in failures:
        for name, check, detail in found:
            key = (name, check, gist(detail) if check in ("raised", "crashed") else "")
            kinds[key] = kinds.get(key, 0) + 1
    return "\n".join(f"  {n:4d} x {name} {check} {what}" for (name, check, what), n in sorted(kinds.items()))


# ----------------------------------------------------------------------------- driving Hypothesis
def fixed_draws():
    """Hypothesis draws some integers from the constants in the project's imported modules; given
    none, a seed draws the same cases whatever else is imported or edited."""
    from unittest import mock
    from hypothesis.internal.conjecture import providers
    return mock.patch.object(providers, "_get_local_constants", lambda: type(providers._local_constants)())


def drawn(strategy, n, seed):
    """n values of `strategy`, drawn by Hypothesis from `seed`: the same list every time."""
    out = []

    @hypothesis.seed(seed)
    @settings(max_examples=n, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def collect(value):
        out.append(value)
    with fixed_draws():
        collect()
    return out[:n]


def fuzz(examples, seed, batch, lessons, shrink, log=print):
    """Draw `examples` cases and run them, `batch` to a launch. Without shrink: every case runs
    (once: Hypothesis may draw one twice), each failing case is printed with its reproducer;
    returns the failures. With shrink: the first failure stops the search and Hypothesis shrinks
    it (one case per launch), printing one line per attempt; it raises with the smallest."""
    failures, seen, start = [], set(), time.monotonic()
    per = 1 if shrink else batch
    fp16 = any(x in FP16 for x in lessons)  # (else no fp16 case: none of these lessons would run it)

    @hypothesis.seed(seed)
    @settings(max_examples=math.ceil(examples / per) * (1 if shrink else 3),  # (room for repeats)
              database=None, deadline=None, print_blob=False,
              phases=[Phase.generate, Phase.shrink] if shrink else [Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(st.integers(1, 4).flatmap(lambda w: st.lists(cases(w, fp16), min_size=per, max_size=per,
                                                        unique_by=json.dumps)))
    def one_launch(batch_cases):
        if not shrink:  # each case once, and no more than asked for
            fresh = []
            for case in batch_cases:
                if json.dumps(case) not in seen and len(seen) < examples:
                    seen.add(json.dumps(case))
                    fresh.append(case)
            if not fresh:
                return
            batch_cases = fresh
        results, seconds = run_batch(batch_cases, lessons)
        for case, found, secs in zip(batch_cases, results, seconds):
            if found and shrink:
                log(f"FAIL {describe(case)}: {found[0][0]} {found[0][1]}")
            elif found:
                failures.append((case, found))
                log(report(case, found, lessons))
            elif secs is not None:
                log(f"ok   {describe(case)} ({secs:.1f} s)")
        if shrink and any(results):
            raise AssertionError("\n".join(report(c, f, lessons) for c, f in zip(batch_cases, results) if f))
    try:
        with fixed_draws():
            one_launch()
    finally:
        ran = "" if shrink else f"{len(seen)} cases, {len(failures)} failing, "
        log(f"{ran}{time.monotonic() - start:.0f} s (FUZZ_SEED={seed})")
        if not shrink:
            drawn_cases = [json.loads(c) for c in seen]
            log(f"of them: {sum(map(partly_used, drawn_cases))} with a module used on some ranks and not others "
                f"in a step, {sum(not fsdp2_can_run(c) for c in drawn_cases)} that FSDP2 cannot run "
                f"(06: one process only), {sum(c['precision'] == 'fp16' for c in drawn_cases)} in fp16 "
                f"(lessons {','.join(x for x in lessons if x in FP16) or 'none of these'})")
        if failures:
            log("kinds of failure:\n" + summary(failures))
    return failures


def main(argv=None):
    parser = Parser("fuzz", description=__doc__)
    parser.add_argument("--examples", type=int, default=os.environ.get("FUZZ_EXAMPLES", "300"),
                        help="cases to draw (FUZZ_EXAMPLES)")
    parser.add_argument("--seed", type=int, default=os.environ.get("FUZZ_SEED") or None, help="Hypothesis' seed (FUZZ_SEED; default: a new one)")
    parser.add_argument("--batch", type=int, default=os.environ.get("FUZZ_BATCH", "4"),
                        help="cases per launch of ranks (FUZZ_BATCH)")
    parser.add_argument("--lessons", default=os.environ.get("FUZZ_LESSONS") or ",".join(LESSONS),
                        help="the lessons to check, e.g. 04,05 (FUZZ_LESSONS)")
    parser.add_argument("--shrink", action="store_true", default=os.environ.get("FUZZ_SHRINK", "") not in ("", "0"),
                        help="stop at the first failure and shrink it (FUZZ_SHRINK=1)")
    parser.add_argument("--case", help="run this one case (JSON, as a failure prints it)")
    args = parser.parse_args(argv)
    lessons = tuple(x.strip() for x in args.lessons.split(",") if x.strip())
    if not set(lessons) <= set(LESSONS):
        parser.error(f"--lessons: from {','.join(LESSONS)}")
    if args.examples < 1 or args.batch < 1:
        parser.error("--examples (FUZZ_EXAMPLES) and --batch (FUZZ_BATCH) must be at least 1")
    if args.case:
        try:
            case = json.loads(args.case)
        except ValueError as e:
            parser.error(f"--case: not JSON ({e})")
        try:  # its shape, before ranks start: what a failure prints, or one line here
            describe(case), make_model(case["model"], case["seed"]), global_batch(case, 0)
        except (KeyError, TypeError, AttributeError, IndexError, ValueError) as e:
            parser.error(f"--case: not a case as a failure prints it ({type(e).__name__}: {e})")
        [found], [secs] = run_batch([case], lessons)
        print(report(case, found, lessons) if found else f"ok   {describe(case)} ({secs:.1f} s)")
        return 1 if found else 0
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(3), "big")
    print(f"fuzzing {args.examples} cases, lessons {','.join(lessons)}, FUZZ_SEED={seed}", flush=True)
    try:
        failures = fuzz(args.examples, seed, args.batch, lessons, args.shrink, log=lambda s: print(s, flush=True))
    except AssertionError as e:  # --shrink: Hypothesis' smallest failing case
        print(f"smallest failing case:\n{e}")
        return 1
    return 1 if failures else 0


if __name__ == "__main__":
    import fuzz as _fuzz  # this file under its own name, so spawned ranks find run_cases by it
    sys.exit(_fuzz.main())
