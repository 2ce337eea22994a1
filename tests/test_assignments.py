"""Assignments: the fenced solution regions, the student edition cut from them, and its grading.

The edition is generated once into a temporary directory; the graded lessons are run against it
through the tests' adapter (DP_LESSONS, read by tests/graded.py) in one spawned launch. Grading
(editions, classes, hidden tests, levels): tests/test_course.py.
"""
import os
import textwrap
import time

import pytest
import torch
import torch.distributed as dist

import graded
from harness import ROOT, spawn

import scripts.course.student_edition as se
from scripts.course.grade import graded_files
from scripts.runs import LESSONS

# The graded lessons: the tools' (scripts/runs.py), 01-08, and 09
GRADED_LESSONS = list(LESSONS) + ["09_muon"]
# The files with solution regions: 04's are all in shard.py, as 03's first is in bucket.py
GRADED = [name for name in GRADED_LESSONS if name != "04_zero1"] + ["bucket", "shard"]
# The region a run of each lesson reaches first in the edition (03's is in bucket.py; 04's and
# 05's in shard.py, which builds their flat buffers).
FIRST = {"01_vanilla_dp": ("01_vanilla_dp.py", "average the gradients"),
         "02_async_allreduce": ("02_async_allreduce.py", "launch the gradient's all-reduce"),
         "03_buckets": ("bucket.py", "launch the full buckets, in order"),
         "04_zero1": ("shard.py", "my shard of the flat buffer"),
         "05_zero2": ("shard.py", "my shard of the flat buffer"),
         "06_zero3": ("06_zero3.py", "gather a unit"),
         "07_offload": ("07_offload.py", "upload every unit's shard"),  # before 06's gather
         "08_hybrid": ("08_hybrid.py", "the grid's groups"),  # before anything of 06's
         "09_muon": ("09_muon.py", "owners, balanced by Newton-Schulz work")}


@pytest.fixture(scope="module")
def edition(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("edition") / "student")
    assert se.main([out]) == 0
    return out


# ----------------------------------------------------------------------------- fences
def test_every_graded_file_has_balanced_fences_with_a_goal_and_a_recipe():
    recipes, titles = se.course_file(se.RECIPES), set()
    fenced = graded_files()  # the lessons 00-09 but 04, bucket.py and shard.py
    assert fenced == sorted(["00_collectives.py", *(f"{name}.py" for name in GRADED)])
    earlier = set()  # (title, code) of the regions of the files before, in reading order
    for name in fenced:
        with open(os.path.join(ROOT, name), encoding="utf-8") as f:
            text = f.read()
        found = se.regions(text, name)  # raises on a bad fence
        bodies = [(title, tuple(text.splitlines()[start:end])) for start, end, _, title, _ in found]
        # few and meaningful: a region repeated whole from an earlier file is not new work
        assert 1 <= len([b for b in bodies if b not in earlier]) <= 3, name
        earlier.update(bodies)
        for start, end, indent, title, blocks in found:
            assert title and set(blocks) == {"GOAL"}, (name, title)  # the guided recipe: recipes.toml
            assert end > max(after for _, after in blocks.values())  # code after the instructions
            assert recipes.get(name, {}).get(title, "").strip(), (name, title)
            titles.add((name, title))
    assert {(f, t) for f, ts in recipes.items() for t in ts} == titles  # none names a region gone


