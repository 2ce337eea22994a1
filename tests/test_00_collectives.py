"""Lesson 00: the ring collectives built from sends, against torch.distributed's own, and the
bytes each rank sends against Psi (N-1)/N, at 1, 2, 3 and 4 ranks."""
import json

import pytest

import harness
from graded import load_lesson
from harness import spawn
from lessonkit import common
from model import GPT

# A small GPT's Psi (the collectives move Psi fp32 elements): quick, and no world size divides it
ARGV = ["--n-layer", "1", "--d-model", "33", "--n-head", "3", "--vocab-size", "65", "--device", "cpu"]
PSI = common.n_params(GPT(common.model_config(common.parse_args(ARGV))))  # counted here, not taken from the run


def run(argv):
    """In a spawned rank: the lesson's main(), which returns every rank's results."""
    return load_lesson("00_collectives").main(argv)


@harness.once
def results(world):
    return spawn(world, run, ARGV)[0]  # every rank returns all ranks' results: take rank 0's


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_ring_collectives_equal_torch_exactly(world):
    # integer-valued fp32 data: every sum is exact in any order, so equality is the test
    # (main() compares with torch on the page; test_ring_collectives_equal_the_sums_made_here, below, in the test)
    for rank, out in enumerate(results(world)):
        for kind in ("reduce_scatter", "all_gather", "all_reduce"):
            assert out[kind]["equal_to_torch"], (rank, kind)


def ring_against_sums(chunk):
    """In a spawned rank: 00's Ring on integer-valued data that every rank makes for every rank,
    against the sums and slices made here (no collective on this side)."""
    import torch
    import torch.distributed as dist
    n, r = dist.get_world_size(), dist.get_rank()
    data = [torch.randint(-8, 8, (n * chunk,), generator=torch.Generator().manual_seed(100 + k)).float() for k in range(n)]
    total, mine = torch.stack(data).sum(0), slice(r * chunk, (r + 1) * chunk)
    ring = load_lesson("00_collectives").Ring()
    return {"reduce_scatter": torch.equal(ring.reduce_scatter(data[r].clone()), total[mine]),
            "all_gather": torch.equal(ring.all_gather(data[r][mine].clone()),
                                      torch.cat([d[k * chunk:(k + 1) * chunk] for k, d in enumerate(data)])),
            "all_reduce": torch.equal(ring.all_reduce(data[r].clone()), total)}


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_ring_collectives_equal_the_sums_made_here(world):
    for rank, out in enumerate(spawn(world, ring_against_sums, 37)):
        assert out == dict.fromkeys(("reduce_scatter", "all_gather", "all_reduce"), True), rank


