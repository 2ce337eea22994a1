"""Lesson 04 (ZeRO-1) against single-process training and PyTorch's ZeroRedundancyOptimizer;
its memory and communication against the ZeRO paper. Tolerances: tests/zero_parity.py."""
import math

import pytest

from lessonkit import common, optimizers

from harness import comm_ops, gpt_train, held, launches, memory_theory, run_lesson, sent_bytes, theory_bytes
from lessons import build
from toy import toy_reference, toy_train
from model import GPT
from zero_parity import ARGV, PSI, SGD, bf16_parity, close, gpt_parity, optimizer_bytes, toy_parity

LESSON = "04_zero1"
CLIP = ARGV + ["--grad-clip", "0.05"]
ACCUM_CLIP = CLIP + ["--grad-accum", "2"]
BF16 = ARGV + ["--precision", "bf16"]


def suite(world):
    """Everything lesson 04 is checked on, in one launch per world size (start-up is costly)."""
    return {
        "main": run_lesson(LESSON, ARGV),
        "accum_clip": run_lesson(LESSON, ACCUM_CLIP),
        "bf16": run_lesson(LESSON, BF16),
        "torch": gpt_train("zero_redundancy", ACCUM_CLIP),
        "toy": toy_train(build, "04", different_init=True),
        "toy_accum_clip": toy_train(build, "04", grad_accum=3, grad_clip=0.05, different_init=True),
        "toy_sgd": toy_train(build, "04", **SGD),
        "toy_torch": toy_train(build, "zero_redundancy", find_unused=True),
    }


results = launches(suite)  # one launch per world size, a failed one remembered too


def padded(world):
    """Psi rounded up to a multiple of N: the flat buffer."""
    return math.ceil(PSI / world) * world


# ----------------------------------------------------------------------------- the tests
@pytest.mark.parametrize("world", [1, 2, 4])
def test_gpt_matches_single_process_and_zero_redundancy_optimizer(world):
    # with accumulation: ZeRO-1 keeps the whole gradient and reduces it once, at the end, so
    # accumulation changes nothing but round-off
    gpt_parity(results(world), world, ARGV, CLIP)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_edge_cases_tied_frozen_unused_uneven_different_init_accumulation_clipping(world):
    toy_parity(results(world))
    for out in results(world):
        close(out["toy_torch"], toy_reference())  # PyTorch's ZeroRedundancyOptimizer too


@pytest.mark.parametrize("world", [1, 2, 4])
def test_bf16_matches_mixed_precision_reference(world):
    bf16_parity(results(world), world, BF16)


@pytest.mark.parametrize("world", [2, 4])
def test_memory_at_rest_bf16_is_zero1_theory_plus_padding(world):
    report = results(world)[0]["bf16"]["report"]
    theory, n = memory_theory(report), padded(world)
    assert report["n_params"] == PSI
    assert (theory["params"], theory["grads"], theory["optimizer"]) == (2 * PSI, 2 * PSI, 12 * PSI / world)
    # the flat buffer's layout: one bucket (bucket.py) of main()'s param groups, in reverse
    gpt = GPT(common.model_config(common.parse_args(BF16)))
    numels = [p.numel() for g in optimizers.decay_groups(gpt, 0.1) for p in g["params"]][::-1]
    for rank, m in enumerate(held(report)):
        # exact bytes: one padded bf16 flat buffer each for parameters and gradients (2 Psi
        # each); for one shard of it, fp32 master weights and two fp32 Adam moments (12 Psi / N),
        # plus Adam's step counts (zero_parity.optimizer_bytes); nothing else held
        assert m["params"] == 2 * n
        assert m["grads"] == 2 * n
        assert m["optimizer"] == optimizer_bytes(numels, world, rank, master_copy=True)
        assert m["other"] == 0
        # against the paper: within the padding (fewer than N elements) and a step count per tensor
        for key in ("params", "grads", "optimizer"):
            assert abs(m[key] - theory[key]) <= 12 * (world - 1) + 4 * len(numels), key


@pytest.mark.parametrize("world", [2, 4])
def test_comm_is_one_reduce_scatter_and_one_all_gather_as_much_as_an_all_reduce(world):
    out = results(world)[0]
    for key, nbytes in (("main", 4), ("bf16", 2)):
        report = out[key]["report"]
        # exact: the padded flat buffer once each way
        assert comm_ops(report) == {"reduce_scatter": {"calls": 1, "bytes": padded(world) * nbytes},
                               "all_gather": {"calls": 1, "bytes": padded(world) * nbytes}}, key
        # a ring all-reduce's bytes, 2 (N-1)/N Psi, as in 01-03: padding is all it adds
        assert sent_bytes(report) == 2 * (world - 1) / world * padded(world) * nbytes
        assert theory_bytes(report) == 2 * (world - 1) / world * PSI * nbytes
    # 2 micro-steps, clipping on: the same once per optimizer step (ZeRO-1 keeps the whole
    # gradient, so it reduces once, at the end), plus exactly one all-reduce of one fp32
    # scalar, the squared norm summed over all shards
    ops, main = comm_ops(out["accum_clip"]["report"]), comm_ops(out["main"]["report"])
    assert ops == {**main, "all_reduce": {"calls": 1, "bytes": 4}}
