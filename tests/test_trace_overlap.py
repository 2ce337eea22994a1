"""--trace and the overlap line: observed from outside the lessons (comm_meter.py), so checked here
on real runs of 01 (blocking all-reduces) and 03 (small buckets, async)."""
import contextlib
import functools
import io
import json
import os
import sys
import tempfile

from harness import run_lesson, spawn

ARGV = ["--steps", "3", "--n-layer", "2", "--d-model", "32", "--seq-len", "16",
        "--global-batch", "8", "--log-every", "100", "--peak-params", "0"]


def suite(trace_dir):
    return {"01": run_lesson("01_vanilla_dp", ARGV + ["--trace", trace_dir])["report"],
            "03": run_lesson("03_buckets", ARGV + ["--bucket-mb", "0.01"])["report"]}


@functools.lru_cache(maxsize=None)
def results():
    trace_dir = tempfile.mkdtemp(prefix="trace_")
    return trace_dir, spawn(2, suite, trace_dir)[0]


def test_trace_files_per_rank_and_timeline():
    trace_dir, _ = results()
    for rank in range(2):
        with open(os.path.join(trace_dir, f"trace_rank{rank}.json")) as f:
            assert json.load(f)["traceEvents"]
    assert os.path.getsize(os.path.join(trace_dir, "timeline.png")) > 0


def without_matplotlib(trace_dir):
    """In a rank: 01 traced where matplotlib cannot be imported (a lesson needs torch only)."""
    sys.modules["matplotlib"] = None  # `import matplotlib` now raises ImportError
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        run_lesson("01_vanilla_dp", ARGV + ["--trace", trace_dir])
    return out.getvalue()


def test_without_matplotlib_the_traces_are_written_and_the_timeline_skipped_in_one_line():
    trace_dir = tempfile.mkdtemp(prefix="trace_")
    printed = spawn(1, without_matplotlib, trace_dir)[0]
    assert f"--trace: {trace_dir}/timeline.png not drawn: matplotlib is not installed" in printed
    assert os.listdir(trace_dir) == ["trace_rank0.json"]


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
    assert 0 <= ov["hidden_share"] <= 1
