"""Lesson 06 (ZeRO-3) against single-process training and PyTorch's FSDP2 `fully_shard`, and its
memory and communication against the ZeRO paper's accounting, measured."""
import math

import pytest
import torch
import torch.distributed as dist

from lessonkit import common
import harness
from graded import load_lesson
from harness import PEAKS, all_close, gpt_train, held, launches, reference, run_lesson, sent_bytes, theory_bytes
from lessons import build, fsdp2_reduces_unused, zero3_full_parameters
from model import GPT
from routing import EXPERTS, block_slots, routed_reference, routed_train, used_by_rank
from stream_semantics import StreamSemantics
from toy import toy_reference, toy_sgd_reference, toy_train
from tolerances import TOL
from zero_parity import SGD, held_pieces

LESSON = "06_zero3"
# 3 blocks: with 2, "the root and two blocks gathered" (prefetch) would be the whole model, and
# a ZeRO-3 that never frees would pass the memory test
ARGV = ["--steps", "6", "--n-layer", "3", "--d-model", "32", "--seq-len", "16",
        "--global-batch", "8", "--log-every", "100"]
# accumulation, and a clip small enough to act at every step (gradient norms here are 1-1.5)
ACCUM_CLIP = ARGV + ["--grad-accum", "2", "--grad-clip", "0.05"]
NO_PREFETCH = ARGV + ["--prefetch", "0", "--grad-clip", "0"]  # also: no clipping all-reduce
BF16 = ARGV + ["--precision", "bf16"]
# fp32 parity: tolerances.TOL (it says why). bf16: parameters and gradients carry 8 significant
# bits, and the distributed run rounds at other points than the reference (each rank's gradient,
# the gradients divided by N before the sum, the clipping norm summed in another order), so from
# the first step on the two runs may round a weight to neighbouring bf16 values, and Adam, whose
# steps are about lr whatever the gradient's size, may then step a weight with a near-zero
# gradient either way. So no tight per-weight bound exists; the run as a whole must stay close.
# Measured at 1, 2 and 4 ranks over these 6 steps: losses within 1e-4 of the reference's, weights
# within 4e-3 in relative Frobenius norm. Keeping no fp32 master weights (the classic bf16 bug: a
# LayerNorm weight near 1, whose bf16 spacing 2^-7 exceeds lr, then never moves) measures at least
# 7.9e-4 and 8.4e-3: the bounds below sit between, 5x and 1.5x above the correct run, 1.6x and
# 1.4x below the bug.
# (04 and 05 are held to other bf16 bounds, zero_parity.BF16_*: tests/tolerances.py says why.)
ZERO3_BF16_LOSS_ATOL = 5e-4
ZERO3_BF16_PARAM_RTOL = 6e-3


def initial_weights(argv):
    """In a spawned rank: main()'s model, built unit by unit from the meta device: its weights,
    gathered, and the most bytes its construction held at once (observed by harness.PeakAlive)."""
    args = common.parse_args(argv)
    env = common.Dist(dist.get_rank(), dist.get_world_size(), torch.device("cpu"), "gloo")
    with harness.PeakAlive() as construction:
        model = load_lesson(LESSON).build_model(args, env)
    return {"params": zero3_full_parameters(model), "init_peak": construction.peak}


def poison_all_gathers():
    """From here on every all-gather writes into a buffer first filled with NaN: a byte it fails
    to write (a prefetch not waited for, a wrong offset, a freed buffer read before its refill)
    is NaN, not stale bytes that happen to be right, and poisons loss and weights. (Not where
    the input is a slice of the output: FSDP2 gathers in place.)"""
    all_gather = dist.all_gather_into_tensor

    def poisoned(output_tensor, input_tensor, *args, **kwargs):
        if output_tensor.untyped_storage().data_ptr() != input_tensor.untyped_storage().data_ptr():
            output_tensor.fill_(float("nan"))
        return all_gather(output_tensor, input_tensor, *args, **kwargs)
    dist.all_gather_into_tensor = poisoned


def suite(world):
    """Everything lesson 06 is checked on, in one launch per world size (start-up is costly)."""
    out = {"main": run_lesson(LESSON, ARGV + PEAKS),  # the default path, as a student runs it
           "init": initial_weights(ARGV), "init_no_prefetch": initial_weights(NO_PREFETCH),
           "init_bf16": initial_weights(BF16)}
    poison_all_gathers()
    out.update({
        "accum_clip": run_lesson(LESSON, ACCUM_CLIP),
        "no_prefetch": run_lesson(LESSON, NO_PREFETCH + PEAKS),
        "bf16": run_lesson(LESSON, BF16 + PEAKS),
        "fsdp2": gpt_train("fsdp2", ARGV),
        "toy": toy_train(build, "06", different_init=True),
        "toy_accum": toy_train(build, "06", grad_accum=3),
        "toy_no_prefetch": toy_train(build, "06", prefetch=False),
        "toy_clip": toy_train(build, "06", grad_clip=0.05),
        "toy_sgd": toy_train(build, "06", steps=3, grad_accum=3, different_init=True, **SGD),
        "toy_fsdp2": toy_train(build, "fsdp2"),
    })
    return out


