"""Lesson 08 (hybrid sharding, HSDP) against single-process training and PyTorch's FSDP2 HSDP
(`fully_shard` over a 2-D CPU DeviceMesh, which runs on gloo with torch 2.13), and its two links
and its memory against the formulas, measured. G ranks per shard group, R = N / G replicas.

4 ranks as G = 2 x R = 2 (the grid the lesson is about), also on lesson 00's ring over two
simulated nodes (--inter-link), beside 06 on the same nodes; 2 ranks as G = 2, R = 1 (one group:
06, bit for bit) and G = 1, R = 2 (one rank per group: replication, DDP's all-reduce)."""
import os
import statistics

import pytest
import torch

from harness import all_close, close, gpt_train, held, launches, memory_theory, reference, run_lesson
from lessons import build
from test_06_zero3 import padded, unit_params, units
from tolerances import FP16_LOSS_TOL, FP16_PARAM_TOL, TOL
from toy import make_toy, toy_batch, toy_reference, toy_train
from zero_parity import SGD, held_pieces

LESSON = "08_hybrid"
ARGV = ["--steps", "4", "--n-layer", "3", "--d-model", "32", "--seq-len", "16", "--global-batch", "16",
        "--log-every", "100"]
CLIP = 0.05  # acts at every step: a norm counted over the replicas too (R times each element) changes SGD's step
# Two simulated nodes of 2 ranks: a fast link inside each, a slow one between (its latency and
# bandwidth both well above what 4 ranks on 2 cores cost per send). No per-op sampling: timed.
NODES = ["--link", "10:5", "--inter-link", "0.01:2000", "--peak-params", "0"]
# fp16 on the 2 x 2 grid, 2 micro-steps, at a loss scale this GPT's gradients overflow at steps 0
# and 1 (measured): both skipped on every rank, as one process with the same scaler skips them
FP16 = ARGV + ["--precision", "fp16", "--loss-scale", str(2 ** 20), "--grad-accum", "2"]
GLOO_HEADER = 144  # bytes gloo writes beside each send's payload (test_ring_collectives measured it)


def suite(world):
    """Every run 08 is checked on at this world size, in one launch."""
    if world == 4:  # 2 x 2: G2_R2 without --shard-group, on two "nodes" of 2 (08's default G: the node)
        os.environ["LOCAL_WORLD_SIZE"] = "2"  # as torchrun --nnodes 2 --nproc_per_node 2 sets it
        return {"G2_R2": run_lesson(LESSON, ARGV),
                "hsdp": gpt_train("fsdp2_hsdp", ARGV, shard_group=2),
                # tied, frozen, unused and 119 elements (padded), ranks starting apart, 3 micro-steps
                "toy": toy_train(build, "08", grad_accum=3, different_init=True, shard_group=2),
                # SGD sees the gradient's scale (a mean over N, not G) and clipping's norm
                "toy_sgd_clip": toy_train(build, "08", steps=3, grad_clip=CLIP, shard_group=2, **SGD),
                "fp16": run_lesson(LESSON, FP16),
                # last: they leave the ring installed (the runs above use torch's collectives)
                "ring": run_lesson(LESSON, ARGV + ["--shard-group", "2", *NODES]),
                "zero3_ring": run_lesson("06_zero3", ARGV + ["--ranks-per-node", "2", *NODES])}
    return {"G2_R1": run_lesson(LESSON, ARGV), "zero3": run_lesson("06_zero3", ARGV),
            "G1_R2": run_lesson(LESSON, ARGV + ["--shard-group", "1"])}


results = launches(suite)
RUNS = [(4, "G2_R2", 2), (2, "G2_R1", 2), (2, "G1_R2", 1)]  # (world, key, G)


def toy_sgd_clip_reference(steps=3, lr=0.5):
    """One process, the whole batch: SGD after torch's global-norm clipping."""
    model = make_toy(seed=0)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(trainable, lr=lr)
    losses = []
    for step in range(steps):
        loss = model(*toy_batch(step))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def link(report, name):
    """One link's entry of the report: {"issued_ring_bytes_per_step", "theory_...", "ops", ...}."""
    return report["comm"]["per_link"][name]


# ----------------------------------------------------------------------------- parity
@pytest.mark.parametrize("world, key, g", RUNS)
def test_matches_single_process(world, key, g):
    all_close(reference(ARGV), results(world), (key,), TOL)


def test_fp16_on_the_2x2_grid_skips_the_same_steps_and_trains_as_one_process():
    # the found-inf flag over the world, 5b)'s all-reduce across the replicas, micro-steps adding
    # up in the fp32 shards: 4 steps, within the bounds tolerances.py sets for test_fp16's 6
    want = reference(FP16)
    assert want["loss_scale"]["skipped_steps"] == [0, 1]
    for rank, rank_out in enumerate(results(4)):
        got = rank_out["fp16"]
        torch.testing.assert_close(got["losses"], want["losses"], **FP16_LOSS_TOL, msg=f"rank {rank}")
        assert got["params"].keys() == want["params"].keys()
        for name, p in got["params"].items():
            torch.testing.assert_close(p, want["params"][name], **FP16_PARAM_TOL, msg=f"rank {rank} {name}")
    assert results(4)[0]["fp16"]["report"]["loss_scale"] == want["loss_scale"]  # the scale, the skips


