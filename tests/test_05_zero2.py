"""Lesson 05 (ZeRO-2) against single-process training and FSDP2 without resharding; its memory
(at rest, and the gradient bytes alive during backward) and communication against the ZeRO
paper. Tolerances: tests/zero_parity.py."""

import contextlib
import io

import pytest

from lessonkit import common
from lessonkit.summary import print_summary
from graded import load_lesson
from harness import PEAKS, comm_ops, gpt_train, held, launches, memory_theory, run_lesson, sent_bytes, theory_bytes
from lessons import build
from model import GPT
from toy import make_toy, toy_train
from zero_parity import ARGV, PSI, SGD, bf16_parity, gpt_parity, optimizer_bytes, toy_parity

LESSON = "05_zero2"
MIB = 2 ** 20
ARGV = ARGV + ["--bucket-mb", "0.02"]  # 7 buckets in fp32, 4 in bf16 (ZeRO-2's cap is in bytes)
CLIP = ARGV + ["--grad-clip", "0.05"]
ACCUM_CLIP = CLIP + ["--grad-accum", "2"]
BF16 = ARGV + ["--precision", "bf16"]
# For the gradient bytes alive during backward: 8 layers (Psi = 110,715) in buckets of at most
# 5 KiB or one tensor (the largest, 4,356 elements, 8.5 KiB in bf16): 50 buckets.
DEEP = BF16 + ["--n-layer", "8", "--bucket-mb", repr(5 / 1024), "--steps", "2"]
# The default GPT (Psi = 809,728: 3.09 MiB of fp32 gradients) at the default 25 MiB: two
# buckets, a 1 MiB first one (0.76 MiB: the last block) and the rest (2.33 MiB); at 0.25 MiB, 22.
DEFAULT = ["--steps", "2", "--log-every", "100"]
DEFAULT_MANY = DEFAULT + ["--bucket-mb", "0.25"]
# The toy, in bucket order (reverse registration): hidden's two tensors fill bucket 0 to the
# byte; the embedding (tied to the head), bigger than the cap, gets bucket 1; `unused` (never
# a gradient) is alone in bucket 2, never full during backward: finish() sends it as zeros.
_toy = make_toy()
TOY_CAP = sum(p.numel() for p in _toy.hidden.parameters()) * 4 / MIB


def buckets(argv, world):
    """The buckets of main()'s ZeRO2Optimizer for the GPT of argv: bucket.py's BucketManager over
    the parameters in the model's order (main() passes bucket_order=model.parameters()), bucket 0
    capped at 1 MiB, each bucket padded to a multiple of N on its own."""
    args = common.parse_args(argv)
    model = GPT(common.model_config(args), seed=None).to(common.working_dtype(args))
    manager = load_lesson("bucket").BucketManager  # the graded bucket.py (graded.LESSONS_DIR)
    return manager(list(model.parameters()), args.bucket_mb, launch=None, grads_as_views=False, pad_to=world,
                   first_bucket_cap_mb=1).buckets


def layout(argv, world):
    """(padded Psi, number of buckets) of the GPT of argv in the lesson's buckets."""
    bs = buckets(argv, world)
    return sum(b.numel_padded for b in bs), len(bs)


def bucket_numels(argv, world):
    """Each bucket's parameter sizes, in its layout."""
    return [[p.numel() for p in b.params] for b in buckets(argv, world)]


def gradient_bound(argv, world):
    """The most gradient bytes 05 can hold during backward, from its layout: my slice of every
    bucket (kept, or arriving from its reduce-scatter; with micro-steps also the fp32 slices kept
    from the earlier ones), four consecutive full-size buckets (two in flight, the one filling
    and the next, which a gradient arriving ahead of bucket order starts: a norm's weight comes
    before its bias) and one p.grad between autograd and the hook that empties it."""
    args = common.parse_args(argv)
    nbytes = 2 if args.precision == "bf16" else 4
    bs = buckets(argv, world)
    slices = sum(b.numel_padded for b in bs) // world * (nbytes + (4 if args.grad_accum > 1 else 0))
    full = [b.numel_padded * nbytes for b in bs]
    largest = max(p.numel() for b in bs for p in b.params) * nbytes
    return slices + max(sum(full[i:i + 4]) for i in range(len(full))) + largest


# ----------------------------------------------------------------------------- in the ranks
def recorded(argv):
    """main() (run_lesson), and for each backward the gradient bytes that had arrived when
    bucket 0's reduce-scatter was issued (counted in the lesson's own gradient hook)."""
    cls = load_lesson(LESSON).ZeRO2Optimizer
    grad_ready, reduce_scatter = cls._grad_ready, cls._reduce_scatter
    arrived, at_first = [], []

    def counting(self, p):
        arrived.append(p.numel() * p.element_size())
        return grad_ready(self, p)

    def noting(self, bucket):
        if bucket.index == 0:
            at_first.append(sum(arrived))
        if bucket.index == len(self.grad_buckets.buckets) - 1:  # the backward's last: start again
            arrived.clear()
        return reduce_scatter(self, bucket)
    cls._grad_ready, cls._reduce_scatter = counting, noting
    try:
        out = run_lesson(LESSON, argv)
    finally:
        cls._grad_ready, cls._reduce_scatter = grad_ready, reduce_scatter
    return {**out, "arrived_at_first": at_first}


