"""Lesson 03 against single-process training and PyTorch's DistributedDataParallel, at bucket
caps that make one bucket, two, and one per parameter tensor."""
import pytest
import torch.distributed as dist

from lessonkit import common
import harness
from harness import (PEAKS, REPLICATED_GPT, REPLICATED_TOY, all_close, bf16_close, comm_ops, gpt_train, launches,
                     recording, reference, replicated_bf16_memory, replicated_runs, run_lesson, sent_bytes,
                     theory_bytes, toy_reference_grads)
from lessons import build
from lessonkit.comm_meter import CommMeter
from model import GPT
from tolerances import GRAD_TOL, TOL
from toy import make_toy, toy_reference, toy_train

LESSON = "03_buckets"
ARGV = ["--steps", "6", "--n-layer", "2", "--d-model", "32", "--seq-len", "16",
        "--global-batch", "8", "--log-every", "100"]
BF16 = ARGV + ["--precision", "bf16"]
MIB = 2 ** 20

# ----------------------------------------------------------------------------- bucket caps
# The GPT of ARGV: Psi parameters in N_TENSORS tensors, the largest of LARGEST elements.
_gpt = GPT(common.model_config(common.parse_args(ARGV)), seed=None)
N_TENSORS = len({id(p) for p in _gpt.parameters()})  # the tied embedding/head once
PSI, LARGEST = common.n_params(_gpt), max(p.numel() for p in _gpt.parameters())
assert PSI / 2 > LARGEST  # so the model does not fit in a cap of Psi/2 + LARGEST elements
# Two buckets: bucket 0 is closed only when the next gradient would overflow the cap, so it
# holds more than cap - LARGEST = Psi/2 elements; the rest, fewer than Psi/2, fit in bucket 1.
# One byte: every tensor is bigger than the cap, so each gets a bucket of its own.
GPT_CAPS = {1: 25.0, 2: (PSI // 2 + LARGEST) * 4 / MIB, N_TENSORS: 1 / MIB}  # buckets: cap (MiB)
# The toy, in bucket order (reverse registration; a module's own parameter `unused` registers
# before its children's): hidden.bias, hidden.weight, emb.weight (tied to the head), unused.
# A cap of exactly hidden's elements fills bucket 0 to the byte; the embedding, bigger than the
# cap, gets bucket 1 to itself; `unused` (never gets a gradient) is alone in bucket 2, which is
# never full during backward: finish() must send it, as zeros.
_toy = make_toy()
_trainable = [p for p in {id(p): p for p in _toy.parameters()}.values() if p.requires_grad]
TOY_ELEMS = sum(p.numel() for p in _trainable)
TOY_HIDDEN = sum(p.numel() for p in _toy.hidden.parameters())
assert _toy.emb.weight.numel() > TOY_HIDDEN
TOY_CAPS = {1: 25.0, 3: TOY_HIDDEN * 4 / MIB, len(_trainable): 1 / MIB}  # buckets: cap (MiB)


# ----------------------------------------------------------------------------- in the ranks
def metered(train, *args, **kw):
    """Run a training function with every collective counted from outside (comm_meter.CommMeter).
    Cheaper than main()'s report, which also samples memory after every operation."""
    meter = CommMeter(dist.get_world_size())
    with meter.measuring():
        out = train(*args, **kw)
    return {**out, "all_reduce": meter.ops["all_reduce"]}


def toy_run(cap_mb, **kw):
    """Train the toy with this cap, recording the gradients the optimizer is given."""
    grads, storages = [], []
    out = metered(toy_train, recording(build, grads, storages), "03", bucket_mb=cap_mb, find_unused=True, **kw)
    return {**out, "grads": grads, "storages": storages}


def gpt_run(argv, cap_mb):
    return metered(gpt_train, "03", argv + ["--bucket-mb", repr(cap_mb)])


def suite(world):
    """Everything lesson 03 is checked on, in one launch per world size (start-up is costly)."""
    out = {
        **replicated_runs(LESSON, ARGV),  # main(): the default 25 MiB, one bucket
        "gpt_caps": {n: gpt_run(ARGV, cap) for n, cap in GPT_CAPS.items()},
        "gpt_two_accum": gpt_run(ARGV + ["--grad-accum", "2"], GPT_CAPS[2]),
        "toy_caps": {n: toy_run(cap, grad_accum=3, different_init=True) for n, cap in TOY_CAPS.items()},
    }
    if world == 2:
        out["bf16"] = run_lesson(LESSON, BF16 + PEAKS)  # its memory: peak_params too
        out["bf16_ddp"] = gpt_train("ddp", BF16)
        out["bf16_cap2"] = gpt_run(BF16, GPT_CAPS[2])
    return out


results = launches(suite)  # one launch per world size, a failed one remembered too


# ----------------------------------------------------------------------------- comparisons
def all_reduces(report):
    ops = comm_ops(report)
    assert list(ops) == ["all_reduce"]
    return ops["all_reduce"]


# ----------------------------------------------------------------------------- the tests
@pytest.mark.parametrize("world", [1, 2, 4])
def test_gpt_matches_single_process_and_ddp_at_every_bucket_count(world):
    caps = tuple(("gpt_caps", n) for n in GPT_CAPS)
    all_close(reference(ARGV), results(world), REPLICATED_GPT + caps + ("gpt_two_accum",), TOL)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_one_all_reduce_per_bucket_and_ring_bytes_equal_theory(world):
    out = results(world)[0]
    report = out["main"]["report"]  # main() at the default cap: the whole model in one bucket
    assert report["n_params"] == PSI and len(out["main"]["params"]) == N_TENSORS
    assert all_reduces(report) == {"calls": 1, "bytes": PSI * 4}  # exact: every gradient once
    assert sent_bytes(report) == theory_bytes(report)
    assert sent_bytes(report) == 2 * (world - 1) / world * PSI * 4
    # gradient accumulation: the non-final micro-steps communicate nothing
    assert comm_ops(out["accum"]["report"]) == comm_ops(report)
    # Other caps, counted over the whole run: the harness also all-reduces each step's loss
    # (one fp32 scalar), so per step there are n_buckets + 1 calls and Psi * 4 + 4 bytes.
    steps = len(out["main"]["losses"])
    runs = [(n, out["gpt_caps"][n]) for n in GPT_CAPS] + [(2, out["gpt_two_accum"])]
    for n_buckets, run in runs:
        assert run["all_reduce"] == {"calls": steps * (n_buckets + 1), "bytes": steps * (PSI * 4 + 4)}


@pytest.mark.parametrize("world", [1, 2, 4])
def test_edge_cases_tied_frozen_unused_different_init_accumulation(world):
    caps = tuple(("toy_caps", n) for n in TOY_CAPS)
    all_close(toy_reference(), results(world), REPLICATED_TOY + caps, TOL)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_gradients_are_the_whole_batch_gradient_in_views_of_the_buckets(world):
    want = toy_reference_grads()
    for rank_out in results(world):
        for n_buckets, run in rank_out["toy_caps"].items():
            harness.grads_close(run["grads"], want, GRAD_TOL)
            # toy_train also all-reduces each step's loss once, and find_unused_parameters one
            # fp32 flag per trainable parameter
            steps = len(run["losses"])
            assert run["all_reduce"] == {"calls": steps * (n_buckets + 2),
                                         "bytes": steps * (TOY_ELEMS * 4 + 4 + len(_trainable) * 4)}, f"{n_buckets} buckets"
            # The gradients live in the flat buffers, allocated once (the same storages every
            # step) and sized exactly to the trainable parameters: views, not copies. `unused`
            # gets no gradient (zeros go in its place), as in one process and with DDP, so with
            # more than one bucket, where it has one of its own, no gradient views that bucket.
            storages, alone = run["storages"], n_buckets > 1
            assert all(s == storages[0] for s in storages)
            assert len(storages[0]) == n_buckets - alone
            assert sum(nbytes for _, nbytes in storages[0]) == (TOY_ELEMS - alone * _toy.unused.numel()) * 4
            assert "unused" not in run["grads"][0]


def test_bf16_matches_reference_and_ddp_and_memory_equals_theory():
    ref = reference(BF16)
    for rank_out in results(2):
        bf16_close(rank_out["bf16"], ref)
        # Against DDP the arithmetic is the same, element by element: bf16 gradients divided by
        # 2, then a sum of two numbers (commutative in IEEE, whatever the order): bit-identical.
        harness.close(rank_out["bf16"], rank_out["bf16_ddp"], tol=dict(rtol=0, atol=0))
        harness.close(rank_out["bf16_cap2"], rank_out["bf16"], tol=dict(rtol=0, atol=0))  # 1 bucket too
    out = results(2)[0]
    report = out["bf16"]["report"]
    assert all_reduces(report)["bytes"] == PSI * 2  # bf16 collectives
    # The cap counts the gradients' real bytes: bf16 gradients are half the size, so the cap
    # that makes two fp32 buckets holds the whole bf16 model in one (plus the loss's all-reduce).
    steps = len(out["bf16"]["losses"])
    assert out["bf16_cap2"]["all_reduce"] == {"calls": steps * 2, "bytes": steps * (PSI * 2 + 4)}
    # gradients: 2 Psi, the bucket buffers are the gradients (no extra copy)
    replicated_bf16_memory(report, PSI, N_TENSORS)
