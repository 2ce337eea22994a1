"""The at-scale cost model (scripts/learn/cost_model.py) and its command (scripts/learn/at_scale.py):
ring costs to the formula, HSDP (08) against ZeRO-3 and replication, the calibration reproducing
synthetic measurements (and failing when they disagree), the published checks within their
tolerances, the calibration on a simulated link (a lesson by hand, the shared core, the exit
beyond the tolerance) and one-line errors for bad input. Pure arithmetic: no lesson is launched
here (a few seconds)."""
import subprocess
import sys
from dataclasses import replace

import pytest

from harness import ROOT
from scripts.learn import at_scale
from scripts.learn.cost_model import (CLUSTERS, LESSONS, MODELS, OPS, STAGES, GPU, Cluster, Link, Workload,
                                      collective_time, gpt, ring_time, step)
from lessonkit.theory import theory_links, theory_ring_bytes

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
    # what the stages send per rank: 2 Psi (N-1)/N (DP, ZeRO-1/2), 3 Psi (N-1)/N (ZeRO-3), section 7;
    # HSDP at G = 8: 08's two groups (theory_links), added
    w, n = Workload(MODELS["llama3-8b"], 1, 4096), 64
    r = step(w, STAGES[stage], n, CLUSTERS["h100"])
    strategy = {"dp": "vanilla_dp", "zero1": "zero1", "zero2": "zero2", "hsdp": "hybrid"}.get(stage, "zero3")
    assert sum(r["per_link"].values()) == pytest.approx(
        theory_ring_bytes(strategy, w.model.params, n, "bf16", shard=8), rel=1e-12)


# ----------------------------------------------------------------------------- HSDP (08)
W8B = Workload(MODELS["llama3-8b"], 1, 2048, "selective")  # 2048 tokens per GPU: communication shows at 512


def hsdp(g):
    return replace(STAGES["hsdp"], shard_group=g)


def test_hsdp_over_all_n_is_zero3():
    zero3, whole = (step(W8B, s, 512, CLUSTERS["h100"]) for s in (STAGES["zero3"], hsdp(512)))
    assert {k: v for k, v in whole.items() if k != "stage"} == {k: v for k, v in zero3.items() if k != "stage"}


@pytest.mark.parametrize("g", [1, 4, 8, 16, 64])
def test_hsdp_bytes_per_link_are_theory_links(g):
    # per group, 08's (and its report's) intra / inter; on the wires, a shard group of one node
    # keeps its 3 Psi (G-1)/G on NVLink and sends only the all-reduce over the NIC
    psi, n = W8B.model.params, 64
    r = step(W8B, hsdp(g), n, CLUSTERS["h100"])
    links = theory_links(psi, g, n, "bf16")
    assert r["per_link"] == pytest.approx(links, rel=1e-12)
    if g == 8:
        assert r["wires"] == pytest.approx({"nvlink": links["intra"], "nic": links["inter"]}, rel=1e-12)
    assert r["memory"]["states"] == 16 * psi / g  # (4 + 4 + 8) Psi / G
    from scripts.learn.cost_model import ADAM_BYTES
    assert r["optimizer_s"] == ADAM_BYTES["bf16"] * psi / g / CLUSTERS["h100"].gpu.mem_bw  # AdamW on my Psi / G


def test_hsdp_of_one_is_replication():
    # G = 1: nothing to shard, every unit's whole gradient all-reduced over all N, two-level as DP's
    # buckets are; DP's bytes and model states
    c, n = CLUSTERS["h100"], 64
    one, dp = step(W8B, hsdp(1), n, c), step(W8B, STAGES["dp"], n, c)
    from scripts.learn.cost_model import _units
    assert one["comm"]["all_reduce"]["bytes"] == pytest.approx(dp["comm"]["all_reduce"]["bytes"], rel=1e-12)
    assert one["comm"]["all_reduce"]["s"] == pytest.approx(
        sum(collective_time("all_reduce", 2 * u, n, c) for u in _units(W8B.model)), rel=1e-12)
    assert one["comm"]["reduce_scatter"]["s"] == one["comm"]["all_gather"]["s"] == 0
    assert one["memory"]["states"] == dp["memory"]["states"]


def test_hsdp_all_reduce_runs_on_its_own_stream_after_its_reduce_scatter():
    from scripts.learn.cost_model import simulate
    # a 4 ms reduce-scatter, then the all-reduce of its shard (3 ms, stream 1, after it) and a
    # 2 ms gather (stream 0): the gather runs beside the all-reduce, which starts at 4 ms
    program = [("issue", 0, 0.0, 0.0, 0.004, 0, None), ("issue", 1, 0.0, 0.0, 0.003, 1, 0),
               ("issue", 2, 0.0, 0.0, 0.002, 0, None), ("wait", 1), ("wait", 2)]
    assert simulate(program) == pytest.approx((0.007, 0.007))
    assert simulate([p[:6] + (None,) if p[0] == "issue" else p for p in program]) == pytest.approx((0.006, 0.006))