def test_without_a_flag_the_shard_group_is_the_node():
    # torchrun's LOCAL_WORLD_SIZE 2 at world 4 (two nodes): G = 2, not plain ZeRO-3 over all 4;
    # on one node (G2_R1: LOCAL_WORLD_SIZE = world) G = N, and 08 is 06 (test below)
    assert results(4)[0]["G2_R2"]["report"]["config"]["shard_group"] == 2
    assert results(2)[0]["G2_R1"]["report"]["config"]["shard_group"] == 2


def test_2x2_matches_fsdp2_hsdp_and_the_edge_cases():
    all_close(reference(ARGV), results(4), ("hsdp",), TOL)
    for rank_out in results(4):
        close(rank_out["G2_R2"], rank_out["hsdp"], TOL)
    all_close(toy_reference(), results(4), ("toy",), TOL)
    all_close(toy_sgd_clip_reference(), results(4), ("toy_sgd_clip",), TOL)


def test_one_shard_group_is_06_bit_for_bit():
    # G = N: the same units, shards and collectives as 06 (over a group of every rank), and an
    # all-reduce over one rank, which adds nothing
    for rank_out in results(2):
        assert rank_out["G2_R1"]["losses"] == rank_out["zero3"]["losses"]
        for name, p in rank_out["zero3"]["params"].items():
            assert rank_out["G2_R1"]["params"][name].equal(p), name
    ours, theirs = results(2)[0]["G2_R1"]["report"], results(2)[0]["zero3"]["report"]  # (rank 0 reports)
    assert link(ours, "intra")["ops"] == theirs["comm"]["ops"]
    assert link(ours, "intra")["issued_ring_bytes_per_step"] == theirs["comm"]["issued_ring_bytes_per_step"]
    assert link(ours, "inter")["issued_ring_bytes_per_step"] == 0


def test_one_rank_per_group_is_replication():
    # G = 1: every rank holds the whole model; its gathers and reduce-scatters run over one rank
    # (nothing sent), and the gradient moves as DDP's does: one ring all-reduce of Psi
    report = results(2)[0]["G1_R2"]["report"]
    psi = report["n_params"]
    assert link(report, "intra")["issued_ring_bytes_per_step"] == 0
    assert link(report, "inter")["issued_ring_bytes_per_step"] == 2 * (2 - 1) / 2 * psi * 4
    assert all(mem["params"] == 4 * psi for mem in held(report))


