"""Gradient accumulation without a collective per micro-step (05-08): --reduce-every step (05's
no_sync(), 06-08's set_requires_gradient_sync(False): the whole gradient held in fp32, reduce-
scattered once a step) and 08's --all-reduce-every step (set_requires_all_reduce(False): reduce-
scattered in the shard group at each micro-step, all-reduced across the replicas once). Each
against one process on the whole batch, and against FSDP2 with the same setting, driven by the
same loop (tests/lessons.py), bit for bit; the bytes each choice sends and the gradient bytes it
holds between micro-steps, measured, against theory.py's formulas."""
import pytest
import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

from harness import all_close, close, gpt_train, launches, reference, run_lesson
from lessons import build
from routing import routed_reference, routed_train
from stream_semantics import StreamSemantics
from test_06_zero3 import padded, units, zero3_bf16_close
from tolerances import TOL
from toy import toy_reference, toy_train

K = 4
# clipping off: FSDP2's norm over DTensors sums in another order, so where it bites the last bits
# differ (test_fp16 says so too); 4 steps of 4 micro-steps
ARGV = ["--steps", "4", "--n-layer", "3", "--d-model", "32", "--seq-len", "16", "--global-batch", "16",
        "--log-every", "100", "--grad-clip", "0", "--grad-accum", str(K)]
ONCE, AR_ONCE = ["--reduce-every", "step"], ["--all-reduce-every", "step"]
FILES = {"05": "05_zero2", "06": "06_zero3", "07": "07_offload", "08": "08_hybrid"}
EXACT = dict(rtol=0, atol=0)
MIXED = {"bf16": torch.bfloat16, "fp16": torch.float16}


def grid(world):
    """08's G: with replicas wherever there are two ranks (2: 1 x 2; 4: 2 x 2)."""
    return 2 if world == 4 else 1


def suite(world):
    g = grid(world)
    shard = ["--shard-group", str(g)]
    out = {n: run_lesson(f, ARGV + ONCE + (shard if n == "08" else [])) for n, f in FILES.items()}
    out["08_ar"] = run_lesson("08_hybrid", ARGV + AR_ONCE + shard)
    out["08_ar_bf16"] = run_lesson("08_hybrid", ARGV + AR_ONCE + shard + ["--precision", "bf16"])
    out["06_bf16"] = run_lesson("06_zero3", ARGV + ONCE + ["--precision", "bf16"])
    out["fsdp2"] = gpt_train("fsdp2", ARGV + ONCE)
    out["hsdp_ar"] = gpt_train("fsdp2_hsdp", ARGV + AR_ONCE, shard_group=g)
    out["hsdp"] = gpt_train("fsdp2_hsdp", ARGV + ONCE, shard_group=g)
    # the toy: tied, frozen and unused parameters, 119 elements, ranks starting apart, 3 micro-steps
    toy = dict(grad_accum=3, different_init=True)  # (FSDP2 broadcasts nothing: its ranks start alike)
    for n in FILES:
        out[f"toy_{n}"] = toy_train(build, n, reduce_every="step", shard_group=g, **toy)
    out["toy_08_ar"] = toy_train(build, "08", all_reduce_every="step", shard_group=g, **toy)
    # 08 built with no grid (no replicas: nothing to defer), find_unused_parameters and weight decay,
    # which moves a parameter handed a zero gradient where one process hands it none
    out["toy_08_alone"] = toy_train(build, "08", all_reduce_every="step", defaults=True, find_unused=True,
                                    weight_decay=0.1, **toy)
    out["toy_fsdp2"] = toy_train(build, "fsdp2", reduce_every="step", grad_accum=3)
    out["toy_hsdp_ar"] = toy_train(build, "fsdp2_hsdp", all_reduce_every="step", shard_group=g, grad_accum=3)
    out["toy_hsdp"] = toy_train(build, "fsdp2_hsdp", reduce_every="step", shard_group=g, grad_accum=3)
    # mixed precision accumulating in fp32 in both (FSDP2: a reduce_dtype of fp32; its bf16 one
    # accumulates in bf16, which no lesson does)
    for name, dtype in MIXED.items():
        policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
        for lesson in ("06", "fsdp2"):
            out[f"toy_{lesson}_{name}"] = toy_train(build, lesson, reduce_every="step", mp_policy=policy, grad_accum=3)
        for lesson in ("08", "fsdp2_hsdp"):
            out[f"toy_{lesson}_{name}_ar"] = toy_train(build, lesson, all_reduce_every="step", mp_policy=policy,
                                                       shard_group=g, grad_accum=3)
    # experts some ranks' rows skip in some micro-steps: a parameter whose gradient came in an
    # early micro-step only, or on other ranks only; under NCCL's stream semantics (an output is
    # NaN until wait(), an input untouched until then: tests/stream_semantics.py)
    with StreamSemantics():
        for n in FILES:
            out[f"routed_{n}"] = routed_train(build, n, find_unused=True, grad_accum=2, reduce_every="step", shard_group=g)
        out["routed_08_ar"] = routed_train(build, "08", find_unused=True, grad_accum=2, all_reduce_every="step",
                                           shard_group=g)
    return out


