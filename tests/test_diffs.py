"""docs/diffs/ holds the diffs between consecutive lessons; they must match the lessons."""
import json
import os
import subprocess
import sys

from harness import ROOT
from scripts.learn import diffs


def test_diffs_are_up_to_date():
    assert len(diffs.expected()) == len(diffs.diffed()) - 1 + len(diffs.FROM)  # (09: from 04)
    assert diffs.stale() == [], "lessons changed: run `make diffs` (python -m scripts.learn.diffs)"
    # 03's idea is half in bucket.py, 04's in shard.py: their diffs show the new file whole
    assert "\n--- /dev/null\n+++ bucket.py\n" in diffs.expected()["02_to_03.diff"]
    assert "\n--- /dev/null\n+++ shard.py\n" in diffs.expected()["03_to_04.diff"]


def test_diffs_are_stable():
    # the same lessons give byte-identical output in another process, under another hash seed
    # (no timestamps, no set- or dict-order effects)
    code = "import json; from scripts.learn import diffs; print(json.dumps(diffs.expected()))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=dict(os.environ, PYTHONHASHSEED="12345"),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == diffs.expected()
    for text in diffs.expected().values():
        assert text.startswith(diffs.HEADER) and "\n--- " in text and "\n+++ " in text


# Changed lines (removed + added, as `diff` prints them) between consecutive lessons' files (a
# file a lesson introduces, bucket.py or shard.py, shown whole in docs/diffs/, is not counted):
# each step's idea and little else, 150 at most, 350 for ZeRO-3.
CHANGED_LINES = {("01_vanilla_dp", "02_async_allreduce"): 150, ("02_async_allreduce", "03_buckets"): 150,
                 ("03_buckets", "04_zero1"): 150, ("04_zero1", "05_zero2"): 150, ("05_zero2", "06_zero3"): 350}


def test_each_diff_is_the_idea_within_its_budget():
    over = {}
    for (old, new), budget in CHANGED_LINES.items():
        out = subprocess.run(["diff", f"{old}.py", f"{new}.py"], cwd=ROOT, capture_output=True, text=True)
        changed = sum(line[:2] in ("< ", "> ") or line in ("<", ">") for line in out.stdout.splitlines())
        if changed > budget:
            over[f"{old[:2]}->{new[:2]}"] = (changed, budget)
    assert not over, over
