"""The house rules of the layout: every lesson small enough to read in one sitting, each support
module small enough to read at once beside it, and the README's layout naming every one of them.

Lesson code is what a student reads to learn the idea: 00-09, bucket.py (03's buckets, with
solution regions of its own), shard.py (04's sharded optimizer, with 04's regions) and model.py
(the GPT they all train, and its data), and they are all the root holds besides the folders and
the README.
Support is the package lessonkit/, one folder down: what is not a lesson's idea (set-up,
measurement, checkpoints, the optimizer side, 06-08's flat units and their order), each module
read where a lesson points to it.
"""
import ast
import glob
import os
import re
import subprocess

from graded import ROOT

SUPPORT_MAX_LINES = 250  # per module: a support module is read at once, next to a lesson
# a lesson is read in one sitting, nanoGPT's train.py is about 330 lines; bucket.py about 200
LESSON_MAX_LINES, OVER = 330, {"bucket.py": 200}
DOCSTRING_MAX_LINES = 25  # a lesson's docstring: its idea and its launch commands

def lines(path):
    with open(path, encoding="utf-8") as f:
        return sum(1 for _ in f)


def modules():
    """(the lesson code: every .py at the root, the support: lessonkit/*.py)"""
    return sorted(glob.glob(os.path.join(ROOT, "*.py"))), sorted(glob.glob(os.path.join(ROOT, "lessonkit", "*.py")))


def test_the_root_is_the_reading_path():
    names = {os.path.basename(p) for p in modules()[0]}
    assert all(n[:2].isdigit() or n in ("bucket.py", "shard.py", "model.py") for n in names), sorted(names)
    top = {p for p in os.listdir(ROOT) if not p.startswith(".") and p not in names and p not in ("runs", "__pycache__")}
    assert top <= {"Makefile", "README.md", "requirements.txt",
                   "lessonkit", "notebooks", "tests", "docs", "scripts"}, sorted(top)


def test_every_lesson_reads_in_one_sitting():
    too_long = {os.path.basename(p): lines(p) for p in modules()[0]
                if lines(p) > OVER.get(os.path.basename(p), LESSON_MAX_LINES)}
    assert not too_long, too_long


def test_every_lesson_docstring_is_its_idea_on_a_screen():
    too_long = {}
    for p in modules()[0]:
        with open(p, encoding="utf-8") as f:
            doc = ast.get_docstring(ast.parse(f.read())) or ""
        if len(doc.splitlines()) > DOCSTRING_MAX_LINES:
            too_long[os.path.basename(p)] = len(doc.splitlines())
    assert not too_long, too_long


def test_every_support_module_reads_at_once():
    too_long = {os.path.basename(p): lines(p) for p in modules()[1] if lines(p) > SUPPORT_MAX_LINES}
    assert not too_long, too_long


def test_the_readme_layout_names_every_module():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    layout = readme[readme.index("## Layout"):]
    missing = [os.path.basename(p) for p in modules()[1] if not p.endswith("__init__.py")
               and f"{os.path.basename(p)}`" not in layout]
    assert not missing, missing


def number(text):
    return int(text.replace(",", ""))  # "2,337"


def test_the_readmes_line_counts_are_the_files():
    """The README's budget paragraph gives each file's length: it once said 08 194 and the kit
    2,299 lines for a day after both had changed. Read from the files, not written down."""
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = " ".join(f.read().split())
    said = readme[readme.index("Each lesson is at most"):readme.index("each at most 250")]
    lesson, support = modules()
    by_prefix = {os.path.basename(p)[:2]: lines(p) for p in lesson if os.path.basename(p)[:2].isdigit()}
    listed = {k: int(v) for k, v in re.findall(r"\b(0\d) (\d+)[,.]", said)}
    assert listed == by_prefix, listed  # every lesson, each its length
    assert number(re.search(r"Each lesson is at most (\d+)", said)[1]) == LESSON_MAX_LINES
    for name in ("bucket.py", "shard.py", "model.py"):
        assert number(re.search(rf"`{name}` (\d+)", said)[1]) == lines(os.path.join(ROOT, name)), name
    kit, code = (number(x) for x in re.search(r"([\d,]+) lines against ([\d,]+)", said).groups())
    assert (kit, code) == (sum(map(lines, support)), sum(map(lines, lesson))), (kit, code)


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
        documented = re.findall(r"(?m)^([a-z0-9-]+):.*## ", f.read())
    assert listed == documented and {"demo", "test", "setup", "gpu-check", "fuzz"} <= set(listed), out.stdout


README_MAX_WORDS, DOCS_MAX_WORDS = 3000, 15000  # the README teaches; docs/ are manuals by topic


def _pages():
    return [os.path.join(ROOT, "README.md"), *sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))]


def _words(path):
    with open(path, encoding="utf-8") as f:
        return len(f.read().split())


def test_the_readme_and_the_docs_keep_their_word_budgets():
    readme, *docs = _pages()
    assert _words(readme) <= README_MAX_WORDS, _words(readme)
    assert sum(map(_words, docs)) <= DOCS_MAX_WORDS, sum(map(_words, docs))


def test_the_readme_and_the_docs_say_what_is_true_now_not_its_history():
    """No dates, commit hashes or sessions: git log keeps history. The one exception is each
    section header of the generated docs/results.md, which names the commit it measured."""
    found = []
    for page in _pages():
        with open(page, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if page.endswith("results.md") and line.startswith("Machine: "):
                    continue
                for hit in re.findall(r"\b20\d\d-[01]\d-[0-3]\d\b|\bsessions?\b|\b[0-9a-f]{7,40}\b", line, re.I):
                    if not hit.isdigit() and not hit.isalpha() or hit.lower().startswith("session"):
                        found.append(f"{os.path.relpath(page, ROOT)}:{number}: {hit}")
    assert not found, found
