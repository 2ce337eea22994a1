"""The at-scale cost model (scripts/learn/cost_model.py) and its command (scripts/learn/at_scale.py):
ring costs to the formula, the calibration reproducing synthetic measurements (and failing when
they disagree), the published checks within their tolerances, and one-line errors for bad input.
Pure arithmetic: no lesson is launched here (a few seconds)."""
import subprocess
import sys
from dataclasses import replace

import pytest

from harness import ROOT
from scripts.learn import at_scale
from scripts.learn.cost_model import (CLUSTERS, LESSONS, MODELS, OPS, STAGES, GPU, Cluster, Link, Workload,
                                      collective_time, gpt, ring_time, step)
from theory import theory_ring_bytes

# powers of two: every product and quotient below is exact in floating point
LINK = Link({op: 2.0 ** 30 for op in OPS}, {op: 2.0 ** -20 for op in OPS})
SLOW = Link({op: 2.0 ** 25 for op in OPS}, {op: 2.0 ** -16 for op in OPS})


@pytest.mark.parametrize("n", [2, 4, 8])
def test_ring_costs_are_the_ring_formulas(n):
    s, a, b = 2.0 ** 28, 2.0 ** -20, 2.0 ** 30
    assert ring_time("all_reduce", s, n, LINK) == 2 * (n - 1) * a + 2 * (n - 1) / n * s / b
    assert ring_time("reduce_scatter", s, n, LINK) == (n - 1) * a + (n - 1) / n * s / b
    assert ring_time("all_gather", s, n, LINK) == (n - 1) * a + (n - 1) / n * s / b
    assert ring_time("all_reduce", s, 1, LINK) == 0


def test_hierarchical_cost_is_intra_node_then_inter_node():
    cluster = Cluster(GPU("x", 1e15, 8e10, 1e12), 8, LINK, SLOW)
    s = 2.0 ** 28
    for op in OPS:
        # one node: the flat ring over NVLink; 4 nodes: + a ring of 4 over the NIC on 1/8 of S
        assert collective_time(op, s, 4, cluster) == ring_time(op, s, 4, LINK)
        assert collective_time(op, s, 32, cluster) == ring_time(op, s, 8, LINK) + ring_time(op, s / 8, 4, SLOW)
    # reduce-scatter, written out: 7 alpha_intra + 7/8 S / B_intra + 3 alpha_inter + 3/4 (S/8) / B_inter
    assert collective_time("reduce_scatter", s, 32, cluster) == \
        7 * 2.0 ** -20 + 7 / 8 * s / 2.0 ** 30 + 3 * 2.0 ** -16 + 3 / 4 * (s / 8) / 2.0 ** 25


@pytest.mark.parametrize("stage", list(STAGES))
def test_bytes_per_step_are_the_zero_papers(stage):
    # what the stages send per rank: 2 Psi (N-1)/N (DP, ZeRO-1/2), 3 Psi (N-1)/N (ZeRO-3), section 7
    w, n = Workload(MODELS["llama3-8b"], 1, 4096), 64
    r = step(w, STAGES[stage], n, CLUSTERS["h100"])
    from theory import RING_FACTOR
    sent = sum(RING_FACTOR[op](n) * c["bytes"] for op, c in r["comm"].items())
    strategy = {"dp": "vanilla_dp", "zero1": "zero1", "zero2": "zero2"}.get(stage, "zero3")
    assert sent == pytest.approx(theory_ring_bytes(strategy, w.model.params, n, "bf16"), rel=1e-12)


def test_prefetch_hides_what_no_prefetch_exposes():
    w, c = Workload(MODELS["llama3-8b"], 2, 8192, "selective"), CLUSTERS["h100"]
    pre, nopre = step(w, STAGES["zero3"], 64, c), step(w, STAGES["zero3-noprefetch"], 64, c)
    assert pre["comm_s"] == nopre["comm_s"]
    all_gathers = nopre["comm"]["all_gather"]["s"]
    assert nopre["exposed_s"] >= all_gathers  # every gather waited for, nothing beside it
    # compute-bound at 64 GPUs: exposed only what 06 has nothing to hide behind, the root's two
    # gathers (at the start of forward and of backward), and the two reduce-scatters left when
    # backward ends: the first block's and the root's
    root, block = w.model.root * 2, (w.model.params - w.model.root) / w.model.layers * 2
    tail = 2 * collective_time("all_gather", root, 64, c) + collective_time("reduce_scatter", root, 64, c) \
        + collective_time("reduce_scatter", block, 64, c)
    assert pre["exposed_s"] == pytest.approx(tail, rel=1e-9)


