"""Hidden tests of 06_zero3: 3 ranks, odd shapes (every unit padded), accumulation, the
gradient's scale through SGD, and prefetch off."""
import functools

import harness
from hidden_suite import at_rest, check_at_rest, check_gpt, check_grads, check_toy, close, launch
from lessons import build
from toy import toy_reference, toy_train

EXTRA = {"no_prefetch": functools.partial(toy_train, build, "06", prefetch=False, grad_accum=2,
                                          different_init=True),
         "at_rest": functools.partial(at_rest, "06_zero3")}


@harness.once
def results():
    return launch("06", EXTRA)


def test_toy_at_3_ranks_tied_frozen_unused_different_init_accumulation():
    check_toy(results())


def test_gradient_scale_through_sgd_at_3_ranks_4_micro_steps():
    check_grads(results())


def test_gpt_of_odd_shapes_at_3_ranks_with_accumulation():
    check_gpt(results())


def test_without_prefetch():
    ref = toy_reference()
    for rank_out in results():
        close(rank_out["no_prefetch"], ref)


def test_at_rest_my_shards_and_no_unit_left_gathered():
    check_at_rest(results())
