"""The lecture run prints one table: every lesson (06 twice), the same loss, issued bytes equal to
theory; on torch's collectives and on the ring over a simulated link (--link). --hybrid's table
(06 against 08 on two simulated nodes) is checked on test_08_hybrid's runs, without a launch.

A tiny model and 3 steps keep it to one ~15 s torchrun launch each (2 ranks, all lessons)."""
import os
import subprocess
import sys

import pytest

from scripts.learn import lecture
from scripts.runs import available_lessons

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROWS = [name for lesson in available_lessons()  # (08 at 2 ranks: two "nodes" of 1, scripts.runs.grid_args)
        for name in ([lesson, "06_no_prefetch"] if lesson == "06_zero3" else ["08_hybrid_G=1"] if lesson == "08_hybrid"
                     else [lesson])]


@pytest.mark.parametrize("link", [[], ["--link", "10:20"]], ids=["torch", "ring-on-a-link"])
def test_lecture_table(link):
    out = subprocess.run([sys.executable, "-m", "scripts.learn.lecture", "--steps", "3",
                          "--n-layer", "1", "--d-model", "32", "--seq-len", "16", *link],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    # one header line, the column titles, a rule, a row per run: nothing else
    assert len(lines) == 3 + len(ROWS), out.stdout
    assert ("ring collectives on a simulated 10 Gb/s, 20 us link" if link else "torch collectives") in lines[0]
    assert "Warning" not in out.stdout + out.stderr and "summary" not in out.stdout
    assert not any(l.startswith(("step ", "W", "I", "[")) for l in lines), out.stdout  # no per-step lines, no logs
    rows = [l.split() for l in lines[3:]]
    assert [r[0] for r in rows] == ROWS
    for r in rows:
        assert r[2] == "\u2713", r  # loss equal to 01's to 4 decimals (fp32)
        comm, exposed = float(r[4]), float(r[5])  # measured on rank 0's clock (gloo): never n/a
        # (printed to 0.1 ms: over loopback a bucket's all-reduce can be done before its wait,
        # and its exposed time print as 0.0, as 03's once did here)
        assert 0 <= exposed <= comm + 0.05 + 1e-6, r
        sent, sent_th, *held = r[6:]
        # issued vs theory, at the printed precision (MiB, 3 decimals): sent exactly; params,
        # grads, optim within one unit of the last digit, as padding and AdamW's 4-byte step
        # counts (one per parameter a shard holds) can tip a rounding the theory does not have
        assert sent == sent_th, r
        assert all(abs(float(m) - float(t)) <= 0.001 + 1e-9 for m, t in zip(held[0::2], held[1::2])), r


def test_a_run_that_fails_ends_the_tool_in_one_line():
    # the lesson's own error, not torchrun's traceback (the tools share scripts.runs.tool_main;
    # bench --nproc 3, whose global batch 3 ranks do not divide, once ended in two walls of them)
    out = subprocess.run([sys.executable, "-m", "scripts.learn.lecture", "--link", "1"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    lines = [line for line in (out.stdout + out.stderr).splitlines() if line.strip()]
    assert out.returncode == 1 and lines == [
        "lecture: a run failed: error: --link '1': expected GBPS:LATENCY_US, e.g. 1:50 (1 Gb/s, 50 us) "
        "(its command and output: runs/lecture/failed_run.log)"], out.stdout + out.stderr
    with open(os.path.join(ROOT, "runs", "lecture", "failed_run.log")) as f:
        assert "ChildFailedError" in f.read()  # torchrun's report, kept for whoever needs it


def test_hybrid_defaults_to_two_nodes_on_a_slow_link_between():
    assert lecture.hybrid_flags(4, ["--steps", "3"]) == (
        ["06_zero3", "08_hybrid"], ["--steps", "3", "--link", "10:5", "--inter-link", "0.5:100", "--ranks-per-node", "2"])
    # the links and nodes named are kept
    assert lecture.hybrid_flags(8, ["--inter-link", "1:50", "--ranks-per-node", "4"])[1] == [
        "--inter-link", "1:50", "--ranks-per-node", "4"]


def test_hybrid_table_06_against_08():
    from test_08_hybrid import results  # 06 and 08 on two nodes of 2, on the ring (their 4-rank launch)
    reports = {"06_zero3": results(4)[0]["zero3_ring"]["report"], "08_hybrid": results(4)[0]["ring"]["report"]}
    lines = lecture.hybrid_table(reports, 4, 4).splitlines()
    assert len(lines) == 5 and "4 ranks as 2 simulated nodes of 2" in lines[0], lines
    assert "10 Gb/s, 5 us inside a node and 0.01 Gb/s, 2000 us between nodes" in lines[0], lines[0]
    zero3, hybrid = (dict(zip(["lesson", "loss", "step", "comm", "exposed", "intra", "intra_wire", "intra_theory",
                               "inter", "inter_wire", "inter_theory", "ranks", "params", "params_theory",
                               "states", "states_theory"], line.split())) for line in lines[3:])
    assert zero3["loss"] == hybrid["loss"]  # the same training
    # the busiest rank on each link: 06's ranks 1 and 3 send its whole 3 Psi (N-1)/N between nodes,
    # every rank of 08 sends 3 Psi (G-1)/G inside and 2 (Psi/G)(R-1)/R between: 4.5 times less
    assert (zero3["ranks"], hybrid["ranks"]) == ("1,3", "0,1,2,3")
    assert zero3["inter"] == zero3["inter_theory"] == zero3["intra"]
    assert float(zero3["inter_theory"]) == pytest.approx(4.5 * float(hybrid["inter_theory"]), abs=0.003)
    for row in (zero3, hybrid):
        for link in ("intra", "inter"):  # issued = theory at 3 decimals; the wire within 1% + headers
            assert row[link] == row[f"{link}_theory"], row
            assert 0 <= float(row[f"{link}_wire"]) - float(row[link]) <= 0.01 * float(row[link]) + 0.01, row
    # 08 holds twice 06's bytes at rest (sharded over G = 2, not N = 4), and steps faster
    assert float(hybrid["states_theory"]) == pytest.approx(2 * float(zero3["states_theory"]), abs=0.003)
    assert float(hybrid["step"]) < float(zero3["step"])


def test_results_times_each_tier_with_its_own_lesson_filter():
    from scripts.learn import results
    envs = {name: results.tier_env(env) for name, env in results.TIERS}  # (a LESSON given twice once raised)
    assert envs["make test LESSON=05"]["LESSON"] == "05"
    assert envs["make test"]["LESSON"] == envs["make test-all"]["LESSON"] == ""