# ----------------------------------------------------------------------------- calibration
def synthetic_calibration(overlap_in_truth=0.25):
    """A calibration.json as --calibrate writes it, from a made-up machine: bandwidth timings from
    the ring formula with known alpha and beta, step times from the model with that machine."""
    cal = {"machine": {"cores": 2, "torch": "x", "cpu": "x"}, "worlds": {}}
    truth = {}
    for n, flops in ((2, 8e10), (4, 6e10)):
        link = Link({"all_reduce": 1.2e9, "reduce_scatter": 0.4e9, "all_gather": 0.9e9},
                    {"all_reduce": 2e-4, "reduce_scatter": 3e-4, "all_gather": 2.5e-4})
        bandwidth = [{"op": op, "bytes": s, "time_s": ring_time(op, s, n, link)}
                     for op in OPS for s in at_scale.CAL_SIZES]
        world = {"batch": 8 // n, "params": 3_200_000, "flops_per_s": flops, "optimizer_bytes_per_s": 4e9,
                 "bandwidth": bandwidth, "overlap_hidden": [overlap_in_truth] * 3}
        cluster = at_scale.cpu_cluster({**world, "n": n}, cores=2)
        assert cluster.intra.busbw == pytest.approx(link.busbw, rel=1e-9)  # the fit recovers beta ...
        assert cluster.intra.latency == pytest.approx(link.latency, rel=1e-6)  # ... and alpha
        m = gpt("lessons' GPT", 3_200_000, 4, 256, 4, 64, 32)
        w = Workload(m, batch=8 // n, seq=32, precision="fp32", tensors=52)
        truth[n] = cluster, w
        world["measured_step_s"] = {name: step(w, stage, n, cluster)["step_s"] for name, stage in LESSONS.items()}
        cal["worlds"][str(n)] = world
    return cal, truth


def test_calibration_reproduces_its_own_points():
    cal, _ = synthetic_calibration()
    rows = at_scale.predict(cal, cores=2)
    assert len(rows) == 2 * len(LESSONS)
    assert max(abs(r["error"]) for r in rows) < 1e-9
    assert "06_zero3 --prefetch 0" in at_scale.calibration_table({**cal, "rows": rows})


def test_calibration_fails_when_the_measurements_disagree():
    cal, truth = synthetic_calibration()
    # the machine actually overlapped nothing: the steps that hide communication were slower
    for n, (cluster, w) in truth.items():
        slower = replace(cluster, overlap=0.0)
        cal["worlds"][str(n)]["measured_step_s"] = {name: step(w, stage, n, slower)["step_s"]
                                                    for name, stage in LESSONS.items()}
    errors = {(r["lesson"], r["ranks"]): r["error"] for r in at_scale.predict(cal, cores=2)}
    assert errors[("06_zero3", 2)] < -0.01  # predicted faster than "measured"
    assert abs(errors[("01_vanilla_dp", 2)]) < 1e-9  # 01 overlaps nothing either way


# ----------------------------------------------------------------------------- published numbers
def test_published_checks_pass_within_their_tolerance(capsys):
    for what, model, paper, tol in at_scale.published():
        assert abs(model / paper - 1) <= tol, what
    assert at_scale.check_published() == 0
    assert "10 of 10 within tolerance" in capsys.readouterr().out


def test_published_checks_can_fail(monkeypatch, capsys):
    # an efficiency far from the truth puts torchtitan's throughput out of tolerance
    monkeypatch.setattr(at_scale, "TITAN", replace(at_scale.TITAN, efficiency=0.6))
    assert at_scale.check_published() == 1
    assert "OFF" in capsys.readouterr().out


# ----------------------------------------------------------------------------- the command
def test_command_prints_every_stage(capsys):
    assert at_scale.main(["--model", "llama3-70b", "--world", "64", "--batch", "1", "--ckpt", "full"]) == 0
    out = capsys.readouterr().out.splitlines()
    rows = [line.split() for line in out if line.split()[:1] == ["64"]]
    assert [r[1] for r in rows] == list(STAGES)
    assert {r[1]: r[-1] for r in rows}["zero3"] == "yes" and {r[1]: r[-1] for r in rows}["dp"] == "NO"


@pytest.mark.parametrize("argv, message", [
    (["--world", "-8"], "must be positive"),
    (["--model", "gpt-5"], "unknown preset 'gpt-5'"),
    (["--cluster", "tpu"], "unknown preset 'tpu'"),
    (["--world", "12"], "not a whole number of 8-GPU nodes"),
    (["--params", "lots"], "not a number"),
    (["--stage", "zero4"], "unknown stage"),
    (["--efficiency", "1.5"], "at most 1"),
])
def test_bad_input_is_one_line(argv, message):
    with pytest.raises(SystemExit) as e:
        at_scale.main(argv)
    assert isinstance(e.value.code, str) and message in e.value.code and "\n" not in e.value.code


def test_bad_input_as_a_script_no_traceback():
    p = subprocess.run([sys.executable, "-m", "scripts.learn.at_scale", "--world", "12"], cwd=ROOT,
                       capture_output=True, text=True)
    assert p.returncode != 0 and p.stdout == ""
    assert p.stderr.strip().splitlines() == ["at_scale: error: --world 12 is not a whole number of 8-GPU nodes"]