def test_hsdp_in_a_node_beats_zero3_across_a_slow_nic():
    # 512 H100s, 2048 tokens per GPU: ZeRO-3's every gather crosses the NICs, HSDP's (G = a node)
    # stays on NVLink and only a G times smaller all-reduce crosses them, beside
    c = CLUSTERS["h100"]
    z3, node = step(W8B, STAGES["zero3"], 512, c), step(W8B, hsdp(8), 512, c)
    assert node["wires"]["nic"] < z3["wires"]["nic"] and node["exposed_s"] < z3["exposed_s"] / 2
    assert node["step_s"] < z3["step_s"] / 1.2
    verdict = at_scale.hsdp_versus_zero3(W8B, c, 512)
    assert verdict["choose"] == 8 and verdict["verdict"].startswith("HSDP at G=8 beats ZeRO-3 by 1.")
    chosen = dict(verdict["rows"])[8]
    assert chosen["memory"]["total"] <= c.gpu.memory


def test_zero3_wins_where_hsdp_does_not_fit_or_gains_nothing():
    # 70B, 4096 tokens per GPU, 64 GPUs: compute-bound (communication hides); G = 8 and 16 do not fit
    w, c = Workload(MODELS["llama3-70b"], 1, 4096, "full"), CLUSTERS["h100"]
    verdict = at_scale.hsdp_versus_zero3(w, c, 64)
    assert [g for g, r in verdict["rows"] if r["memory"]["total"] > c.gpu.memory] == [8, 16]
    assert verdict["choose"] == 64 and verdict["verdict"].startswith("ZeRO-3 wins here because")


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


def test_offload_keeps_the_bf16_shard_on_the_device_and_pays_the_cpus_optimizer():
    # 07 on paper: the device keeps 2 Psi / N, the host 16 Psi / N; each unit's shard crosses
    # PCIe up (its fp32 master, cast on the device) and its bf16 gradient shard down once a step,
    # each copy alpha + bytes / beta. Compute-bound at 64 H100s, a block's copy hides behind the
    # compute beside it, and what shows is what has none: the root's upload (the embeddings),
    # before forward can start, and after backward the first block's download and the root's,
    # reduced last
    w, c, n = Workload(MODELS["llama3-8b"], 2, 8192, "selective"), CLUSTERS["h100"], 64
    z3, off = step(w, STAGES["zero3"], n, c), step(w, STAGES["zero3-offload"], n, c)
    psi, root = w.model.params, w.model.root
    assert off["memory"]["states"] == 2 * psi / n and off["memory"]["host"] == 16 * psi / n
    alpha, copies = c.host.pcie_latency, w.model.layers + 1  # a copy per unit each way: the blocks and the root
    assert off["copies"]["up_s"] == pytest.approx(copies * alpha + 4 * psi / n / c.host.pcie, rel=1e-12)
    assert off["copies"]["down_s"] == pytest.approx(copies * alpha + 2 * psi / n / c.host.pcie, rel=1e-12)
    block = (psi - root) / w.model.layers
    assert off["copies"]["exposed_s"] == pytest.approx(3 * alpha + (4 * root + 2 * (root + block)) / n / c.host.pcie,
                                                       rel=1e-9)
    assert off["optimizer_s"] == psi / n / c.host.adam  # AdamW on the CPU, not hidden
    assert off["comm"] == z3["comm"]  # the collectives are ZeRO-3's
    assert off["step_s"] == pytest.approx(z3["step_s"] - z3["optimizer_s"] + off["optimizer_s"]
                                          + off["copies"]["exposed_s"], rel=1e-12)
    # over a link 100x slower than PCIe Gen5 the uploads outrun forward and show
    slow = replace(c, host=replace(c.host, pcie=c.host.pcie / 100))
    assert step(w, STAGES["zero3-offload"], n, slow)["copies"]["exposed_s"] > off["copies"]["up_s"] * 100 - off["forward_s"]


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