results = launches(suite)  # one launch per world size, a failed one remembered too


# ----------------------------------------------------------------------------- parity
@pytest.mark.parametrize("world", [1, 2, 4])
def test_meta_init_equals_single_process_model_exactly(world):
    for argv, key in [(ARGV, "init"), (BF16, "init_bf16")]:
        # bf16 too: the shards at rest are fp32, the fp32 initial weights (FSDP2's convention)
        args = common.parse_args(argv)
        ref = GPT(common.model_config(args), seed=args.seed)
        for rank_out in results(world):
            assert rank_out[key]["params"].keys() == dict(ref.named_parameters()).keys()
            for name, p in ref.named_parameters():  # the same generators, the same bits
                assert torch.equal(rank_out[key]["params"][name], p.detach().float()), name


@pytest.mark.parametrize("world", [1, 2, 4])
def test_gpt_matches_single_process_and_fsdp2(world):
    # "fsdp2": PyTorch's ZeRO-3 on the same run, held to the same answer
    for argv, keys in [(ARGV, ("main", "fsdp2")), (ACCUM_CLIP, ("accum_clip",)), (NO_PREFETCH, ("no_prefetch",))]:
        all_close(reference(argv), results(world), keys, TOL)
    for rank_out in results(world):
        harness.close(rank_out["main"], rank_out["fsdp2"], TOL)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_edge_cases_tied_frozen_unused_different_init_accumulation(world):
    all_close(toy_reference(), results(world), ("toy", "toy_accum", "toy_no_prefetch", "toy_fsdp2"), TOL)
    all_close(toy_reference(grad_clip=0.05), results(world), ("toy_clip",), TOL)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_gradients_are_the_global_batch_mean(world):
    # Adam's update m / sqrt(v) ignores a common scale of the gradients, so a missing 1/N would
    # hide from every test above; SGD's update is the gradient itself, times lr.
    all_close(toy_sgd_reference(steps=3), results(world), ("toy_sgd",), TOL)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_bf16_close_to_single_process_bf16(world):
    ref = reference(BF16)
    for rank_out in results(world):
        zero3_bf16_close(rank_out["bf16"], ref)


def zero3_bf16_close(out, ref):
    """A bf16 run of 06 (or of 07, which inherits its schedule) against the bf16 reference: losses
    within ZERO3_BF16_LOSS_ATOL, the weights within ZERO3_BF16_PARAM_RTOL in relative norm."""
    torch.testing.assert_close(out["losses"], ref["losses"], rtol=0, atol=ZERO3_BF16_LOSS_ATOL)
    assert out["params"].keys() == ref["params"].keys()
    diff = torch.cat([(out["params"][n] - ref["params"][n]).flatten() for n in ref["params"]])
    weights = torch.cat([ref["params"][n].flatten() for n in ref["params"]])
    assert diff.norm() <= ZERO3_BF16_PARAM_RTOL * weights.norm()


# ----------------------------------------------------------------------------- memory
def unit_params(argv):
    """Each unit's parameter sizes in its layout (the root first: GPT's own parameters)."""
    gpt = GPT(common.model_config(common.parse_args(argv)), seed=None)
    in_blocks = {p for b in gpt.blocks for p in b.parameters()}
    root = [p.numel() for p in {id(p): p for p in gpt.parameters()}.values() if p not in in_blocks]
    return [root] + [[p.numel() for p in b.parameters()] for b in gpt.blocks]


def units(argv):
    """Elements per unit (root first, then each block) and the largest single parameter."""
    gpt = GPT(common.model_config(common.parse_args(argv)), seed=None)
    blocks = [sum(p.numel() for p in b.parameters()) for b in gpt.blocks]
    return [common.n_params(gpt) - sum(blocks)] + blocks, max(p.numel() for p in gpt.parameters())


