"""Hidden tests of 05_zero2: 3 ranks, odd shapes, accumulation, clipping, and a bucket cap smaller
than one parameter (every bucket padded to a multiple of 3 on its own)."""
import functools

import harness
from harness import gpt_train, reference
from hidden_suite import ODD_GPT, at_rest, check_at_rest, check_gpt, check_grads, check_toy, close, launch
from lessons import build
from toy import toy_reference, toy_train

ONE_BYTE = 1 / 2 ** 20
CLIP = 0.05  # the toy's gradient norm is about 0.5: clipping changes every step

EXTRA = {"tiny_cap_toy": functools.partial(toy_train, build, "05", bucket_mb=ONE_BYTE, grad_accum=2,
                                           different_init=True, grad_clip=CLIP),
         "tiny_cap_gpt": functools.partial(gpt_train, "05", ODD_GPT + ["--bucket-mb", "0.001"]),
         "at_rest": functools.partial(at_rest, "05_zero2")}


@harness.once
def results():
    return launch("05", EXTRA)


def test_toy_at_3_ranks_tied_frozen_unused_different_init_accumulation():
    check_toy(results())


def test_gradient_scale_through_sgd_at_3_ranks_4_micro_steps():
    check_grads(results())


def test_gpt_of_odd_shapes_at_3_ranks_with_accumulation():
    check_gpt(results())


def test_a_cap_smaller_than_one_parameter_with_clipping():
    ref = toy_reference(grad_clip=CLIP)
    for rank_out in results():
        close(rank_out["tiny_cap_toy"], ref)


def test_gpt_with_a_cap_smaller_than_its_embedding():
    ref = reference(ODD_GPT)
    for rank_out in results():
        close(rank_out["tiny_cap_gpt"], ref)


def test_at_rest_my_gradient_slices_and_no_bucket_left_over():
    check_at_rest(results())
