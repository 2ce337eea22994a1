"""--trace and the overlap line: observed from outside the lessons (comm_meter.py), so checked here
on real runs of 01 (blocking all-reduces) and 03 (small buckets, async)."""
import atexit
import contextlib
import copy
import functools
import io
import json
import os
import re
import shutil
import sys
import tempfile

from harness import PEAKS, run_lesson, spawn
from lessonkit.summary import print_summary

ARGV = ["--steps", "3", "--n-layer", "2", "--d-model", "32", "--seq-len", "16",
        "--global-batch", "8", "--log-every", "100", "--peak-params", "0"]


SAMPLED = [a for a in ARGV if a not in ("--peak-params", "0")] + ["--measure-step", "1"] + PEAKS  # sampling per op


def suite(trace_dir):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):  # 02 with the default --peak-params 1: its step 1 sampled
        sampled = {"02_sampled": run_lesson("02_async_allreduce", SAMPLED)["report"],
                   "02_last": run_lesson("02_async_allreduce", SAMPLED + ["--steps", "2"])["report"]}  # (the last --steps wins)
    traced = io.StringIO()
    with contextlib.redirect_stdout(traced):
        sampled["01"] = run_lesson("01_vanilla_dp", ARGV + ["--trace", trace_dir])["report"]
    return {"03": run_lesson("03_buckets", ARGV + ["--bucket-mb", "0.01"])["report"], **sampled,
            "printed": out.getvalue(), "printed_traced": traced.getvalue()}


@functools.lru_cache(maxsize=None)
def results():
    trace_dir = tempfile.mkdtemp(prefix="trace_")
    atexit.register(shutil.rmtree, trace_dir, True)  # (in this process: the ranks import this file too)
    return trace_dir, spawn(2, suite, trace_dir)[0]


def test_trace_files_per_rank_and_timeline():
    trace_dir, _ = results()
    for rank in range(2):
        with open(os.path.join(trace_dir, f"trace_rank{rank}.json")) as f:
            assert json.load(f)["traceEvents"]
    assert os.path.getsize(os.path.join(trace_dir, "timeline.png")) > 0
    # and rank 0 says where they went (it once wrote them without a word)
    assert (f"--trace: wrote {trace_dir}/timeline.png and {trace_dir}/trace_rank{{0..1}}.json (they open in "
            "https://ui.perfetto.dev)") in results()[1]["printed_traced"]


def without_matplotlib(trace_dir):
    """In a rank: 01 traced where matplotlib cannot be imported (a lesson needs torch only)."""
    sys.modules["matplotlib"] = None  # `import matplotlib` now raises ImportError
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        run_lesson("01_vanilla_dp", ARGV + ["--trace", trace_dir])
    return out.getvalue()


def test_without_matplotlib_the_traces_are_written_and_the_timeline_skipped_in_one_line(tmp_path):
    trace_dir = str(tmp_path)
    printed = spawn(1, without_matplotlib, trace_dir)[0]
    assert f"--trace: {trace_dir}/timeline.png not drawn: matplotlib is not installed (wrote {trace_dir}/trace_rank{{0..0}}" in printed
    assert os.listdir(trace_dir) == ["trace_rank0.json"]
    # one rank, nothing sent: no share of it to call hidden (once "hidden 100%", --peak-params 0 timing the step)
    assert "  overlap: n/a at world 1 (no other rank: nothing crosses a wire)" in printed.splitlines()


def test_the_summary_names_the_links_and_what_bounds_the_gradients():
    # (its lines once read "between nodes of 2 a 1 Gb/s link", and 01-03's bound "at rest + buckets in
    # flight", which only 05 has)
    r, printed = copy.deepcopy(results()[1]["02_sampled"]), results()[1]["printed"]
    assert re.search(r"peak during backward [0-9.]+ \(theory [0-9.]+: at rest\) \|", printed), printed
    r["config"].update(collectives="ring", link="10:5", inter_link="0.5:100", ranks_per_node=2)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print_summary(r)
    assert ("bytes sent per rank (rank 0), ring collectives on a 10 Gb/s, 5 us link and between nodes of 2 ranks, "
            "a 0.5 Gb/s, 100 us link: issued") in out.getvalue()


def test_blocking_all_reduce_hides_nothing():
    ov = results()[1]["01"]["comm"]["overlap"]
    assert ov["comm_ms"] > 0
    # every 01 all-reduce is blocking, so its span and its blocked interval are the same two clock
    # readings: exposed == comm, exactly
    assert ov["exposed_ms"] == ov["comm_ms"] and ov["hidden_share"] == 0


def test_async_buckets_overlap_fields():
    ov = results()[1]["03"]["comm"]["overlap"]
    assert set(ov) == {"comm_ms", "exposed_ms", "hidden_share"}
    assert 0 < ov["comm_ms"] and 0 <= ov["exposed_ms"] <= ov["comm_ms"] + 1e-9
    assert abs(ov["hidden_share"] - (1 - ov["exposed_ms"] / ov["comm_ms"])) < 1e-12  # (CommMeter.overlap's definition; ms, not s)


def test_with_memory_sampling_the_overlap_is_timed_in_the_step_after():
    # --peak-params 1 (the default) samples memory after every operation of the measured step,
    # slowing its compute several-fold: communication looks hidden behind it that a plain step
    # leaves exposed. So the overlap is timed in the next step, and the summary names it; where
    # the measured step is the last, it is not timed, and the summary says why
    r, last, printed = (results()[1][k] for k in ("02_sampled", "02_last", "printed"))
    assert r["comm"]["measured_step"] == 1 and r["comm"]["overlap_step"] == 2
    assert r["memory"]["per_rank"][0]["peak_params"] is not None  # it did sample step 1
    assert 0 < r["comm"]["overlap"]["comm_ms"] <= r["step_time_s"][2] * 1e3  # within step 2
    assert "overlap rank 0, step 2: comm" in printed
    assert last["comm"]["overlap"] is None and last["comm"]["overlap_step"] is None
    assert "overlap: not timed (step 1 sampled memory after every operation" in printed
    assert results()[1]["03"]["comm"]["overlap_step"] == results()[1]["03"]["comm"]["measured_step"]  # 0: that step
