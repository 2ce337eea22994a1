"""The scaling and benchmark scripts write what the README promises: JSON, markdown, figures.

scaling.py --quick is a real run (two tiny models, every lesson, worlds 2 and 1 in one torchrun
launch, about 20 s). bench.py's own runs take minutes, so its test replaces the runs with canned
reports and checks what it makes of them: the table's columns, the JSON's fields, the plot.
No timing is asserted: step times on a shared 2-core machine mean nothing in a test.
"""
import json
import subprocess
import sys

import pytest

from harness import ROOT
from lessonkit.comm_meter import bytes_written
from scripts.runs import available_lessons

from scripts.perf import bench

WIRE = bytes_written() is not None  # Linux's /proc/self/io: there the wire is measured; elsewhere None


def test_scaling_quick_writes_json_table_and_both_figures(tmp_path):
    out = subprocess.run([sys.executable, "-m", "scripts.perf.scaling", "--quick",
                          "--out", str(tmp_path), "--figures", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr
    result = json.loads((tmp_path / "scaling.json").read_text())
    lessons = available_lessons()
    got = {(r["world_size"], r["size"], r["lesson"]) for r in result["rows"]}
    assert got == {(w, s, l) for w in (1, 2) for s in ("tiny", "small") for l in lessons}
    for r in result["rows"]:
        assert r["n_params"] == result["sizes"][r["size"]]["n_params"] > 0
        assert r["step_time_s"] > 0 and len(r["timed_steps_s"]) >= 1
        # the ZeRO paper's bytes, issued: nothing sent alone; at 2 ranks 2 Psi (3 Psi) x 1/2, plus
        # the 4-byte gradient-norm all-reduce
        if r["world_size"] == 1:
            assert r["issued_ring_bytes_per_step"] == 0
        else:
            assert abs(r["issued_ring_bytes_per_step"] - r["theory_ring_bytes_per_step"]) <= 8, r["lesson"]
            # wire: measured, gloo's own collectives, headers and all (None without Linux's /proc)
            wire = r["wire_bytes_per_step"]
            assert wire >= r["issued_ring_bytes_per_step"] if WIRE else wire is None, (r["lesson"], wire)
        held, theory = r["memory"], r["theory_memory"]
        assert held["params"] == theory["params"] and held["grads"] == theory["grads"], r["lesson"]
        assert (r["peak_params"] is not None) == (r["lesson"] == "06_zero3")
    table = (tmp_path / "scaling.md").read_text()
    assert "**world size 1**" in table and "**world size 2**" in table and all(l in table for l in lessons)
    assert "| issued MiB (theory) | wire MiB |" in table
    for figure in ("scaling_model_size.png", "scaling_world_size.png"):
        assert (tmp_path / figure).stat().st_size > 20_000  # a real plot, not an empty canvas


def _report(psi, sent, held, rss):
    rank = {"params": held / 4, "grads": held / 4, "optimizer": held / 2, "other": 0, "max_rss": rss}
    return {"n_params": psi, "config": {"global_batch": 16, "seq_len": 64},
            "memory": {"per_rank": [rank, dict(rank, max_rss=rss + 2 ** 20)]},
            "comm": {"wire_bytes_per_rank": [sent, sent + 100], "issued_ring_bytes_per_step": sent,
                     "theory_ring_bytes_per_step": sent}}


def test_bench_writes_table_json_and_plot(tmp_path, monkeypatch):
    times = {"torch": 0.1, "lesson": 0.05, "lesson-noprefetch": 0.08, "local": 0.04}
    monkeypatch.setattr(bench, "run_one", lambda kind, name, nproc, steps, extra:
                        (times["local" if name == "local" else kind], _report(1000, 2 ** 20, 16 * 2 ** 20, 300 * 2 ** 20)))
    monkeypatch.setattr(sys, "argv", ["bench.py", "--rounds", "2", "--lessons", "03_buckets", "06_zero3",
                                      "--out", str(tmp_path)])
    bench.main()
    doc = json.loads((tmp_path / "bench.json").read_text())
    runs = {r["run"]: r for r in doc["configs"]["default"]["runs"]}
    assert list(runs) == ["local (no communication)", "DDP", "03_buckets", "FSDP2 fully_shard", "06_zero3",
                          "06_zero3 --prefetch 0"]
    assert runs["03_buckets"]["vs_limit"] == pytest.approx(1.25) and runs["local (no communication)"]["vs_limit"] == 1
    assert runs["03_buckets"]["vs_pytorch"] == 0.5 and runs["06_zero3 --prefetch 0"]["vs_pytorch"] == pytest.approx(0.8)
    assert runs["DDP"]["vs_pytorch"] is None and runs["DDP"]["round_medians_s"] == [0.1, 0.1]
    r = runs["03_buckets"]
    assert r["tokens_per_s"] == 16 * 64 / 0.05
    assert r["wire_bytes_per_step"] == 2 ** 20 + 100  # every rank's maximum
    assert r["state_bytes"] == 16 * 2 ** 20 and r["max_rss"] == 301 * 2 ** 20
    assert list(doc["configs"]) == ["default", "many-small", "10M"]  # many-small: 01-03 only
    assert [r["run"] for r in doc["configs"]["many-small"]["runs"]] == ["local (no communication)", "DDP", "03_buckets"]
    table = (tmp_path / "bench.md").read_text()
    for column in ("/ limit", "vs PyTorch", "tokens/s", "sent MiB/rank/step", "held MiB/rank", "host MiB/rank",
                   "peak RSS MiB/rank"):
        assert column in table
    assert "| 03_buckets | 50.0 | 50.0-50.0 | 1.25x | 0.50x | 20,480 | 1.00 | 16.00 |  | 301 |" in table  # no host tier
    assert (tmp_path / "bench.png").stat().st_size > 20_000


def test_bench_runs_a_lesson_on_torchs_collectives_and_on_the_ring_side_by_side(tmp_path, monkeypatch):
    times = {"torch": 0.1, "lesson": 0.05, "lesson-ring": 0.04, "local": 0.04}
    monkeypatch.setattr(bench, "run_one", lambda kind, name, nproc, steps, extra:
                        (times["local" if name == "local" else kind], _report(1000, 2 ** 20, 16 * 2 ** 20, 300 * 2 ** 20)))
    monkeypatch.setattr(sys, "argv", ["bench.py", "--rounds", "2", "--configs", "10M", "--lessons", "04_zero1",
                                      "--collectives", "torch", "ring", "--out", str(tmp_path)])
    bench.main()
    runs = {r["run"]: r for r in json.loads((tmp_path / "bench.json").read_text())["configs"]["10M"]["runs"]}
    assert list(runs) == ["local (no communication)", "DDP + ZeroRedundancyOptimizer", "04_zero1",
                          "04_zero1 --collectives ring"]
    assert runs["04_zero1 --collectives ring"]["vs_torch_collectives"] == pytest.approx(0.8)
    assert runs["04_zero1"]["vs_torch_collectives"] is None  # torch's collectives: the reference
    assert "| 04_zero1 | 0.800x | 0.800, 0.800 |" in (tmp_path / "bench.md").read_text()


def test_bench_puts_07_against_fsdp2_offload_with_its_device_bytes_held_and_its_host_bytes_beside(tmp_path, monkeypatch):
    def run_one(kind, name, nproc, steps, extra):
        report = _report(1000, 2 ** 20, 16 * 2 ** 20, 300 * 2 ** 20)
        if name == "07_offload":  # by tier: 1 MiB of parameters on the device, 16 MiB of states on the host
            device = {"params": 2 ** 20, "grads": 0, "optimizer": 0}
            host = {"params": 4 * 2 ** 20, "grads": 4 * 2 ** 20, "optimizer": 8 * 2 ** 20}
            report["memory"]["per_rank"] = [dict(m, device=device, host=host) for m in report["memory"]["per_rank"]]
        return 0.05, report
    monkeypatch.setattr(bench, "run_one", run_one)
    monkeypatch.setattr(sys, "argv", ["bench.py", "--rounds", "1", "--configs", "default", "--lessons", "07_offload",
                                      "--out", str(tmp_path)])
    bench.main()
    runs = {r["run"]: r for r in json.loads((tmp_path / "bench.json").read_text())["configs"]["default"]["runs"]}
    assert list(runs) == ["local (no communication)", "FSDP2 + CPUOffloadPolicy", "07_offload"]
    assert runs["07_offload"]["state_bytes"] == 2 ** 20 and runs["07_offload"]["host_state_bytes"] == 16 * 2 ** 20
    assert runs["FSDP2 + CPUOffloadPolicy"]["host_state_bytes"] is None  # no tiers measured for it
    assert "| 1.00 | 1.00 | 16.00 | 301 |" in (tmp_path / "bench.md").read_text()  # sent, held (device), host, RSS


def test_bandwidth_ring_is_the_lessons_transport_and_sends_a_rings_bytes():
    # `bandwidth.py --ring` times scripts/perf/ring_collectives.py's transport (what --collectives ring installs):
    # a row per op for gloo and for the ring; the ring writes (N-1)/N S per pass, plus gloo's
    # 144-byte header per send (0.4% of 32 KiB), and gloo's reduce-scatter, an all-reduce
    # underneath, twice that. No timing is asserted.
    from scripts.runs import launch
    report = launch("scripts.perf.bandwidth", 2, ["--ring", "--quick", "--sizes", "65536"])
    got = {(r["op"], r["impl"]): r for r in report["results"]}
    assert set(got) == {(op, impl) for op in ("all_reduce", "reduce_scatter", "all_gather") for impl in ("gloo", "ring")}
    if not WIRE:
        assert all(w is None for r in got.values() for w in r["wire_bytes_per_rank"])
        return
    for (op, impl), r in got.items():
        if impl == "ring":
            for wire in r["wire_bytes_per_rank"]:
                assert abs(wire / r["ring_bytes_per_rank"] - 1) < 0.01, (op, wire)
    wire = lambda op, impl: got[op, impl]["wire_bytes_per_rank"][0]
    assert wire("reduce_scatter", "gloo") > 1.9 * wire("reduce_scatter", "ring")


def test_the_local_limit_trains_each_rank_alone_with_no_collective():
    # The benchmark's "local" run: the same loop with no communication at all. Each rank then
    # trains its own rows only (its weights drift apart from the other rank's); it issues no
    # collective in the measured step.
    from scripts.runs import launch
    report = launch("scripts.perf.torch_reference", 2, ["--impl", "local", "--steps", "3", "--n-layer", "1",
                                                   "--d-model", "32", "--n-head", "2", "--seq-len", "16"])
    assert report["comm"]["ops"] == {} and report["comm"]["theory_ring_bytes_per_step"] == 0


def test_every_counterpart_the_benchmark_runs_is_held_to_a_formula():
    # the benchmark's counterparts each report their model states and bytes beside the ZeRO
    # paper's; FSDP2's HSDP as 08 does, over its shard group: at the benchmark's 2 ranks as two
    # replicas (G = 1), the whole model on each rank
    from lessonkit.theory import theory_memory, theory_ring_bytes
    from model import GPT, GPTConfig
    from scripts.perf.torch_reference import IMPLS
    from scripts.runs import launch
    # Psi = 1000 fp32 elements at 2 ranks, bytes per rank per step: 2 Psi (N-1)/N x 4 = 4000 for an
    # all-reduce or a reduce-scatter and an all-gather (ZeroRedundancyOptimizer: the paper's stage
    # 1, which it reaches by DDP's all-reduce and broadcasts: docs/benchmark.md), 3 Psi for FSDP2's
    # two gathers and one reduce-scatter, none for the local limit; HSDP at G = 1 all-reduces
    # across the two replicas
    psi_elems = {"ddp": 2, "zero_redundancy": 2, "fsdp2_noreshard": 2, "fsdp2": 3, "fsdp2_offload": 3,
                 "fsdp2_hsdp": 2, "local": 0}
    assert set(psi_elems) == set(IMPLS)
    for impl in IMPLS:
        assert theory_memory(f"torch_{impl}", 1000, 2, "fp32")["total"] > 0, impl
        assert theory_ring_bytes(f"torch_{impl}", 1000, 2, "fp32", shard=1) == psi_elems[impl] * 1000 * 4 / 2, impl
    report = launch("scripts.perf.torch_reference", 2, ["--impl", "fsdp2_hsdp", "--shard-group", "1", "--steps", "3",
                                                   "--n-layer", "1", "--d-model", "32", "--n-head", "2", "--seq-len", "16"])
    measured, theory = report["memory"]["per_rank"][0], report["memory"]["theory"]
    assert [measured[k] for k in ("params", "grads")] == [theory[k] for k in ("params", "grads")]
    # torch.optim.AdamW also keeps a 4-byte step count per parameter tensor, which the paper leaves out
    tensors = len(list(GPT(GPTConfig(n_layer=1, d_model=32, n_head=2, seq_len=16)).parameters()))
    assert measured["optimizer"] == theory["optimizer"] + 4 * tensors
    assert theory["params"] == 4 * report["n_params"]  # G = 1: nothing sharded
    assert report["comm"]["issued_ring_bytes_per_step"] == report["comm"]["theory_ring_bytes_per_step"] > 0


def test_fsdp2s_references_run_in_bf16_as_06_does_and_the_others_refuse_it():
    # 06-08 in bf16: fp32 shards at rest, gathered and reduce-scattered in bf16; FSDP2's
    # MixedPrecisionPolicy(param_dtype=bf16) the same: 2-byte collectives, 4-byte shards
    from lessonkit.theory import theory_ring_bytes
    from scripts.runs import launch
    flags = ["--steps", "2", "--n-layer", "1", "--d-model", "32", "--n-head", "2", "--seq-len", "16"]
    report = launch("scripts.perf.torch_reference", 2, ["--impl", "fsdp2", "--precision", "bf16", *flags])
    psi, comm = report["n_params"], report["comm"]
    assert comm["issued_ring_bytes_per_step"] == theory_ring_bytes("torch_fsdp2", psi, 2, "bf16") \
        == theory_ring_bytes("torch_fsdp2", psi, 2, "fp32") / 2 > 0
    assert report["memory"]["per_rank"][0]["params"] == 4 * psi / 2  # the fp32 shards
    out = subprocess.run([sys.executable, "-m", "scripts.perf.torch_reference", "--impl", "ddp", "--precision", "bf16"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stderr.strip() == (
        "error: --precision bf16: the PyTorch references run in fp32, and FSDP2's "
        "(fsdp2, fsdp2_offload, fsdp2_hsdp) in bf16 too"), out.stderr


def test_bandwidth_contention_prints_one_row_per_size():
    # a smoke test of `bandwidth.py --contention` (README: "Overlap on 2 cores"): it runs and
    # reports each size's four times and the shares derived from them; no timing is asserted
    from scripts.runs import launch
    out = launch("scripts.perf.bandwidth", 2, ["--contention", "--quick", "--sizes", "65536", "262144"], report=False)
    rows = [line for line in out.splitlines() if line.startswith("all_reduce")]
    assert len(rows) == 2 and all("compute alone" in r and "hidden" in r and "compute slowed" in r for r in rows)


def test_accumulation_measures_bytes_and_memory_of_each_choice_and_checks_the_model(tmp_path):
    # 4 ranks, K = 2, a one-block GPT, a fast link: the bytes and held gradients of each run must equal their formulas
    # (the script exits 1 otherwise); the timing check is the script's to make on a quiet machine
    # (make accumulation), so here its tolerance is wide: a loaded machine's step times mean nothing
    figure = tmp_path / "accumulation.png"
    out = subprocess.run([sys.executable, "-m", "scripts.perf.accumulation", "--no-write", "--micro", "2", "--steps", "2",
                          "--inter-link", "1:50", "--n-layer", "1", "--d-model", "32", "--tolerance", "1e9", "--figure", str(figure)],
                         cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stdout + out.stderr
    rows = [line for line in out.stdout.splitlines() if line.startswith("|0")]
    assert len(rows) == 3 * 2 + 3, rows  # two choices each (08: three)
    slow = [line for line in out.stdout.splitlines() if line.startswith("|2|")]
    assert slow[0].split("|")[5] == "step", slow  # the model's choice: all-reduce once
    assert figure.stat().st_size > 0
