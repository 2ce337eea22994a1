"""The house rules of the layout (issue 16): the support modules stay smaller than the lesson code
they serve, each one small enough to read at once, and the README's layout names every one of them.

Lesson code is what a student reads to learn the idea: 00-06, bucket.py (03's and 05's buckets,
with solution regions of its own) and model.py (the GPT they all train, and its data), and they
are all the root holds besides the folders and the README (issue 27). Support is the package
lessonkit/, one folder down: set-up, measurement, checkpoints, robustness, the shared optimizer
side.
"""
import glob
import os
import re
import subprocess

from graded import ROOT

SUPPORT_MAX_LINES = 250  # per module: a support module is read at once, next to a lesson
# a lesson is read in one sitting: about 300 lines (nanoGPT's train.py is ~330), bucket.py about 200.
# 06 is over, and says so in the README: five mechanisms arrive at once, and fp16, checkpointing
# and the hooks 07 and 08 build on grew it, then units of several modules (07's chunks, FSDP2's
# fully_shard([...])); its ceiling is where it stands, so it cannot grow unseen
LESSON_MAX_LINES, OVER = 300, {"bucket.py": 200, "06_zero3.py": 474}


def lines(path):
    with open(path, encoding="utf-8") as f:
        return sum(1 for _ in f)


def modules():
    """(the lesson code: every .py at the root, the support: lessonkit/*.py)"""
    return sorted(glob.glob(os.path.join(ROOT, "*.py"))), sorted(glob.glob(os.path.join(ROOT, "lessonkit", "*.py")))


def test_the_root_is_the_reading_path():
    names = {os.path.basename(p) for p in modules()[0]}
    assert all(n[:2].isdigit() or n in ("bucket.py", "model.py") for n in names), sorted(names)
    top = {p for p in os.listdir(ROOT) if not p.startswith(".") and p not in names and p not in ("runs", "__pycache__")}
    assert top <= {"Makefile", "README.md", "requirements.txt",
                   "lessonkit", "notebooks", "tests", "docs", "scripts"}, sorted(top)


def test_support_is_smaller_than_the_lessons():
    lesson, support = modules()
    assert len(lesson) >= 9, [os.path.basename(p) for p in lesson]  # 00-06 and on, bucket.py, model.py
    assert sum(map(lines, support)) < sum(map(lines, lesson)), (sum(map(lines, support)), sum(map(lines, lesson)))


def test_every_lesson_reads_in_one_sitting():
    too_long = {os.path.basename(p): lines(p) for p in modules()[0]
                if lines(p) > OVER.get(os.path.basename(p), LESSON_MAX_LINES)}
    assert not too_long, too_long


def test_every_support_module_reads_at_once():
    too_long = {os.path.basename(p): lines(p) for p in modules()[1] if lines(p) > SUPPORT_MAX_LINES}
    assert not too_long, too_long


def test_the_readme_layout_names_every_module():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    layout = readme[readme.index("Layout:"):]
    missing = [os.path.basename(p) for p in modules()[1] if not p.endswith("__init__.py")
               and f"{os.path.basename(p)}`" not in layout]
    assert not missing, missing


def test_every_relative_link_in_the_docs_leads_to_a_file():
    """A moved or renamed file must not leave a reader's link pointing at nothing."""
    broken = []
    for page in [os.path.join(ROOT, "README.md"), *glob.glob(os.path.join(ROOT, "docs", "*.md"))]:
        with open(page, encoding="utf-8") as f:
            targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", f.read())
        broken += [(os.path.relpath(page, ROOT), t) for t in targets if not t.startswith(("http:", "https:", "mailto:"))
                   and not os.path.exists(os.path.join(os.path.dirname(page), t))]
    assert not broken, broken


def test_plain_make_lists_every_documented_target():
    out = subprocess.run(["make"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    listed = [line.split()[1] for line in out.stdout.splitlines() if line.startswith("  make ")]
    with open(os.path.join(ROOT, "Makefile")) as f:
        documented = re.findall(r"(?m)^([a-z-]+):.*## ", f.read())
    assert listed == documented and {"demo", "test", "setup", "gpu-check", "fuzz"} <= set(listed), out.stdout
