"""Lesson 02 against single-process training and PyTorch's DistributedDataParallel."""
import pytest

import harness
from harness import (PEAKS, REPLICATED_GPT, REPLICATED_TOY, all_close, bf16_close, comm_ops, gpt_train, launches,
                     one_all_reduce_per_tensor, reference, replicated_bf16_memory, replicated_runs, run_lesson,
                     toy_grads, toy_reference_grads)
from tolerances import GRAD_TOL, TOL
from toy import toy_reference

LESSON = "02_async_allreduce"
ARGV = ["--steps", "6", "--n-layer", "2", "--d-model", "32", "--seq-len", "16",
        "--global-batch", "8", "--log-every", "100"]
BF16 = ARGV + ["--precision", "bf16"]


# ----------------------------------------------------------------------------- in the ranks
def suite(world):
    """Everything lesson 02 is checked on, in one launch per world size (start-up is costly)."""
    out = {**replicated_runs(LESSON, ARGV), "toy_grads": toy_grads("02", grad_accum=3, different_init=True, find_unused=True)}
    if world == 2:
        out["bf16"] = run_lesson(LESSON, BF16 + PEAKS)  # its memory: peak_params too
        out["bf16_ddp"] = gpt_train("ddp", BF16)
    return out


results = launches(suite)  # one launch per world size, a failed one remembered too


# ----------------------------------------------------------------------------- the tests
@pytest.mark.parametrize("world", [1, 2, 4])
def test_gpt_matches_single_process_and_ddp(world):
    all_close(reference(ARGV), results(world), REPLICATED_GPT, TOL)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_edge_cases_tied_frozen_unused_different_init_accumulation(world):
    all_close(toy_reference(), results(world), REPLICATED_TOY + ("toy_grads",), TOL)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_gradients_are_the_whole_batch_gradient(world):
    # different initial weights on every rank, 3 micro-steps, tied/frozen/unused parameters
    want = toy_reference_grads()
    for rank_out in results(world):
        harness.grads_close(rank_out["toy_grads"]["grads"], want, GRAD_TOL)
        assert "unused" not in rank_out["toy_grads"]["grads"][0]


@pytest.mark.parametrize("world", [1, 2, 4])
def test_one_all_reduce_per_gradient_and_ring_bytes_equal_theory(world):
    one_all_reduce_per_tensor(results(world)[0]["main"], world)
    # gradient accumulation: the non-final micro-steps communicate nothing
    assert comm_ops(results(world)[0]["accum"]["report"]) == comm_ops(results(world)[0]["main"]["report"])


def test_bf16_matches_reference_and_ddp_and_memory_equals_theory():
    ref = reference(BF16)
    for rank_out in results(2):
        bf16_close(rank_out["bf16"], ref)
        # Against DDP the arithmetic is the same, element by element: bf16 gradients divided by
        # 2, then a sum of two numbers (commutative in IEEE, whatever the order): bit-identical.
        harness.close(rank_out["bf16"], rank_out["bf16_ddp"], tol=dict(rtol=0, atol=0))
    report = results(2)[0]["bf16"]["report"]
    psi, n_tensors = report["n_params"], len(results(2)[0]["bf16"]["params"])
    assert comm_ops(report)["all_reduce"]["bytes"] == psi * 2  # bf16 collectives
    replicated_bf16_memory(report, psi, n_tensors)