def padded(n, world):
    return math.ceil(n / world) * world


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("key", ["main", "no_prefetch", "bf16"])
def test_memory_at_rest_and_peak_params(world, key):
    numels, _ = units(ARGV)
    # At rest every model state is my shard, in fp32 whatever the precision (FSDP2's convention:
    # the fp32 shards are the master weights); bf16 (2 bytes) only for the units gathered.
    b = 2 if key == "bf16" else 4  # bytes per gathered element
    shard_bytes = sum(padded(n, world) // world for n in numels) * 4  # Psi/N, plus padding
    root, largest_block = padded(numels[0], world) * b, max(padded(n, world) for n in numels[1:]) * b
    for rank, mem in enumerate(held(results(world)[0][key]["report"])):
        # at rest every model state is my shard and nothing else: exact bytes
        assert mem["params"] == shard_bytes
        assert mem["grads"] == shard_bytes
        assert mem["master_weights"] == 0  # no copy: the optimizer updates the shards themselves
        # AdamW keeps 2 fp32 moments of my *trainable* elements: padding gets no state, so the
        # last rank, whose shard ends in padding, holds less (plus AdamW's step count: one fp32
        # scalar per tensor it updates, one per parameter that has elements in my shard)
        mine = [min(max(n - rank * padded(n, world) // world, 0), padded(n, world) // world)
                for n in numels]
        pieces = sum(held_pieces(unit, world, rank)[0] for unit in unit_params(ARGV))
        assert mem["optimizer"] == sum(mine) * 8 + 4 * pieces
        assert mem["other"] == 0
        # During the step: my shards, the root (its layers run first and last in forward, so it
        # stays gathered through each pass), the unit computing, and with prefetch the next one.
        # Sampled after every tensor operation, so this is the exact maximum.
        in_flight = 1 if key == "no_prefetch" else 2
        assert mem["peak_params"] == shard_bytes + root + in_flight * largest_block


@pytest.mark.parametrize("world", [1, 2, 4])
def test_initialisation_holds_one_full_unit_at_most(world):
    numels, largest_param = units(ARGV)
    shard_bytes = sum(padded(n, world) // world for n in numels) * 4
    largest_unit = max(padded(n, world) for n in numels) * 4
    # Everything construction allocated and held at once (harness.PeakAlive): at most all the
    # shards, one full unit, and model.init_parameters' temporaries (it draws each value in fp32
    # and scales it: two tensors the size of one parameter). A build that keeps each unit's full
    # buffer after sharding ends up holding the whole model and fails this at 2 and 4 ranks (at
    # 1 rank the shards are the whole model, so there the bound cannot tell).
    init_temporaries = 2 * largest_param * 4
    for rank_out in results(world):
        for key in ("init", "init_no_prefetch"):
            assert largest_unit <= rank_out[key]["init_peak"] <= shard_bytes + largest_unit + init_temporaries


# ----------------------------------------------------------------------------- communication
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("key", ["main", "no_prefetch", "bf16"])
def test_two_all_gathers_one_reduce_scatter_per_unit_ring_bytes_3psi(world, key):
    numels, _ = units(ARGV)
    b = 2 if key == "bf16" else 4
    padded_psi = sum(padded(n, world) for n in numels)
    report = results(world)[0][key]["report"]
    ring = 3 * (world - 1) / world * padded_psi * b  # ZeRO paper: 3 Psi (N-1)/N, + padding
    expected = {"all_gather": {"calls": 2 * len(numels), "bytes": 2 * padded_psi * b},
                "reduce_scatter": {"calls": len(numels), "bytes": padded_psi * b}}
    if key != "no_prefetch":  # gradient clipping: one fp32 scalar, the global squared norm
        expected["all_reduce"] = {"calls": 1, "bytes": 4}
        ring += 2 * (world - 1) / world * 4
    assert all(ops == expected for ops in report["comm"]["per_rank"])  # every rank, exactly
    assert sent_bytes(report) == pytest.approx(ring, rel=1e-12)
    psi = report["n_params"]
    assert theory_bytes(report) == 3 * (world - 1) / world * psi * b


# ----------------------------------------------------------------------------- routing
# RoutedNet (tests/routing.py): each step, each block (a unit) and each expert (inside a unit,
# or in the root) is used on all, some or none of the ranks, so one rank may skip a unit's
# forward, or run it and reduce a gradient of zeros, while another computes with it. ZeRO-3
# must still issue the same collectives in the same order on every rank, and give the averaged
# gradient (find_unused_parameters: none, where no rank used it). FSDP2 (torch 2.13) runs only
# the cases where every rank runs every unit (RoutedNet(route_blocks=False)), and only with
# set_reduce_scatter_unused_params (lessons: find_unused), which gives zeros, not None, where no
# rank used a parameter: 06 without find_unused_parameters. A unit some ranks skip mismatches
# its collectives (gloo aborts), as do experts skipped inside a unit without that setting.
ROUTED = {
    "routed": dict(find_unused=True),
    "routed_no_prefetch": dict(find_unused=True, prefetch=False),
    "routed_accum": dict(find_unused=True, grad_accum=2),
    "routed_accum_no_prefetch": dict(find_unused=True, grad_accum=2, prefetch=False),
    # the skipped modules run, their output dropped: forward gathered, backward never reached
    "routed_run_unused": dict(find_unused=True, model_kw=dict(run_unused=True)),
    # no find_unused_parameters: a parameter no rank used gets a zero gradient (AdamW moves it)
    "routed_zero_grads": dict(find_unused=False, grad_accum=2, prefetch=False),
    # blocks 0 and 1 one unit (07's chunks): a rank whose rows skip block 1 frees it when forward
    # moves on, one whose rows skip block 0 gathers it at block 1
    "routed_chunks": dict(find_unused=True, grad_accum=2, chunk=2),
}


def record_collectives():
    """From here on, the list of (collective, elements, dtype) this rank issues, in order."""
    log = []

    def recording(name, collective):
        def call(tensor, *args, **kwargs):
            log.append((name, tensor.numel(), str(tensor.dtype)))
            return collective(tensor, *args, **kwargs)
        return call
    for name in ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", "broadcast"):
        setattr(dist, name, recording(name, getattr(dist, name)))
    return log


EVERY_UNIT_RUNS = dict(grad_accum=2, model_kw=dict(route_blocks=False))  # as FSDP2 can run


def routed_suite(world):
    out = {"06_as_fsdp2": routed_train(build, "06", find_unused=False, **EVERY_UNIT_RUNS)}
    if fsdp2_reduces_unused():  # (torch 2.11's FSDP2 cannot run it: test_routed_experts_inside_units_match_fsdp2)
        out["fsdp2"] = routed_train(build, "fsdp2", find_unused=True, **EVERY_UNIT_RUNS)
    with StreamSemantics():  # NCCL's rules: an output is NaN until wait(), inputs untouched until then
        log = record_collectives()
        out.update({name: routed_train(build, "06", **kw) for name, kw in ROUTED.items()})
    return {**out, "collectives": log}


routed_results = launches(routed_suite)


def kinds_of_use(world, grad_accum):
    """Which cases the routing of routed_train reaches over its 4 steps: (a block or not, used
    on "all", "some" or "none" of the ranks), and "a unit that runs with no gradient" (block 1,
    which has no dense layer, run on a rank where none of its experts is)."""
    blocks, kinds = block_slots(), set()
    assert EXPERTS[1] == 2, "block 1: two experts and no dense layer"
    for step in range(4):
        use = used_by_rank(step, world, grad_accum)  # (world, slots)
        ranks = use.sum(0)
        for slot in range(use.shape[1]):
            share = "all" if ranks[slot] == world else "none" if ranks[slot] == 0 else "some"
            kinds.add((slot in blocks, share))
        at = blocks[1]
        if (use[:, at] & ~use[:, at + 1] & ~use[:, at + 2]).any():
            kinds.add("unit without gradient")
    return kinds


@pytest.mark.parametrize("world", [2, 3])
def test_routed_units_and_experts_match_single_process(world):
    for name, kw in ROUTED.items():
        accum = kw.get("grad_accum", 1)
        assert kinds_of_use(world, accum) == {(block, share) for block in (True, False)
                                               for share in ("all", "some", "none")} | {"unit without gradient"}
        want = routed_reference(world, accum, model_kw=kw.get("model_kw"), find_unused=kw["find_unused"])
        all_close(want, routed_results(world), (name,), TOL)


@pytest.mark.parametrize("world", [2, 3])
def test_routed_experts_inside_units_match_fsdp2(world):
    assert fsdp2_reduces_unused(), (f"torch {torch.__version__}'s FSDP2 has no set_reduce_scatter_unused_params "
                                  "(2.13 has): it cannot run experts some ranks skip, so there is no reference")
    want = routed_reference(world, 2, model_kw=EVERY_UNIT_RUNS["model_kw"], find_unused=False)
    all_close(want, routed_results(world), ("fsdp2", "06_as_fsdp2"), TOL)
    for rank_out in routed_results(world):
        harness.close(rank_out["06_as_fsdp2"], rank_out["fsdp2"], TOL)


@pytest.mark.parametrize("world", [2, 3])
def test_routed_every_rank_issues_the_same_collectives_in_the_same_order(world):
    logs = [rank_out["collectives"] for rank_out in routed_results(world)]
    assert all(log == logs[0] for log in logs)
    # and all of them: each unit (the root and 3 blocks; in chunks, the root and 2) gathered twice
    # and reduce-scattered once per backward (4 steps of each run, times its micro-steps), whatever
    # this rank skipped (and gathered once more after each run, to compare its weights)
    units = {name: 3 if kw.get("chunk") else 4 for name, kw in ROUTED.items()}
    backwards = {name: 4 * kw.get("grad_accum", 1) for name, kw in ROUTED.items()}
    ops = [op for op, *_ in logs[0]]
    assert ops.count("all_gather_into_tensor") == sum(units[n] * (2 * backwards[n] + 1) for n in ROUTED)
    assert ops.count("reduce_scatter_tensor") == sum(units[n] * backwards[n] for n in ROUTED)
