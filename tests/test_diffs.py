"""docs/diffs/ holds the diffs between consecutive lessons; they must match the lessons."""
from scripts.learn import diffs


def test_diffs_are_up_to_date():
    assert len(diffs.expected()) == len(diffs.diffed()) - 1
    assert diffs.stale() == [], "lessons changed: run `make diffs` (python -m scripts.learn.diffs)"
    # 03's idea is half in bucket.py: its diff shows the new file whole
    assert "\n--- /dev/null\n+++ bucket.py\n" in diffs.expected()["02_to_03.diff"]


def test_diffs_are_stable():
    # the same lessons give byte-identical output (no timestamps, no dict-order effects)
    assert diffs.expected() == diffs.expected()
    for text in diffs.expected().values():
        assert text.startswith(diffs.HEADER) and "\n--- " in text and "\n+++ " in text