def test_hsdp_command_prints_each_g_and_the_choice(capsys):
    assert at_scale.main(["--world", "512", "--batch", "1", "--seq", "2048", "--hsdp"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[1] for line in out if line.split()[:1] in (["zero3"], ["hsdp"])] == \
        ["512", "8", "16", "32", "64", "128", "256", "512"]
    assert out[-1].startswith("HSDP at G=8 beats ZeRO-3 by") and out[-1].endswith("choose G=8")


@pytest.mark.parametrize("argv, message", [
    (["--world", "-8"], "must be positive"),
    (["--model", "gpt-5"], "unknown preset 'gpt-5'"),
    (["--cluster", "tpu"], "unknown preset 'tpu'"),
    (["--world", "12"], "not a whole number of 8-GPU nodes"),
    (["--params", "lots"], "not a number"),
    (["--memory-gb", "1e400"], "must be positive and finite: '1e400'"),  # inf once: every model fit
    (["--stage", "zero4"], "unknown stage"),
    (["--efficiency", "1.5"], "at most 1"),
    (["--calibrate", "--link", "fast"], "argument --link: 'fast': expected GBPS:LATENCY_US"),
    (["--calibrate", "--link", "0:50"], "the bandwidth must be 0.001 Gb/s or more"),
    (["--link", "1:50"], "--link goes with --calibrate"),
    (["--world", "64", "--shard-group", "3", "--hsdp"], "--shard-group 3 does not tile 64 GPUs"),
])
def test_bad_input_is_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        at_scale.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err and err.count("\n") == 1 and err.startswith("at_scale: error: "), err


def test_bad_input_as_a_script_no_traceback():
    p = subprocess.run([sys.executable, "-m", "scripts.learn.at_scale", "--world", "12"], cwd=ROOT,
                       capture_output=True, text=True)
    assert p.returncode != 0 and p.stdout == ""
    assert p.stderr.strip().splitlines() == ["at_scale: error: --world 12 is not a whole number of 8-GPU nodes"]


# ----------------------------------------------------------------------------- on a simulated link
# A link of 2^30 bytes/s (8.589934592 Gb/s) and 2^-14 s (61.03515625 us) per send; the ring's own
# cost 2^-11 s per call at every size and the same with no link (so no loopback copy to hide)
SPEC, BYTES_PER_S, LATENCY, OWN = "8.589934592:61.03515625", 2.0 ** 30, 2.0 ** -14, 2.0 ** -11


def link_calibration(share=0.5, exposed_ms=None):
    """calibrate_link's data, made up: the ring's cost, no-link runs (compute 40 ms + their exposed)."""
    flat = {op: [[8, OWN, OWN], [2 ** 24, OWN, OWN]] for op in OPS}
    none = {name: {"step_s": 0.05, "exposed_s": 0.01, "compute_s": 0.04} for name in LESSONS}
    return {"ranks": 2, "batch": 4, "params": 3_184_128, **at_scale.gradient_layout(), "optimizer_bytes_per_s": 2.0 ** 33,
            "transport": {"costs": {"none": flat, SPEC: flat}, "share": share}, "tolerance": at_scale.TOLERANCE,
            "runs": {"none": none, SPEC: {name: {"step_s": 0.1, "exposed_s": (exposed_ms or 50) / 1e3} for name in LESSONS}},
            "machine": {"cores": 2, "torch": "x", "cpu": "x"}, "flags": at_scale.LINK_FLAGS}


def test_lesson_02_is_modelled_as_each_gradient_async_during_backward():
    assert LESSONS["02_async_allreduce"].per_tensor and LESSONS["02_async_allreduce"].overlap
    assert not LESSONS["01_vanilla_dp"].overlap  # 01: the same calls, after backward


def test_zero1_on_a_link_is_its_three_collectives_by_hand():
    # 04 hides nothing: exposed = reduce-scatter + the clip's scalar all-reduce + all-gather, each
    # the ring's own cost plus, at 2 ranks, one send of S/2 (two of 2 bytes for the scalar)
    cal = link_calibration()
    row = next(r for r in at_scale.predict_link(cal) if r["lesson"] == "04_zero1")
    s = 4 * cal["params"]
    send = lambda b: LATENCY + b / BYTES_PER_S  # noqa: E731
    exposed = (OWN + send(s / 2)) + (OWN + 2 * LATENCY + 4 / BYTES_PER_S) + (OWN + send(s / 2))
    assert row["predicted_exposed_ms"] == pytest.approx(exposed * 1e3, rel=1e-9)
    # compute from the run with no link (its step less its exposed), the optimizer inside it
    assert row["predicted_ms"] == pytest.approx((0.04 + exposed) * 1e3, rel=1e-9)


def test_a_collective_beside_compute_gets_a_share_of_the_core():
    from scripts.learn.cost_model import simulate
    # 8 ms of the ring's own work issued with 40 ms of compute: at a quarter of the core it ends
    # at 32 ms, hidden; the compute keeps its pace. Alone: 8 ms, waited for in full.
    beside = [("issue", 0, 0.008, 0.0, 0.0), ("compute", 0.040), ("wait", 0)]
    assert simulate(beside, share=0.25) == pytest.approx((0.040, 0.0))
    assert simulate([("issue", 0, 0.008, 0.0, 0.0), ("wait", 0)], share=0.25) == pytest.approx((0.008, 0.008))
    # the loopback copy runs while the link's time passes: own + max(copy, wire)
    assert simulate([("issue", 0, 0.001, 0.003, 0.005), ("wait", 0)]) == pytest.approx((0.006, 0.006))
    assert simulate([("issue", 0, 0.001, 0.003, 0.005), ("compute", 0.010), ("wait", 0)], share=0.5) \
        == pytest.approx((0.010, 0.0))  # 2 ms own, then max(6 ms copy, 5 ms wire): done at 8


def test_prefetch_and_the_reduce_scatter_cap_show_in_exposed_time():
    cal = link_calibration()
    rows = {r["lesson"]: r for r in at_scale.predict_link(cal)}
    assert rows["06_zero3"]["predicted_exposed_ms"] < rows["06_zero3 --prefetch 0"]["predicted_exposed_ms"]
    assert rows["03_buckets"]["predicted_exposed_ms"] < rows["01_vanilla_dp"]["predicted_exposed_ms"]
    # a cap on the reduces in flight (05: 2, 06: 1) stalls backward: buckets of 10, 1 and 1 MB,
    # ~24 ms of backward; the first (~10 ms on the link) goes at 20 ms, the second is ready at
    # 22 ms and, capped at one, waits for the first: backward's last 2 ms then run after ~30 ms,
    # and the third bucket goes ~2 ms later than the queue could have taken it
    w = replace(at_scale.lesson_workload(cal), bucket_bytes=(10e6, 1e6, 1e6))
    cluster = at_scale.link_cluster(cal, SPEC, 7e10)
    capped, free = (step(w, replace(STAGES["dp"], in_flight=k), 2, cluster) for k in (1, 0))
    assert capped["backward_s"] == pytest.approx(0.024, rel=0.02)
    assert capped["exposed_s"] > free["exposed_s"] + 0.0003 and capped["step_s"] > free["step_s"] + 0.0003


def fake_launch(cal, miss=None):
    """scripts.runs.launch for calibrate_link, without a launch: the probe's costs, and the
    lessons' reports as the model predicts them (one lesson `miss`ing by 30% on exposed time)."""
    def launch(script, nproc, args=()):
        if script == "scripts.learn.at_scale":
            return cal["transport"]
        spec = args[args.index("--link") + 1] if "--link" in args else "none"
        reports = {}
        for name in LESSONS:
            if spec == "none":
                step_s, exposed_s = 0.05, 0.01
            else:
                r = step(at_scale.lesson_workload(cal), LESSONS[name], 2, at_scale.link_cluster(
                    cal, spec, flops_per_token_of(cal) / at_scale.lesson_compute(cal, name)))
                step_s, exposed_s = r["step_s"], r["exposed_s"] * (1.3 if name == miss else 1.0)
            for k in at_scale.SEEDS:
                reports[f"{name} --seed {k}"] = {"step_time_s": [step_s] * 5,
                                                 "comm": {"overlap": {"exposed_ms": exposed_s * 1e3, "comm_ms": 0.0}}}
        return {"worlds": {"2": {"reports": reports}}}
    return launch


def flops_per_token_of(cal):
    from scripts.learn.cost_model import flops_per_token
    w = at_scale.lesson_workload(cal)
    return flops_per_token(w.model, w.seq) * w.batch * w.seq


@pytest.mark.parametrize("miss, code", [(None, 0), ("06_zero3", 1)])
def test_link_calibration_exits_nonzero_beyond_the_tolerance(monkeypatch, tmp_path, capsys, miss, code):
    cal = link_calibration()
    cal["runs"]["none"] = {name: {"step_s": 0.05, "exposed_s": 0.01, "compute_s": 0.04} for name in LESSONS}
    monkeypatch.setattr(at_scale, "OUT", str(tmp_path))
    monkeypatch.setattr(at_scale, "measure_compute", lambda batch: (at_scale.cal_model()[2], 1e10, 2.0 ** 33))
    monkeypatch.setattr("scripts.runs.launch", fake_launch(cal, miss))
    assert at_scale.main(["--calibrate", "--link", SPEC]) == code
    out = capsys.readouterr().out
    assert (f"OFF: {miss} on {SPEC}" in out) == (miss is not None)
    assert (tmp_path / "link_calibration.json").exists()


def test_bad_link_as_a_script_no_traceback():
    p = subprocess.run([sys.executable, "-m", "scripts.learn.at_scale", "--calibrate", "--link", "1"], cwd=ROOT,
                       capture_output=True, text=True)
    assert p.returncode != 0 and p.stdout == ""
    assert p.stderr.strip().splitlines() == [
        "at_scale: error: argument --link: '1': expected GBPS:LATENCY_US, e.g. 1:50 (1 Gb/s, 50 us)"]
