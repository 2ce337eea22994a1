"""Lesson 02 against single-process training and PyTorch's DistributedDataParallel."""
import functools

import pytest
import torch

import harness
from harness import (comm_ops, gpt_train, held, memory_theory, recording, reference, run_lesson, sent_bytes, spawn,
                     theory_bytes, toy_reference_grads)
from lessons import build
from toy import toy_reference, toy_train

LESSON = "02_async_allreduce"
ARGV = ["--steps", "6", "--n-layer", "2", "--d-model", "32", "--seq-len", "16",
        "--global-batch", "8", "--log-every", "100"]
BF16 = ARGV + ["--precision", "bf16"]
# fp32 parity: the distributed runs average N per-rank means where the reference takes one mean
# over the whole batch, so sums are formed in another order. The difference is float round-off
# (~1e-7 relative per step) that Adam can amplify a little over 6 steps; 1e-5 is far below the
# ~1e-2 a wrong averaging (a missed parameter, an unreduced micro-step) would cause.
TOL = dict(rtol=1e-5, atol=1e-5)
# Gradients, compared before Adam sees them (harness.recording says why): the same round-off
# argument as TOL; a wrong scale (a missing 1/N) is off by 50% or more.
GRAD_TOL = dict(rtol=1e-5, atol=1e-7)
# bf16 parity with the reference: parameters, gradients and the all-reduce are bf16, whose 8-bit
# significand rounds to 2^-9 = 0.2% relative. The reference rounds one whole-batch gradient; the
# ranks round their own halves, then the division and the sum, so gradient elements differ by a
# few bf16 ulps. Adam turns a small gradient's rounding into a whole update (its step is about lr
# per element whatever the gradient's size), so a parameter can drift by up to about 2 x lr x
# steps = 0.036 in the worst case (measured: 0.014, on attention biases near 0), and bf16 values
# near 1 (LayerNorm weights) are one ulp = 2^-7 apart. Losses (fp32 cross-entropy of bf16 logits)
# measured 2e-4 apart at most; 2e-3 leaves 10x margin. (The exact checks of the algorithm are
# the fp32 ones above and the bit-for-bit comparison with DDP below.)
BF16_LOSS_TOL = dict(rtol=0, atol=2e-3)
BF16_PARAM_TOL = dict(rtol=2 ** -7, atol=2 * 3e-3 * 6)


# ----------------------------------------------------------------------------- in the ranks
def toy_grads(lesson, **kw):
    grads = []
    out = toy_train(recording(build, grads), lesson, **kw)
    return {**out, "grads": grads}


def suite(world):
    """Everything lesson 02 is checked on, in one launch per world size (start-up is costly)."""
    out = {
        "main": run_lesson(LESSON, ARGV),
        "accum": run_lesson(LESSON, ARGV + ["--grad-accum", "2"]),
        "ddp": gpt_train("ddp", ARGV),
        "toy": toy_train(build, "02", different_init=True),
        "toy_accum": toy_train(build, "02", grad_accum=3),
        "toy_ddp": toy_train(build, "ddp", find_unused=True),
        "toy_grads": toy_grads("02", grad_accum=3, different_init=True),
    }
    if world == 2:
        out["bf16"] = run_lesson(LESSON, BF16)
        out["bf16_ddp"] = gpt_train("ddp", BF16)
    return out


@harness.once  # also remembers a failed launch: one launch per world size
def results(world):
    return spawn(world, suite, world)


# ----------------------------------------------------------------------------- comparisons
close = functools.partial(harness.close, tol=TOL)


grads_close = functools.partial(harness.grads_close, tol=GRAD_TOL)


# ----------------------------------------------------------------------------- the tests
@pytest.mark.parametrize("world", [1, 2, 4])
def test_gpt_matches_single_process_and_ddp(world):
    ref = reference(ARGV)
    for rank_out in results(world):
        close(rank_out["main"], ref)
        close(rank_out["accum"], ref)
        close(rank_out["ddp"], ref)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_edge_cases_tied_frozen_unused_different_init_accumulation(world):
    ref = toy_reference()
    for rank_out in results(world):
        close(rank_out["toy"], ref)
        close(rank_out["toy_accum"], ref)
        close(rank_out["toy_ddp"], ref)
        close(rank_out["toy_grads"], ref)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_gradients_are_the_whole_batch_gradient(world):
    # different initial weights on every rank, 3 micro-steps, tied/frozen/unused parameters
    want = toy_reference_grads()
    for rank_out in results(world):
        grads_close(rank_out["toy_grads"]["grads"], want)
        assert "unused" not in rank_out["toy_grads"]["grads"][0]


@pytest.mark.parametrize("world", [1, 2, 4])
def test_one_all_reduce_per_gradient_and_ring_bytes_equal_theory(world):
    main = results(world)[0]["main"]
    report = main["report"]
    psi = report["n_params"]
    ops = comm_ops(report)
    assert list(ops) == ["all_reduce"]
    assert ops["all_reduce"]["bytes"] == psi * 4  # exact: every gradient once, fp32
    # one call per parameter tensor with a gradient; the tied embedding/head counts once
    assert ops["all_reduce"]["calls"] == len(main["params"])
    assert sent_bytes(report) == theory_bytes(report)
    assert sent_bytes(report) == 2 * (world - 1) / world * psi * 4
    # gradient accumulation: the non-final micro-steps communicate nothing
    assert comm_ops(results(world)[0]["accum"]["report"]) == ops


def test_bf16_matches_reference_and_ddp_and_memory_equals_theory():
    ref = reference(BF16)
    for rank_out in results(2):
        torch.testing.assert_close(rank_out["bf16"]["losses"], ref["losses"], **BF16_LOSS_TOL)
        for name, p in rank_out["bf16"]["params"].items():
            torch.testing.assert_close(p, ref["params"][name], **BF16_PARAM_TOL, msg=name)
        # Against DDP the arithmetic is the same, element by element: bf16 gradients divided by
        # 2, then a sum of two numbers (commutative in IEEE, whatever the order): bit-identical.
        close(rank_out["bf16"], rank_out["bf16_ddp"], tol=dict(rtol=0, atol=0))
    report = results(2)[0]["bf16"]["report"]
    psi, n_tensors = report["n_params"], len(results(2)[0]["bf16"]["params"])
    assert comm_ops(report)["all_reduce"]["bytes"] == psi * 2  # bf16 collectives
    assert sent_bytes(report) == theory_bytes(report)
    theory = memory_theory(report)
    assert (theory["params"], theory["grads"], theory["optimizer"]) == (2 * psi, 2 * psi, 12 * psi)
    for mem in held(report):  # measured from the live tensors, rank by rank
        assert mem["params"] == 2 * psi and mem["peak_params"] == 2 * psi
        assert mem["grads"] == 2 * psi
        # fp32 master weights and two fp32 moments: 12 Psi. torch's AdamW also keeps one 0-dim
        # fp32 step counter per parameter tensor (4 bytes each), which the ZeRO paper's K omits.
        assert mem["optimizer"] == 12 * psi + 4 * n_tensors
        assert mem["other"] == 0
