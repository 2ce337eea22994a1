"""docs/diffs/ holds the diffs between consecutive lessons; they must match the lessons."""
import json
import os
import subprocess
import sys

from harness import ROOT
from scripts.learn import diffs


def test_diffs_are_up_to_date():
    assert len(diffs.expected()) == len(diffs.diffed()) - 1
    assert diffs.stale() == [], "lessons changed: run `make diffs` (python -m scripts.learn.diffs)"
    # 03's idea is half in bucket.py: its diff shows the new file whole
    assert "\n--- /dev/null\n+++ bucket.py\n" in diffs.expected()["02_to_03.diff"]


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