def suite(world):
    """Everything lesson 05 is checked on, in one launch per world size (start-up is costly)."""
    out = {
        "main": run_lesson(LESSON, ARGV + PEAKS),  # (PEAKS: the gradient bytes during backward)
        "accum_clip": run_lesson(LESSON, ACCUM_CLIP + PEAKS),
        "bf16": run_lesson(LESSON, BF16 + PEAKS),
        "torch": gpt_train("fsdp2_noreshard", ACCUM_CLIP),
        "toy": toy_train(build, "05", different_init=True),  # 25 MiB: one bucket
        "toy_accum_clip": toy_train(build, "05", grad_accum=3, grad_clip=0.05, different_init=True,
                                    bucket_mb=TOY_CAP),
        "toy_sgd": toy_train(build, "05", bucket_mb=TOY_CAP, **SGD),
    }
    if world == 4:  # (its per-operation sampling over 50 buckets takes 15 s; at 2 ranks, DEFAULT_MANY's 22)
        out["deep"] = run_lesson(LESSON, DEEP + PEAKS)
    if world == 2:
        out["default"] = recorded(DEFAULT + PEAKS)
        out["default_many"] = recorded(DEFAULT_MANY + PEAKS)
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


def peak_grads(report):
    """Per rank, the most gradient bytes alive during backward, measured after every tensor
    operation of the measured step (memory_ledger.Peaks)."""
    return [m["peak_grads"] for m in held(report)]


@pytest.mark.parametrize("world", [1, 2, 4])
def test_gradient_bytes_during_backward_are_my_slices_plus_the_buckets_in_flight(world):
    runs = [("main", ARGV), ("accum_clip", ACCUM_CLIP), ("bf16", BF16)]
    runs += [("deep", DEEP)] if world == 4 else []
    runs += [("default", DEFAULT), ("default_many", DEFAULT_MANY)] if world == 2 else []
    for key, argv in runs:
        report, bound = results(world)[0][key]["report"], gradient_bound(argv, world)
        assert all(0 < peak <= bound for peak in peak_grads(report)), key
        # the report's theory: the same bound, less the slices' padding (less than one element
        # per bucket, of at most 8 bytes: 4 more for the fp32 slices accumulated into)
        assert bound - 8 * layout(argv, world)[1] <= memory_theory(report)["peak_grads"] <= bound, key


@pytest.mark.parametrize("world", [2, 4])
def test_a_model_many_buckets_long_never_holds_its_whole_gradient(world):
    if world == 4:  # bf16, 50 buckets: even the bound is well below the whole gradient (ZeRO-1's 2 Psi)
        report = results(world)[0]["deep"]["report"]
        whole = 2 * report["n_params"]
        assert max(peak_grads(report)) <= gradient_bound(DEEP, world) < 0.8 * whole
        with contextlib.redirect_stdout(io.StringIO()) as printed:  # and the summary says in which precision
            print_summary(report)
        assert f"| the whole gradient {whole / MIB:.2f} (bf16)\n" in printed.getvalue(), printed.getvalue()
    if world == 2:  # the default GPT at --bucket-mb 0.25 (22 buckets), fp32: my slices are half of it
        report = results(2)[0]["default_many"]["report"]
        assert max(peak_grads(report)) <= gradient_bound(DEFAULT_MANY, 2) < 4 * report["n_params"]


def test_default_gpt_no_collective_takes_the_whole_gradient():
    # At the default 25 MiB the default GPT is two buckets: bucket 0, capped at 1 MiB as in 03
    # (0.76 MiB: the last block), and the rest (2.33 MiB): no call moves the whole gradient
    for key, argv in (("default", DEFAULT), ("default_many", DEFAULT_MANY)):
        report = results(2)[0][key]["report"]
        whole = 4 * report["n_params"]
        assert comm_ops(report)["reduce_scatter"]["calls"] == layout(argv, 2)[1] >= 2, key
        scatters = [nbytes for kind, nbytes in report["comm"]["calls"] if kind == "reduce_scatter"]
        assert scatters[0] <= MIB, key  # bucket 0, in issue order
        assert max(nbytes for _, nbytes in report["comm"]["calls"]) < whole, key


def test_default_gpt_first_reduce_scatter_starts_early_in_backward():
    # Bucket 0 holds the last layers, whose gradients come first: its reduce-scatter is issued
    # with most of the gradient still to compute. (Bucketed in decay-group order, every matrix
    # and then every bias and norm, it would wait for block 0's norms, at the end of backward.)
    for key in ("default", "default_many"):
        whole = 4 * results(2)[0][key]["report"]["n_params"]
        for rank, out in enumerate(results(2)):
            assert len(out[key]["arrived_at_first"]) == 2, key  # one per step (DEFAULT: 2 steps)
            for arrived in out[key]["arrived_at_first"]:
                assert arrived <= MIB < whole / 2, (key, rank, arrived)


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
