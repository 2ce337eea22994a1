"""Lesson 00: the ring collectives built from sends, against torch.distributed's own, and the
bytes each rank sends against Psi (N-1)/N, at 1, 2, 3 and 4 ranks."""
import json

import pytest

import harness
from graded import load_lesson
from harness import spawn

# A small GPT's Psi (the collectives move Psi fp32 elements): quick, and no world size divides it
ARGV = ["--n-layer", "1", "--d-model", "33", "--n-head", "3", "--vocab-size", "65", "--device", "cpu"]


def run(argv):
    """In a spawned rank: the lesson's main(), which returns every rank's results."""
    return load_lesson("00_collectives").main(argv)


@harness.once
def results(world):
    return spawn(world, run, ARGV)[0]  # every rank returns all ranks' results: take rank 0's


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_ring_collectives_equal_torch_exactly(world):
    # integer-valued fp32 data: every sum is exact in any order, so equality is the test
    for rank, out in enumerate(results(world)):
        for kind in ("reduce_scatter", "all_gather", "all_reduce"):
            assert out[kind]["equal_to_torch"], (rank, kind)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_each_rank_sends_psi_n_minus_1_over_n_per_pass(world):
    for out in results(world):
        rs, ag, ar = out["reduce_scatter"], out["all_gather"], out["all_reduce"]
        # counted at our own sends: exactly (N-1) chunks of numel/N fp32 elements per pass
        numel = rs["ring_bytes"] * world // ((world - 1) * 4)
        assert numel % world == 0 and rs["sent_bytes"] == ag["sent_bytes"] == (world - 1) * numel // world * 4
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
    assert report["config"]["n_layer"] == 1 and report["n_params"] <= report["numel"]
    assert report["comm"]["per_rank"] == gathered
