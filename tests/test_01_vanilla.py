"""Lesson 01 against single-process training and PyTorch's DistributedDataParallel."""
import functools

import pytest
import torch

import harness
from harness import (comm_ops, gpt_train, recording, reference, run_lesson, sent_bytes, spawn, theory_bytes,
                     toy_reference_grads)
from lessons import build
from toy import toy_reference, toy_train

ARGV = ["--steps", "6", "--n-layer", "2", "--d-model", "32", "--seq-len", "16",
        "--global-batch", "8", "--log-every", "100"]
# fp32 parity: the distributed runs average N per-rank means where the reference takes one mean
# over the whole batch, so sums are formed in another order. The difference is float round-off
# (~1e-7 relative per step) that Adam can amplify a little over 6 steps; 1e-5 is far below the
# ~1e-2 a wrong averaging (sum instead of mean, a missed parameter) would cause.
TOL = dict(rtol=1e-5, atol=1e-5)
# Gradients are compared before Adam sees them (harness.recording says why): the same round-off
# argument as TOL; a wrong scale (a missing 1/N) is off by 50% or more.
GRAD_TOL = dict(rtol=1e-5, atol=1e-7)


def toy_grads(**kw):
    grads = []
    out = toy_train(recording(build, grads), "01", **kw)
    return {**out, "grads": grads}


def suite(world):
    """Everything lesson 01 is checked on, in one launch per world size (start-up is costly)."""
    return {
        "main": run_lesson("01_vanilla_dp", ARGV),
        "accum": run_lesson("01_vanilla_dp", ARGV + ["--grad-accum", "2"]),
        "ddp": gpt_train("ddp", ARGV),
        "toy": toy_train(build, "01", different_init=True),
        "toy_accum": toy_train(build, "01", grad_accum=3),
        "toy_ddp": toy_train(build, "ddp", find_unused=True),
        "toy_grads": toy_grads(different_init=True, grad_accum=3),
    }


@harness.once  # also remembers a failed launch: one launch per world size
def results(world):
    return spawn(world, suite, world)


close = functools.partial(harness.close, tol=TOL)


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


@pytest.mark.parametrize("world", [2, 4])
def test_one_all_reduce_per_gradient_and_ring_bytes_equal_theory(world):
    report = results(world)[0]["main"]["report"]
    psi = report["n_params"]
    ops = comm_ops(report)
    assert list(ops) == ["all_reduce"]
    assert ops["all_reduce"]["bytes"] == psi * 4  # exact: every gradient once, fp32
    # one call per parameter tensor with a gradient; the tied embedding/head counts once
    assert ops["all_reduce"]["calls"] == len(results(world)[0]["main"]["params"])
    assert sent_bytes(report) == theory_bytes(report)
    assert sent_bytes(report) == 2 * (world - 1) / world * psi * 4


@pytest.mark.parametrize("world", [1, 2, 4])
def test_gradients_are_the_whole_batch_gradient(world):
    # different initial weights on every rank, 3 micro-steps, tied/frozen/unused parameters
    want = toy_reference_grads()
    for rank_out in results(world):
        got = rank_out["toy_grads"]["grads"]
        assert len(got) == len(want)
        for step_got, step_want in zip(got, want):
            assert step_got.keys() == step_want.keys()  # the unused parameter has no gradient
            for name in step_want:
                torch.testing.assert_close(step_got[name], step_want[name], **GRAD_TOL, msg=name)
