"""--trace and the overlap line: observed from outside the lessons (comm_meter.py), so checked here
on real runs of 01 (blocking all-reduces) and 03 (small buckets, async)."""
import functools
import json
import os
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
