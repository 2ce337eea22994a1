"""Lesson 05 (ZeRO-2) against single-process training and FSDP2 without resharding; its memory
(at rest, and the gradient bytes alive during backward) and communication against the ZeRO
paper. Tolerances: tests/zero_parity.py."""

import pytest
import torch
import torch.distributed as dist

import common
import optimizers
import memory_ledger
from graded import load_lesson
from harness import comm_ops, gpt_train, held, launches, memory_theory, run_lesson, sent_bytes, theory_bytes
from lessons import build
from model import GPT, get_batch
from toy import make_toy, toy_train
from zero_parity import ARGV, PSI, SGD, bf16_parity, gpt_parity, optimizer_bytes, toy_parity

LESSON = "05_zero2"
MIB = 2 ** 20
ARGV = ARGV + ["--bucket-mb", "0.02"]  # 8 buckets in fp32, 4 in bf16 (ZeRO-2's cap is in bytes)
CLIP = ARGV + ["--grad-clip", "0.05"]
ACCUM_CLIP = CLIP + ["--grad-accum", "2"]
BF16 = ARGV + ["--precision", "bf16"]
# For the gradient bytes alive during backward: 8 layers (Psi = 110,715) in buckets of at most
# 5 KiB or one tensor (the largest, 4,356 elements, 8.5 KiB in bf16): 36 buckets.
DEEP = BF16 + ["--n-layer", "8", "--bucket-mb", repr(5 / 1024)]
# The toy, in bucket order (reverse registration): hidden's two tensors fill bucket 0 to the
# byte; the embedding (tied to the head), bigger than the cap, gets bucket 1; `unused` (never
# a gradient) is alone in bucket 2, never full during backward: finish() sends it as zeros.
_toy = make_toy()
TOY_CAP = sum(p.numel() for p in _toy.hidden.parameters()) * 4 / MIB


def layout(argv, world):
    """(padded Psi, number of buckets) of the GPT of argv in the lesson's buckets: each bucket
    padded to a multiple of N on its own."""
    args = common.parse_args(argv)
    model = GPT(common.model_config(args), seed=None).to(common.working_dtype(args))
    manager = load_lesson("bucket").BucketManager  # the graded bucket.py (graded.LESSONS_DIR)
    params = [p for g in optimizers.decay_groups(model, 0.1) for p in g["params"]]  # main()'s groups, in order
    buckets = manager(params, args.bucket_mb, launch=None, grads_as_views=False, pad_to=world).buckets
    return sum(b.numel_padded for b in buckets), len(buckets)


def bucket_numels(argv, world):
    """Each bucket's parameter sizes, in its layout."""
    args = common.parse_args(argv)
    model = GPT(common.model_config(args), seed=None).to(common.working_dtype(args))
    manager = load_lesson("bucket").BucketManager
    params = [p for g in optimizers.decay_groups(model, 0.1) for p in g["params"]]  # main()'s groups, in order
    return [[p.numel() for p in b.params] for b in manager(params, args.bucket_mb, launch=None,
                                                          grads_as_views=False, pad_to=world).buckets]


# ----------------------------------------------------------------------------- in the ranks
def gradient_peak(argv):
    """The most gradient bytes the ledger finds held during one bf16 backward of 05: sampled as
    each parameter's gradient has been handed to its bucket (the lesson's hook runs first), and
    after the last bucket finished. Full-size buckets filling or in flight, the slices received
    so far: a lesson that kept every bucket until the end of backward would peak at 2 Psi."""
    args = common.parse_args(argv)
    env = common.Dist(dist.get_rank(), dist.get_world_size(), torch.device("cpu"), "gloo")
    model = common.build_model(args, env)
    optimizer = load_lesson(LESSON).ZeRO2Optimizer(model.parameters(), bucket_cap_mb=args.bucket_mb,
                                                   **optimizers.adamw_kwargs(args))
    ledger, peak = memory_ledger.MemoryLedger(model, [optimizer]), [0]

    def sample(_=None):
        peak[0] = max(peak[0], ledger.measure()["grads"])
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(sample)
    x, y = get_batch(args, env, 0, 0)
    model(x, y).backward()  # its last act: wait for the reduce-scatters, keep my slices
    sample()
    return peak[0]


def suite(world):
    """Everything lesson 05 is checked on, in one launch per world size (start-up is costly)."""
    out = {
        "main": run_lesson(LESSON, ARGV),
        "accum_clip": run_lesson(LESSON, ACCUM_CLIP),
        "bf16": run_lesson(LESSON, BF16),
        "torch": gpt_train("fsdp2_noreshard", ACCUM_CLIP),
        "toy": toy_train(build, "05", different_init=True),  # 25 MiB: one bucket
        "toy_accum_clip": toy_train(build, "05", grad_accum=3, grad_clip=0.05, different_init=True,
                                    bucket_mb=TOY_CAP),
        "toy_sgd": toy_train(build, "05", bucket_mb=TOY_CAP, **SGD),
    }
    if world > 1:
        out["gradient_peak"] = gradient_peak(DEEP)
    return out