# ----------------------------------------------------------------------------- the two links
@pytest.mark.parametrize("world, key, g", RUNS)
def test_bytes_per_link_equal_the_formulas(world, key, g):
    r = world // g
    numels, _ = units(ARGV)
    padded_psi = sum(padded(n, g) for n in numels)  # each unit padded to a multiple of G
    report = results(world)[0][key]["report"]  # rank 0's, counted from the calls it issued
    intra, inter = link(report, "intra"), link(report, "inter")
    # 06 inside the group: every unit gathered twice, its gradient reduce-scattered once, plus
    # clipping's fp32 scalar (summed over the shard group only)
    assert intra["ops"] == {"all_gather": {"calls": 2 * len(numels), "bytes": 2 * padded_psi * 4},
                            "reduce_scatter": {"calls": len(numels), "bytes": padded_psi * 4},
                            "all_reduce": {"calls": 1, "bytes": 4}}
    assert intra["issued_ring_bytes_per_step"] == pytest.approx(
        3 * (g - 1) / g * padded_psi * 4 + 2 * (g - 1) / g * 4, rel=1e-12)
    # across the replicas: each unit's gradient shard, all-reduced once
    assert inter["ops"] == {"all_reduce": {"calls": len(numels), "bytes": padded_psi // g * 4}}
    assert inter["issued_ring_bytes_per_step"] == pytest.approx(2 * (r - 1) / r * (padded_psi // g) * 4, rel=1e-12)
    # beside the formulas, intra 3 Psi (G-1)/G and inter 2 (Psi/G)(R-1)/R: within padding and the scalar
    psi = report["n_params"]
    assert intra["theory_ring_bytes_per_step"] == 3 * psi * (g - 1) / g * 4
    assert inter["theory_ring_bytes_per_step"] == 2 * psi / g * (r - 1) / r * 4
    for entry in (intra, inter):
        assert entry["issued_ring_bytes_per_step"] == pytest.approx(entry["theory_ring_bytes_per_step"], rel=1e-3)
    ranks = {"intra": g, "inter": r}
    assert {name: entry["ranks"] for name, entry in report["comm"]["per_link"].items()} == ranks


# ----------------------------------------------------------------------------- memory
@pytest.mark.parametrize("world, key, g", RUNS)
def test_memory_at_rest_is_my_shard_of_psi_over_g(world, key, g):
    numels, _ = units(ARGV)
    shard_bytes = sum(padded(n, g) // g for n in numels) * 4  # Psi/G, plus padding
    report = results(world)[0][key]["report"]
    for rank, mem in enumerate(held(report)):
        s = rank % g  # my place in my shard group: replicas hold the same shard
        assert mem["params"] == mem["grads"] == shard_bytes
        # AdamW's two moments of my trainable elements, and a step count per piece (as 06)
        mine = [min(max(n - s * padded(n, g) // g, 0), padded(n, g) // g) for n in numels]
        pieces = sum(held_pieces(unit, g, s)[0] for unit in unit_params(ARGV))
        assert mem["optimizer"] == sum(mine) * 8 + 4 * pieces
        assert mem["other"] == 0
    theory, psi = memory_theory(report), report["n_params"]
    assert (theory["params"], theory["grads"], theory["optimizer"]) == (4 * psi / g, 4 * psi / g, 8 * psi / g)


# ----------------------------------------------------------------------------- on the ring, on two nodes
def sends(ops, size):
    """The messages a rank sends for `ops` over a ring of `size` ranks: N - 1 per pass."""
    return sum(v["calls"] * (size - 1) * (2 if kind == "all_reduce" else 1) for kind, v in ops.items())


def test_on_the_ring_2x2_trains_as_on_torchs_collectives():
    # every sum inside a group has two terms (a + b is b + a): the same parameters bit for bit;
    # the logged loss is a mean over all 4 ranks, summed in the ring's order: round-off (TOL)
    for rank_out in results(4):
        ring, torch_ = rank_out["ring"], rank_out["G2_R2"]
        for name, p in torch_["params"].items():
            assert ring["params"][name].equal(p), name
        torch.testing.assert_close(ring["losses"], torch_["losses"], **TOL)


def test_on_the_ring_each_link_carries_its_formula_on_the_wire():
    report = results(4)[0]["ring"]["report"]
    for name in ("intra", "inter"):
        for rank, e in enumerate(link(report, name)["per_rank"]):
            wire, theory = e["wire_bytes_per_step"], e["theory_ring_bytes_per_step"]
            # measured per link: the payload, gloo's header on each send, and the heartbeat's few bytes
            headers = GLOO_HEADER * sends(e["ops"], e["ranks"])
            assert theory > 0 and abs(wire - headers - theory) <= 0.01 * theory, (name, rank, wire, headers, theory)


def test_06_on_two_nodes_crosses_at_two_hops_and_08_at_its_replicate_ring():
    # 06's one ring 0 -> 1 -> 2 -> 3 -> 0 leaves a node at ranks 1 and 3, and everything they send
    # goes over the slow link; 08's shard rings stay inside the nodes, its replicate rings cross
    ours, theirs = link(results(4)[0]["ring"]["report"], "inter"), link(results(4)[0]["zero3_ring"]["report"], "inter")
    zero3 = results(4)[0]["zero3_ring"]["report"]["comm"]
    assert [e["group"] for e in theirs["per_rank"]] == [None, "world", None, "world"]
    for rank, e in enumerate(theirs["per_rank"]):
        crosses = rank in (1, 3)
        assert e["theory_ring_bytes_per_step"] == (zero3["theory_ring_bytes_per_step"] if crosses else 0)
        headers = GLOO_HEADER * sends(e["ops"], 4)
        assert abs(e["wire_bytes_per_step"] - headers - e["theory_ring_bytes_per_step"]) <= 0.01 * zero3[
            "theory_ring_bytes_per_step"], (rank, e)
    assert [e["group"] for e in ours["per_rank"]] == ["replicate"] * 4
    # per rank between nodes: 08 sends 2 (Psi/G)(R-1)/R = Psi/2, 06's crossing ranks 3 Psi (N-1)/N = 9/4 Psi
    assert theirs["per_rank"][1]["theory_ring_bytes_per_step"] == 4.5 * ours["theory_ring_bytes_per_step"]


def test_on_a_slow_link_between_nodes_08_steps_faster_than_06():
    # 06's slow hops carry 9/4 Psi a step, in 3 sends a collective; 08's Psi/2, in 1. The link
    # between nodes must cost far more than a step's compute, or a slower CPU closes the gap: at
    # 0.05:1000, 08's median step was 0.45-0.6 of 06's (51-68 ms against 111-115), but 0.75 on a
    # machine 2.3x slower (107 ms against 142); at 0.01:2000 there, 0.39 (157 ms against 407)
    ours, theirs = (statistics.median(results(4)[0][key]["report"]["step_time_s"]) for key in ("ring", "zero3_ring"))
    assert ours < 0.75 * theirs, (ours, theirs)