BAD = {  # case: (text, what the error says)
    "no_end": ("def f():\n    # ### BEGIN SOLUTION: x\n    # TODO: y\n    return 1\n", "has no END"),
    "end_alone": ("def f():\n    return 1\n    # ### END SOLUTION\n", "without a BEGIN"),
    "nested": ("def f():\n    # ### BEGIN SOLUTION: a\n    # TODO: y\n    # ### BEGIN SOLUTION: b\n",
               "inside the region opened at line 2"),
    "no_goal": ("def f():\n    # ### BEGIN SOLUTION: x\n    return 1\n    # ### END SOLUTION\n", "# GOAL:"),
    "misaligned": ("def f():\n    # ### BEGIN SOLUTION: x\n    # TODO: y\n    return 1\n  # ### END SOLUTION\n",
                   "not indented like its BEGIN"),
    "malformed": ("def f():\n    # ### BEGIN SOLUTION\n    return 1\n", "malformed fence"),
    "empty": ("def f():\n    # ### BEGIN SOLUTION: x\n    # TODO: y\n    # ### END SOLUTION\n", "no code"),
    "not_statements": ("x = (\n# ### BEGIN SOLUTION: x\n# TODO: y\n1\n# ### END SOLUTION\n)\n",
                       "not valid Python"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_fence_is_a_clear_error_naming_file_and_line(case, tmp_path):
    text, says = BAD[case]
    with pytest.raises(se.FenceError, match=r"^x\.py:\d+: ") as e:
        se.strip(text, "x.py")
    assert says in str(e.value)
    (tmp_path / "x.py").write_text(text)  # the command says so too, and exits 1
    assert se.main(["--check", "--source", str(tmp_path)]) == 1


GOAL_ONLY = textwrap.dedent('''\
    def f(x):
        y = 1
        # ### BEGIN SOLUTION: add "one"
        # GOAL: f returns x plus one
        #       (an int)
        if x:
            return x + y
        return y
        # ### END SOLUTION
    ''')
RECIPE = {'add "one"': "if x is truthy, return x + y (the int x plus one); otherwise return y alone, so that "
                      "f(0) is one as well"}


def test_stripping_writes_the_recipe_or_keeps_the_goal_and_is_idempotent():
    stripped = se.strip(GOAL_ONLY, "f.py", recipes=RECIPE)  # level guided: the recipe, wrapped to 100
    assert stripped == textwrap.dedent('''\
        def f(x):
            y = 1
            # ### BEGIN SOLUTION: add "one"
            # TODO: if x is truthy, return x + y (the int x plus one); otherwise return y alone, so that
            #       f(0) is one as well
            raise NotImplementedError("f.py: add \\"one\\" (see the TODO above)")
            # ### END SOLUTION
        ''')
    assert se.strip(stripped, "f.py", recipes={}) == stripped  # an edition's TODO stays
    scope = {}
    exec(stripped, scope)
    with pytest.raises(NotImplementedError, match=r'^f\.py: add "one" \(see the TODO above\)$'):
        scope["f"](1)
    standard = se.strip(GOAL_ONLY, "f.py", "standard", recipes={})
    assert "# GOAL: f returns x plus one\n    #       (an int)\n" in standard and "TODO" not in standard
    assert 'add \\"one\\" (see the GOAL above)' in standard and se.strip(standard, "f.py", "standard") == standard


def test_a_region_without_a_recipe_or_a_recipe_without_a_region_is_refused(tmp_path, monkeypatch, capsys):
    with pytest.raises(se.FenceError, match=r"^f\.py:3: region 'add \"one\"' has no recipe in "
                                            r"scripts/course/recipes\.toml \(under \[\"f\.py\"\]\)$"):
        se.strip(GOAL_ONLY, "f.py", recipes={"add one": "..."})
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "f.py").write_text(GOAL_ONLY)
    monkeypatch.setattr(se, "RECIPES", str(tmp_path / "recipes.toml"))
    (tmp_path / "recipes.toml").write_text('["f.py"]\n"add \\"one\\"" = "add them"\n"gone" = "was here"\n')
    assert se.main(["--check", "--source", str(tmp_path / "src")]) == 1
    assert 'recipes.toml: the recipe ["f.py"] "gone" has no region in f.py' in capsys.readouterr().err
    (tmp_path / "recipes.toml").write_text('["f.py"]\n"add \\"one\\"" = "add them"\n')
    assert se.main(["--check", "--source", str(tmp_path / "src")]) == 0


# ----------------------------------------------------------------------------- the edition
def test_edition_is_stripped_and_idempotent(edition, tmp_path):
    first = graded.tree(edition)
    for name in GRADED:
        solution = open(os.path.join(ROOT, f"{name}.py"), encoding="utf-8").read()
        text = first[f"{name}.py"][0].decode()
        assert text == se.strip(solution, f"{name}.py") and "NotImplementedError" in text
    assert not any(p.startswith(os.path.join("docs", "diffs")) for p in first)  # they hold the solutions
    assert "tests/test_assignments.py" not in first  # holds ROOT's solutions to passing
    assert "scripts/course/recipes.toml" not in first  # its text is in the edition's TODOs already
    assert "ASSIGNMENT.md" in first and "tests/harness.py" in first and "lessonkit/common.py" in first
    assert se.main([edition]) == 0  # again, in place: nothing changes
    assert graded.tree(edition) == first
    again = str(tmp_path / "again")
    assert se.main([again, "--source", edition]) == 0  # from the edition: the same bytes
    assert graded.tree(again) == first


def test_the_generator_refuses_to_overwrite_what_is_not_an_edition(tmp_path):
    (tmp_path / "work.py").write_text("mine\n")
    with pytest.raises(SystemExit, match="not a student edition"):
        se.main([str(tmp_path)])
    with pytest.raises(SystemExit, match="is the source"):
        se.main([ROOT])
    assert (tmp_path / "work.py").read_text() == "mine\n"


# ----------------------------------------------------------------------------- grading it
def _every_lesson_through_the_adapter():
    """In a spawned rank: build and train each lesson on the toy through tests/lessons.py."""
    from lessons import build
    from toy import toy_train
    out = {"files": {name: os.path.dirname(graded.load_lesson(name).__file__) for name in GRADED}}
    for lesson in GRADED_LESSONS:
        try:
            toy_train(build, lesson[:2], steps=1)
            out[lesson] = None
        except NotImplementedError as e:
            out[lesson] = str(e)
        dist.barrier()  # every rank failed at the same point: the group is still usable
    return out


def test_edition_loads_through_the_adapter_and_each_lesson_names_its_todo(edition, monkeypatch):
    monkeypatch.setenv("DP_LESSONS", edition)  # what the spawned ranks read
    for out in spawn(2, _every_lesson_through_the_adapter, timeout=120):
        assert set(out["files"].values()) == {edition}  # bucket.py and shard.py too, not the solutions'
        for lesson, (file, title) in FIRST.items():
            assert out[lesson] == se.message(file, title)


def _raise_on(ranks):
    if dist.get_rank() in ranks:
        raise NotImplementedError("06_zero3.py: gather a unit (see the TODO above)")
    dist.all_reduce(torch.zeros(1))  # the other rank: blocked in a collective


@pytest.mark.parametrize("ranks", [(0, 1), (1,)], ids=["every_rank", "one_rank"])
def test_a_failing_rank_ends_the_launch_quickly_with_its_message(ranks):
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"NotImplementedError: 06_zero3\.py: gather a unit") as e:
        spawn(2, _raise_on, ranks, timeout=60)
    assert "still running" not in str(e.value)
    # measured 4 s idle, 16 s on a loaded machine; a hang would be spawn's TimeoutError at 60 s.
    # It ends because the failing rank's exit closes its sockets: the peer's collective errors.
    assert time.monotonic() - t0 < 50
