"""Hidden tests of 01_vanilla_dp (all-reduce of every gradient): 3 ranks, odd shapes, accumulation (hidden_suite.py)."""
import harness
from hidden_suite import check_gpt, check_grads, check_toy, launch


@harness.once
def results():
    return launch("01")


def test_toy_at_3_ranks_tied_frozen_unused_different_init_accumulation():
    check_toy(results())


def test_gradients_are_the_global_batch_mean_at_3_ranks_4_micro_steps():
    check_grads(results())


def test_gpt_of_odd_shapes_at_3_ranks_with_accumulation():
    check_gpt(results())
