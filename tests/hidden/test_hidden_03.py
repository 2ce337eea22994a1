"""Hidden tests of 03_buckets (and bucket.py's region): 3 ranks, odd shapes, accumulation, and a
bucket cap smaller than one parameter (every gradient a bucket of its own, the unused one too)."""
import functools
import random

import harness
from graded import load_lesson
from harness import gpt_train, recording, reference, toy_reference_grads
from hidden_suite import ODD_GPT, check_gpt, check_grads, check_toy, close, grads_close, launch
from lessons import build
from toy import toy_train

ONE_BYTE = 1 / 2 ** 20  # MiB: below every parameter's size


def tiny_cap_toy_grads():
    grads = []
    out = toy_train(recording(build, grads), "03", bucket_mb=ONE_BYTE, grad_accum=2, different_init=True)
    return {**out, "grads": grads}


EXTRA = {"tiny_cap_toy": tiny_cap_toy_grads,
         "tiny_cap_gpt": functools.partial(gpt_train, "03", ODD_GPT + ["--bucket-mb", "0.001"])}


@harness.once
def results():
    return launch("03", EXTRA)


def test_toy_at_3_ranks_tied_frozen_unused_different_init_accumulation():
    check_toy(results())


def test_gradients_are_the_global_batch_mean_at_3_ranks_4_micro_steps():
    check_grads(results())


def test_gpt_of_odd_shapes_at_3_ranks_with_accumulation():
    check_gpt(results())


def test_a_cap_smaller_than_one_parameter_every_gradient_its_own_bucket():
    want = toy_reference_grads()
    for rank_out in results():
        grads_close(rank_out["tiny_cap_toy"]["grads"], want)


def test_gpt_with_a_cap_smaller_than_its_embedding():
    ref = reference(ODD_GPT)
    for rank_out in results():
        close(rank_out["tiny_cap_gpt"], ref)


# ----------------------------------------------------------------------------- bucket.py alone
class Recorder:
    def __init__(self):
        self.log = []

    def launch(self, bucket):
        self.log.append(bucket.index)
        return self

    def wait(self):
        pass


def test_buckets_launch_in_index_order_as_soon_as_every_earlier_one_did():
    # 7 one-parameter buckets whose gradients arrive in shuffled orders: after each arrival,
    # exactly the longest run of complete buckets from index 0 has launched, in order
    import torch
    import torch.nn as nn
    BucketManager = load_lesson("bucket").BucketManager
    for seed in range(5):
        ps = [nn.Parameter(torch.zeros(3)) for _ in range(7)]
        rec = Recorder()
        m = BucketManager(ps, 1 / 2 ** 20, rec.launch)  # a cap below one parameter
        index = {id(p): b.index for b in m.buckets for p in b.params}
        order = list(ps)
        random.Random(seed).shuffle(order)
        done = set()
        for p in order:
            m.ready(p)
            done.add(index[id(p)])
            prefix = next(i for i in range(8) if i not in done)
            assert rec.log == list(range(prefix)), (seed, rec.log)


def test_finish_sends_every_bucket_once_whatever_arrived():
    import torch
    import torch.nn as nn
    BucketManager = load_lesson("bucket").BucketManager
    ps = [nn.Parameter(torch.zeros(2)) for _ in range(5)]
    rec = Recorder()
    m = BucketManager(ps, 1 / 2 ** 20, rec.launch)
    m.ready(ps[0])  # the last bucket; ps[1..4] never get a gradient (unused this step)
    assert rec.log == []
    m.finish()
    assert rec.log == [0, 1, 2, 3, 4]