@pytest.mark.parametrize("world", [2, 3, 4])
def test_each_rank_sends_psi_n_minus_1_over_n_per_pass(world):
    numel = -(-PSI // world) * world  # padded to a multiple of N
    for out in results(world):
        rs, ag, ar = out["reduce_scatter"], out["all_gather"], out["all_reduce"]
        # counted at our own sends: exactly (N-1) chunks of numel/N fp32 elements per pass
        assert rs["sent_bytes"] == ag["sent_bytes"] == rs["ring_bytes"] == (world - 1) * numel // world * 4
        assert ar["sent_bytes"] == 2 * rs["sent_bytes"] == ar["ring_bytes"]
        # what the process wrote to the wire (gloo over TCP): the same, plus gloo's headers,
        # a few hundred bytes per message (measured: under 0.1 %); 1 % + 4 KiB is generous
        for o in (rs, ag, ar):
            assert o["sent_bytes"] <= o["wire_bytes"] <= 1.01 * o["sent_bytes"] + 4096
        # gloo's own reduce-scatter is an all-reduce underneath: it writes what an all-reduce
        # writes, twice the ring's (N-1)/N; its all-gather writes what ours does
        assert ar["torch_wire_bytes"] * 0.99 <= rs["torch_wire_bytes"] <= ar["torch_wire_bytes"] * 1.01
        assert ag["sent_bytes"] <= ag["torch_wire_bytes"] <= 1.01 * ag["sent_bytes"] + 4096


def test_report_has_the_lessons_fields_and_every_ranks_counts(tmp_path):
    path = tmp_path / "report.json"
    gathered = spawn(2, run, ARGV + ["--report", str(path)])[0]
    report = json.loads(path.read_text())
    assert (report["strategy"], report["world_size"], report["backend"]) == ("collectives", 2, "gloo")
    assert report["config"]["n_layer"] == 1 and (report["n_params"], report["numel"]) == (PSI, PSI + PSI % 2)
    assert report["comm"]["per_rank"] == gathered


def point_to_point_calls():
    """In a spawned rank: 00's all-reduce with torch.distributed's point-to-point calls
    recorded, in order: ("bare", kind, peer) for a call outside batch_isend_irecv, and
    ("group", [(kind, peer), ...]) for one batch_isend_irecv."""
    import torch
    import torch.distributed as dist
    calls, real = [], {name: getattr(dist, name) for name in ("send", "recv", "isend", "irecv")}
    real_p2p_op, real_batch = dist.P2POp, dist.batch_isend_irecv
    unwrapped = {}  # recording wrapper -> the real function (P2POp accepts only the real ones)

    def recorded(name):
        def call(tensor, peer=None, *args, **kwargs):
            calls.append(("bare", name, peer))
            return real[name](tensor, peer, *args, **kwargs)
        unwrapped[call] = real[name]
        return call

    def p2p_op(op, tensor, peer=None, *args, **kwargs):
        return real_p2p_op(unwrapped.get(op, op), tensor, peer, *args, **kwargs)

    def batch(ops):
        calls.append(("group", [(p.op.__name__, p.peer) for p in ops]))
        return real_batch(ops)

    for name in real:
        setattr(dist, name, recorded(name))
    dist.P2POp, dist.batch_isend_irecv = p2p_op, batch
    try:
        ring = load_lesson("00_collectives").Ring()
        x = torch.arange(3.0 * dist.get_world_size()) * (dist.get_rank() + 1)
        got = ring.all_reduce(x)
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)
        dist.P2POp, dist.batch_isend_irecv = real_p2p_op, real_batch
    dist.all_reduce(x)
    return torch.equal(got, x), ring.right, ring.left, calls


@pytest.mark.parametrize("world", [2, 3])
def test_every_exchange_is_one_grouped_send_and_receive(world):
    # NCCL deadlocks on an isend followed by a blocking recv when the peer does the same (at
    # N = 2 the right neighbour is the left one): a send and a receive that must progress
    # together go in one batch_isend_irecv. gloo does not deadlock, so the calls are the test:
    # each of an all-reduce's 2 (N - 1) exchanges is one group of exactly an isend to the right
    # and an irecv from the left, and nothing is sent or received outside a group.
    for equal, right, left, calls in spawn(world, point_to_point_calls):
        assert equal
        assert calls == [("group", [("isend", right), ("irecv", left)])] * (2 * (world - 1)), calls


def test_on_a_simulated_link_each_pass_costs_the_alpha_beta_formula():
    # --link 0.01:100: each of the N - 1 sends of a pass costs 100 us + its bytes at 0.01 Gb/s:
    # ~25 ms a pass for this Psi, held by the link, plus what the machine adds (the first send
    # also connects the pair): under 20% + 10 ms, where a send charged twice would be 100% more
    for out in spawn(2, run, ARGV + ["--link", "0.01:100"])[0]:
        for kind in ("reduce_scatter", "all_gather", "all_reduce"):
            o = out[kind]
            assert o["equal_to_torch"]
            assert o["link_seconds"] <= o["seconds"] <= 1.2 * o["link_seconds"] + 0.01, (kind, o)