results = launches(suite)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_reducing_once_trains_as_one_process(world):
    all_close(reference(ARGV), results(world), (*FILES, "08_ar", "fsdp2", "hsdp_ar", "hsdp"), TOL)
    all_close(toy_reference(), results(world), [f"toy_{n}" for n in (*FILES, "08_ar", "fsdp2", "hsdp_ar")], TOL)
    all_close(toy_reference(weight_decay=0.1), results(world), ["toy_08_alone"], TOL)
    all_close(routed_reference(world, grad_accum=2), results(world), [f"routed_{n}" for n in (*FILES, "08_ar")], TOL)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_in_bf16_reducing_once_trains_as_one_process_does(world):
    # the lessons' own bf16: the fp32 sum rounded once for a bf16 collective (test_accumulation
    # holds that arithmetic bit for bit), held to 06's bf16 bounds against the bf16 reference
    ref = reference(ARGV + ["--precision", "bf16"])
    for rank_out in results(world):
        for key in ("06_bf16", "08_ar_bf16"):
            zero3_bf16_close(rank_out[key], ref)


def same_weights(lesson, counterpart):
    """A lesson's main() against its counterpart in harness.gpt_train's loop: the weights bit for
    bit; the logged losses within TOL (main() adds the micro-steps' losses up as one tensor, the
    loop as Python floats: their last bits differ, not the training)."""
    torch.testing.assert_close(lesson["losses"], counterpart["losses"], **TOL)
    close({**lesson, "losses": []}, {**counterpart, "losses": []}, EXACT)


@pytest.mark.parametrize("world", [2])
def test_reducing_once_is_fsdp2_with_the_same_setting_bit_for_bit(world):
    # 07 does 06's arithmetic on the host; 08 at G = 1 x R = 2 is FSDP2's HSDP on a 2 x 1 mesh.
    # (At 4 ranks FSDP2's weights are already ~2e-6 from 06's when every micro-step reduces,
    # measured: its own test_06 holds it to TOL there, and test_reducing_once_trains_as_one_process
    # holds these.)
    for rank_out in results(world):
        for lesson in ("06", "07"):
            same_weights(rank_out[lesson], rank_out["fsdp2"])
            close(rank_out[f"toy_{lesson}"], rank_out["toy_fsdp2"], EXACT)
        same_weights(rank_out["08_ar"], rank_out["hsdp_ar"])
        same_weights(rank_out["08"], rank_out["hsdp"])
        close(rank_out["toy_08"], rank_out["toy_hsdp"], EXACT)
        close(rank_out["toy_08_ar"], rank_out["toy_hsdp_ar"], EXACT)
        for name in MIXED:
            close(rank_out[f"toy_06_{name}"], rank_out[f"toy_fsdp2_{name}"], EXACT)
            close(rank_out[f"toy_08_{name}_ar"], rank_out[f"toy_fsdp2_hsdp_{name}_ar"], EXACT)


@pytest.mark.parametrize("world", [2, 4])
def test_bytes_sent_and_gradients_held_are_their_formulas(world):
    numels, _ = units(ARGV)
    g = grid(world)
    for key in (*FILES, "08_ar", "08_ar_bf16"):
        report, b = results(world)[0][key]["report"], 2 if key.endswith("bf16") else 4
        n = g if key.startswith("08") else world  # the ranks a unit is cut over
        whole, shards = sum(padded(x, n) for x in numels), sum(padded(x, n) // n for x in numels)
        ops = report["comm"]["ops"]
        held = report["memory"]["per_rank"][0]["held_grads"]
        theory = report["memory"]["theory"]["held_grads"]
        if key == "05":  # its buckets: one reduce-scatter each, once; the whole p.grad held
            assert ops["reduce_scatter"]["calls"] == ops["all_gather"]["calls"]
            assert held == theory == 4 * report["n_params"]
        elif key in FILES:  # a reduce-scatter per unit, once; every unit's fp32 sum held
            assert ops["reduce_scatter"] == {"calls": len(numels), "bytes": whole * b}
            assert ops["all_gather"]["calls"] == 2 * K * len(numels)
            assert held == 4 * whole and theory == 4 * report["n_params"]
        else:  # 08 --all-reduce-every step: reduce-scatters each micro-step, one all-reduce per unit
            assert ops["reduce_scatter"]["calls"] == K * len(numels)
            assert report["comm"]["per_rank"][0]["all_reduce"]["calls"] == len(numels) + (g < world and 0)
            assert held == 4 * shards and theory == 4 * report["n_params"] / n
        if "per_link" in report["comm"]:  # 08: each link beside its formula
            for link in report["comm"]["per_link"].values():
                assert link["issued_ring_bytes_per_step"] == pytest.approx(link["theory_ring_bytes_per_step"], rel=0.02)
        assert report["comm"]["issued_ring_bytes_per_step"] == pytest.approx(
            report["comm"]["theory_ring_bytes_per_step"], rel=0.02)  # (padding: under 2% here)
