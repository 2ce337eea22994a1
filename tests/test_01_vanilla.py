"""Lesson 01 against single-process training and PyTorch's DistributedDataParallel."""
import pytest
import torch

from harness import (REPLICATED_GPT, REPLICATED_TOY, all_close, launches, one_all_reduce_per_tensor, reference,
                     replicated_runs, toy_grads, toy_reference_grads)
from tolerances import GRAD_TOL, TOL
from toy import toy_reference

ARGV = ["--steps", "6", "--n-layer", "2", "--d-model", "32", "--seq-len", "16",
        "--global-batch", "8", "--log-every", "100"]


def suite(world):
    """Everything lesson 01 is checked on, in one launch per world size (start-up is costly)."""
    return {**replicated_runs("01_vanilla_dp", ARGV),
            "toy_grads": toy_grads("01", different_init=True, grad_accum=3, find_unused=True)}


results = launches(suite)  # one launch per world size, a failed one remembered too


@pytest.mark.parametrize("world", [1, 2, 4])
def test_gpt_matches_single_process_and_ddp(world):
    all_close(reference(ARGV), results(world), REPLICATED_GPT, TOL)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_edge_cases_tied_frozen_unused_different_init_accumulation(world):
    all_close(toy_reference(), results(world), REPLICATED_TOY, TOL)


@pytest.mark.parametrize("world", [2, 4])
def test_one_all_reduce_per_gradient_and_ring_bytes_equal_theory(world):
    one_all_reduce_per_tensor(results(world)[0]["main"], world)


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
