"""Hidden tests of 04_zero1: 3 ranks, odd shapes (every flat buffer padded), accumulation,
the gradient's scale through SGD, and clipping on uneven shards."""
import functools

import harness
from hidden_suite import check_gpt, check_grads, check_toy, close, launch
from lessons import build
from toy import toy_reference, toy_train

CLIP = 0.05  # the toy's gradient norm is about 0.5: clipping changes every step
EXTRA = {"clip": functools.partial(toy_train, build, "04", grad_clip=CLIP, different_init=True)}


@harness.once
def results():
    return launch("04", EXTRA)


def test_toy_at_3_ranks_tied_frozen_unused_different_init_accumulation():
    check_toy(results())


def test_gradient_scale_through_sgd_at_3_ranks_4_micro_steps():
    check_grads(results())


def test_gpt_of_odd_shapes_at_3_ranks_with_accumulation():
    check_gpt(results())


def test_global_norm_clipping_over_uneven_shards():
    ref = toy_reference(grad_clip=CLIP)
    for rank_out in results():
        close(rank_out["clip"], ref)