results = launches(suite)  # one launch per world size, a failed one remembered too


# ----------------------------------------------------------------------------- the tests
@pytest.mark.parametrize("world", [1, 2, 4])
def test_gpt_matches_single_process_and_fsdp2(world):
    # with accumulation: reduce-scattered at every micro-step, summed
    gpt_parity(results(world), world, ARGV, CLIP)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_edge_cases_tied_frozen_unused_uneven_different_init_accumulation_clipping(world):
    toy_parity(results(world))


@pytest.mark.parametrize("world", [1, 2, 4])
def test_bf16_matches_mixed_precision_reference(world):
    bf16_parity(results(world), world, BF16)


@pytest.mark.parametrize("world", [2, 4])
def test_memory_at_rest_bf16_is_zero2_theory_plus_padding(world):
    report = results(world)[0]["bf16"]["report"]
    theory = memory_theory(report)
    n, n_buckets = layout(BF16, world)
    assert report["n_params"] == PSI
    assert (theory["params"], theory["grads"], theory["optimizer"]) == (2 * PSI, 2 * PSI / world, 12 * PSI / world)
    buckets = bucket_numels(BF16, world)
    for rank, m in enumerate(held(report)):
        # exact bytes: one padded bf16 flat buffer per bucket for the parameters (2 Psi); my
        # slice of each bucket's gradient (2 Psi / N: no full-size bucket is left over); fp32
        # master weights and two Adam moments for my slices (12 Psi / N), plus Adam's step
        # counts (zero_parity.optimizer_bytes); nothing else held
        assert m["params"] == 2 * n
        assert m["grads"] == 2 * n // world
        assert m["optimizer"] == sum(optimizer_bytes(b, world, rank, master_copy=True) for b in buckets)
        assert m["other"] == 0
        # against the paper: within the padding (fewer than N elements per bucket) and a step
        # count per tensor
        n_tensors = sum(len(b) for b in buckets)
        for key in ("params", "grads", "optimizer"):
            assert abs(m[key] - theory[key]) <= n_buckets * 12 * (world - 1) + 4 * n_tensors, key


@pytest.mark.parametrize("world", [2, 4])
def test_gradient_bytes_during_backward_are_my_shards_plus_the_buckets_in_flight(world):
    args = common.parse_args(DEEP)
    model = GPT(common.model_config(args), seed=None)
    psi, largest = common.n_params(model), max(p.numel() for p in model.parameters())
    n, n_buckets = layout(DEEP, world)
    assert n_buckets > 20
    bucket = 2 * max(largest, args.bucket_mb * MIB / 2)  # bytes of the largest full-size bucket
    # my shards (2 Psi / N), up to 2 buckets in flight with their incoming shards and 1 filling,
    # and one p.grad between autograd and its hook (at most the largest tensor's)
    bound = 2 * n / world + 3 * bucket + 2 * bucket / world + 2 * largest
    for out in results(world):
        assert out["gradient_peak"] <= bound
        assert out["gradient_peak"] < 2 * psi * 0.8  # well below ZeRO-1's whole gradient


@pytest.mark.parametrize("world", [2, 4])
def test_comm_is_reduce_scatters_and_all_gathers_per_bucket_as_much_as_an_all_reduce(world):
    out = results(world)[0]
    for key, argv, nbytes in (("main", ARGV, 4), ("bf16", BF16, 2)):
        n, n_buckets = layout(argv, world)
        report = out[key]["report"]
        # exact: every bucket (padded) once each way
        assert comm_ops(report) == {"reduce_scatter": {"calls": n_buckets, "bytes": n * nbytes},
                               "all_gather": {"calls": n_buckets, "bytes": n * nbytes}}, key
        # a ring all-reduce's bytes, 2 (N-1)/N Psi, as in 01-04: padding is all it adds
        assert sent_bytes(report) == pytest.approx(2 * (world - 1) / world * n * nbytes, rel=1e-12)
        assert theory_bytes(report) == 2 * (world - 1) / world * PSI * nbytes
    # 2 micro-steps, clipping on: a reduce-scatter per bucket at every micro-step (no rank
    # keeps a whole gradient to accumulate into: the price of 05's choice, see its docstring),
    # the all-gathers once per optimizer step, and exactly one all-reduce of one fp32 scalar,
    # the squared norm summed over all shards
    n, n_buckets = layout(ARGV, world)
    assert comm_ops(out["accum_clip"]["report"]) == {
        "reduce_scatter": {"calls": 2 * n_buckets, "bytes": 2 * n * 4},
        "all_gather": {"calls": n_buckets, "bytes": n * 4},
        "all_reduce": {"calls": 1, "bytes": 4}}
