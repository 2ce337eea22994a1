"""Hidden tests of 08_hybrid: 3 ranks, odd shapes (every unit padded), accumulation and the
gradient's scale through SGD, at both grids 3 ranks allow: G = 3 (one shard group: 06) and
G = 1 (three replicas of one shard each: every gradient all-reduced across the replicas)."""
import functools

import harness
from hidden_suite import ODD_GPT, SCALE_STEPS, SGD, check_gpt, check_grads, check_toy, launch
from lessons import build
from toy import toy_train

REPLICAS = dict(grad_accum=2, different_init=True, shard_group=1)
EXTRA = {"toy_g1": functools.partial(toy_train, build, "08", **REPLICAS),
         "toy_sgd_g1": functools.partial(toy_train, build, "08", steps=SCALE_STEPS, grad_accum=4, different_init=True,
                                       shard_group=1, **SGD),
         "gpt_g1": functools.partial(harness.gpt_train, "08", ODD_GPT + ["--grad-accum", "2"], shard_group=1)}


@harness.once
def results():
    return launch("08", EXTRA)


def as_g1(results):
    """The G = 1 runs under the names the checks read."""
    return [{"toy": r["toy_g1"], "toy_sgd": r["toy_sgd_g1"], "gpt": r["gpt_g1"]} for r in results]


def test_toy_at_3_ranks_as_one_shard_group_and_as_three_replicas():
    check_toy(results())
    check_toy(as_g1(results()))


def test_gradient_scale_through_sgd_at_3_ranks_4_micro_steps_at_both_grids():
    check_grads(results())
    check_grads(as_g1(results()))


def test_gpt_of_odd_shapes_at_3_ranks_with_accumulation_at_both_grids():
    check_gpt(results())
    check_gpt(as_g1(results()))
