"""The course kit for a class: editions at two levels that show no solution, hidden tests, and
grading a folder of submissions into grades.csv / grades.json, robust to the ones that hang,
crash or edit their tests. (Fences and the adapter: tests/test_assignments.py.)

Costly parts run once each, as subprocesses, and side by side: an untouched edition graded in
full (every lesson, hidden tests included), the solutions on the hidden tests (this suite runs
every visible test on the same files), and a class of four graded on lesson 01 only with limits
of a few seconds.
"""
import ast
import csv
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile

import pytest

from graded import tree
from harness import ROOT

import scripts.course.grade as grade
import scripts.course.student_edition as se

LESSON_NAMES = list(grade.load_points(grade.POINTS)[1])
GRADED = [f[:-3] for f in grade.graded_files()]
# The class's limits: a test of lesson 01 takes 2-4 s here while another grading runs beside it
# (the first one 6 s: it starts the forkserver), but a hidden test's launch of 3 fresh ranks took
# over 15 s once the grading beside it had lesson 07 too, and over 25 s (the crashing submission's
# first, which starts the forkserver) once it had 08 (2 cores, every process importing torch);
# the submission that hangs reaches its launches of ranks in turn, so it meets the per-test limit
# and then the run's. The good submission takes 13-16 s in all, but once over 45 s (the run's
# limit then) in a suite run. The class runs two at a time, the hanging one ("blocks": graded
# first, as names sort) beside the other three in turn, so it ends about when that one's 70 s do.
# The gap between the two limits is what the hanging submission has to reach its first test
# (pytest, torch, the lesson imported): at 45 and 55 s, on a machine 2.3x slower than the one
# these times come from (make demo 144 s against 64), it reached none before the run's limit,
# and no test of its timed out; 30 s of gap, and 40 s a test (above the 25 s seen once).
# With make grade's hidden tests alone, 01 is one launch: the run limit would never be reached, so
# the class is graded with --visible (01's visible tests, then its hidden ones), and the start-up
# gap is 50 s: five gradings beside each other here, each forkserver loading torch, took over 30.
TEST_LIMIT, RUN_LIMIT = 40, 90


@pytest.fixture(scope="module")
def editions(tmp_path_factory):
    out = {}
    for level in se.LEVELS:
        out[level] = str(tmp_path_factory.mktemp(level) / "student")
        assert se.main([out[level], "--level", level]) == 0
    return out


def _grade_class(folder, out, *flags):
    env = {k: v for k, v in os.environ.items() if k != "DP_LESSONS"}
    return subprocess.Popen([sys.executable, "-m", "scripts.course.grade_class", str(folder), "--out", str(out),
                             *flags], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _points_skipping(folder, worlds):
    """tests/points.toml with skip_worlds = `worlds`, written into folder."""
    with open(os.path.join(ROOT, "tests", "points.toml")) as f:
        text, n = re.subn(r"(?m)^skip_worlds = \[.*\]", f"skip_worlds = {worlds}", f.read())
    assert n == 1, "points.toml: one skip_worlds line"
    path = folder / "points.toml"
    path.write_text(text)
    return path


def _read(out):
    with open(os.path.join(out, "grades.csv"), newline="") as f:
        rows = {r["student"]: r for r in csv.DictReader(f)}
    with open(os.path.join(out, "grades.json")) as f:
        return rows, json.load(f)


# ----------------------------------------------------------------------------- the edition
def solution_lines():
    """{(file, title): [every non-trivial statement of the region, whitespace collapsed]}: a
    compound statement by its header; not a constant assignment (`x = None`), nor anything
    shorter than 12 characters, nor what the graded files show outside their regions anyway."""
    out, texts = {}, {}
    for name in GRADED:
        with open(os.path.join(ROOT, f"{name}.py"), encoding="utf-8") as f:
            texts[name] = f.read()
    # the code every graded file shows outside its regions (a later lesson may show an
    # earlier one's idea): given, wherever it occurs
    outside = " ".join(_flat("\n".join(l for l in se.strip(t, f"{n}.py").splitlines()
                                       if not l.strip().startswith("#"))) for n, t in texts.items())
    for name, text in texts.items():
        lines = text.splitlines()
        for start, end, indent, title, blocks in se.regions(text, f"{name}.py"):
            code = "\n".join(l[len(indent):] for l in lines[max(b for _, b in blocks.values()):end])
            found = [s for s in _statements(code) if len(s) >= 12 and s not in outside
                     and not re.fullmatch(r"[\w.\[\]]+ = (None|True|False|\d+)", s)]
            out[(f"{name}.py", title)] = found
    return out


def _statements(code):
    lines, out = code.splitlines(), []
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, (ast.For, ast.While, ast.If, ast.With)):
            out.append(_flat(lines[node.lineno - 1].split("  #")[0]))
        elif isinstance(node, ast.stmt):
            out.append(_flat(ast.get_source_segment(code, node)))
    return out


def _flat(text):
    return " ".join(text.split())


@pytest.mark.parametrize("level", sorted(se.LEVELS))
def test_no_file_of_the_edition_shows_a_solution_line(editions, level):
    files = {rel: _flat(data.decode("utf-8", "replace")) for rel, (data, _) in tree(editions[level]).items()}
    shown = []
    for (name, title), lines in solution_lines().items():
        assert lines, (name, title)  # every region has lines to look for
        for line in lines:
            shown += [f"{rel}: {line!r} ({name}: {title})" for rel, text in files.items() if line in text]
    assert not shown, "\n".join(shown)


def test_hidden_tests_and_answers_stay_out_of_the_edition_and_setup_goes_in(editions):
    files = tree(editions["guided"])
    assert not [f for f in files if f.startswith(("tests/hidden/", "docs/diffs/"))]
    for gone in ("tests/test_course.py", "tests/test_assignments.py", "docs/course.md", "docs/course_answers.md",
                 "scripts/course/recipes.toml"):  # the recipes would name every call at level standard
        assert gone not in files
    for kept in ("Makefile", "scripts/setup.sh", "requirements.txt", "tests/points.toml", "scripts/course/grade.py"):
        assert kept in files
    assignment = files["ASSIGNMENT.md"][0].decode()
    assert "make setup" in assignment and "## Questions: predict, then measure" in assignment
    for lesson in LESSON_NAMES:
        assert f"### {lesson}" in assignment
    # make's recipes resolve in the edition: set-up, the two quick-start commands, the grade
    dry = subprocess.run(["make", "-n", "setup", "demo", "test", "grade"], cwd=editions["guided"],
                         capture_output=True, text=True)
    assert dry.returncode == 0 and "scripts/setup.sh" in dry.stdout, dry.stderr


def test_two_levels_differ_only_in_the_instructions(editions):
    recipes = se.course_file(se.RECIPES)
    for name in GRADED:
        code = {}
        for level, label in se.LEVELS.items():
            with open(os.path.join(editions[level], f"{name}.py"), encoding="utf-8") as f:
                text = f.read()
            lines = text.splitlines()
            for _, _, _, title, blocks in se.regions(text, f"{name}.py"):
                assert set(blocks) == {label}, (name, level)
                if level == "guided":  # the recipe, whole: its text, wrapped under '# TODO:'
                    todo = [re.sub(r"^\s*#( TODO:)?\s+", "", l) for l in lines[slice(*blocks["TODO"])]]
                    assert " ".join(todo) == _flat(recipes[f"{name}.py"][title]), (name, title)
            code[level] = [l.replace(f"(see the {label} above)", "") for l in text.splitlines()
                           if not l.strip().startswith("#")]
        assert code["guided"] == code["standard"], name


def test_standard_instructions_name_no_call_of_the_solutions():
    for name in GRADED:
        with open(os.path.join(ROOT, f"{name}.py"), encoding="utf-8") as f:
            text = f.read()
        lines = text.splitlines()
        for start, end, indent, title, blocks in se.regions(text, f"{name}.py"):
            goal = "\n".join(lines[slice(*blocks["GOAL"])])
            code = "\n".join(l[len(indent):] for l in lines[max(b for _, b in blocks.values()):end])
            called = {n.func.attr if isinstance(n.func, ast.Attribute) else getattr(n.func, "id", "")
                      for n in ast.walk(ast.parse(code)) if isinstance(n, ast.Call)}
            assert not re.search(r"\w\(", goal), (name, title, goal)  # no call written out
            named = {c for c in called if ("_" in c or len(c) > 6) and re.search(rf"\b{re.escape(c)}\b", goal)}
            assert not named, (name, title, named)  # nor the name of one the solution makes


# ----------------------------------------------------------------------------- grading
@pytest.fixture(scope="module")
def graded_runs(editions, tmp_path_factory):
    """The costly gradings at once: an untouched edition (every lesson, hidden tests included),
    the solutions on the hidden tests, and a class of four on lesson 01 with limits of seconds."""
    full, solved = tmp_path_factory.mktemp("full"), tmp_path_factory.mktemp("solved")
    (solved / "solutions").mkdir()
    for name in GRADED:
        shutil.copy(os.path.join(ROOT, f"{name}.py"), solved / "solutions")
    # the solutions but one line: 05 keeps every full-size bucket (it trains as it should)
    shutil.copytree(solved / "solutions", solved / "keeps_buckets")
    kept = solved / "keeps_buckets" / "05_zero2.py"
    text, n = re.subn(r"(?m)^(\s+)bucket\.buffer = None\b.*$", r"\1pass", kept.read_text())
    assert n == 1, "05_zero2.py: one line frees the bucket"
    kept.write_text(text)
    with zipfile.ZipFile(full / "untouched.zip", "w") as z:  # an archive, one folder down
        for name in GRADED:
            z.write(os.path.join(editions["guided"], f"{name}.py"), f"student/{name}.py")
    klass = tmp_path_factory.mktemp("class")
    for student in ("good", "blocks", "crashes", "edits_tests"):
        shutil.copytree(editions["guided"], klass / student, ignore=shutil.ignore_patterns("notebooks", "docs"))
    shutil.copy(os.path.join(ROOT, "01_vanilla_dp.py"), klass / "good")
    region = re.compile(r'raise NotImplementedError\("01_vanilla_dp\.py: average the gradients[^\n]*')
    # it blocks and prints without end (slowly: a busy loop would take a core from the gradings beside it)
    blocks = klass / "blocks" / "01_vanilla_dp.py"
    blocks.write_text(region.sub("while True:\n            print('x' * 200, flush=True)\n"
                                 "            __import__('time').sleep(0.001)", blocks.read_text()))
    crashes = klass / "crashes" / "01_vanilla_dp.py"
    crashes.write_text(crashes.read_text().replace("import torch\n", "import torch\nraise SystemExit('boom')\n", 1))
    for test in ("test_01_vanilla.py", "points.toml"):  # its region untouched, its tests made to pass
        (klass / "edits_tests" / "tests" / test).write_text("def test_ok():\n    pass\n")
    # 05 stands for a lesson that builds on bucket.py without owning it, graded by one test that
    # needs bucket.py's region (05's own tests take a minute): the edition's bucket.py fails it,
    # so 05 is graded again with the reference one, and passes
    regrade = tmp_path_factory.mktemp("regrade")
    for name in GRADED:
        shutil.copy(os.path.join(editions["guided"] if name == "bucket" else ROOT, f"{name}.py"), regrade)
    uses = "tests/test_bucket.py::test_buckets_launch_in_order_even_when_a_later_one_fills_first"
    (regrade / "points.toml").write_text(
        '[lessons.03_buckets]\npoints = 15\nvisible = {weight = 1, tests = ["tests/test_bucket.py"]}\n'
        f'[lessons.05_zero2]\npoints = 20\nvisible = {{weight = 1, tests = ["{uses}"]}}\n'
        'uses = {bucket = "tests/test_bucket.py"}\n')
    env = {k: v for k, v in os.environ.items() if k != "DP_LESSONS"}
    procs = {"regrade": subprocess.Popen([sys.executable, "-m", "scripts.course.grade", str(regrade), "--points",
                                          str(regrade / "points.toml")], cwd=ROOT, env=env, text=True,
                                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT),
             # the visible tests at world 1 only: the suite itself runs them at every world size on
             # these same files; the grader's path (sandbox, hidden tests at 3 ranks) is what runs here
             # A per-test limit of 300 s, not points.toml's 120: this grading runs beside two others
             # on 2 cores, and a test that launches ranks twice as fresh interpreters (08's first,
             # results(4) then results(2)) once ran past 120 s in the untouched edition, under the
             # load of other processes besides (6 s alone; the class's hanging submission then printed
             # in a busy loop, a core's worth, and now sleeps). The limits are the class's test, below.
             "full": _grade_class(full, full / "out", "--points", str(_points_skipping(full, [2, 4])),
                                  "--test-timeout", "300", "--visible"),
             # as make grade-class grades, the hidden tests: the solutions' visible tests are this
             # suite's own, and what is theirs here is the grader's sandbox with every region filled in
             "solved": _grade_class(solved, solved / "out", "--test-timeout", "300"),
             # two at a time: the hanging submission waits out its limit beside the other three
             "class": _grade_class(klass, klass / "out", "--lessons", "01", "--jobs", "2", "--visible",
                                   "--test-timeout", str(TEST_LIMIT), "--timeout", str(RUN_LIMIT))}
    outputs = {k: p.communicate(timeout=600)[0] for k, p in procs.items()}  # (a test's limit fires first)
    for k, p in procs.items():
        assert p.returncode == 0, outputs[k]
    return {"full": (_read(full / "out"), outputs["full"]), "solved": (_read(solved / "out"), outputs["solved"]),
            "class": (_read(klass / "out"), outputs["class"]), "regrade": outputs["regrade"]}


def test_an_untouched_edition_scores_zero_failing_every_graded_test_at_its_region(graded_runs):
    (rows, report), output = graded_runs["full"]
    assert list(next(iter(rows.values()))) == ["student", *LESSON_NAMES, "total", "max", "status", "seconds"]
    untouched = rows["untouched"]
    for lesson in LESSON_NAMES:
        assert float(untouched[lesson]) == 0, (lesson, output)
        mine = report["students"]["untouched"]["lessons"][lesson]
        assert mine["total"] > 0 and mine["passed"] == 0  # its graded tests ran, and every one failed
        assert set(mine["groups"]) == {"visible", "hidden"}, (lesson, mine["groups"])
        other = {test: why for test, why in mine["failing"].items() if not why.startswith("NotImplementedError: ")}
        assert not other, f"{lesson}: failed for another reason than its region: {json.dumps(other, indent=1)}"
    assert untouched["status"] == "ok" and untouched["max"] == f"{sum(report['points'].values()):g}"


def test_the_solutions_score_full_marks_on_the_hidden_tests_and_a_bucket_kept_costs_05_only(graded_runs):
    (rows, report), output = graded_runs["solved"]
    solutions, kept = rows["solutions"], rows["keeps_buckets"]
    for lesson in LESSON_NAMES:
        assert float(solutions[lesson]) == report["points"][lesson] > 0, (lesson, output)
        assert set(report["students"]["solutions"]["lessons"][lesson]["groups"]) == {"hidden"}, (lesson, output)
        assert report["students"]["solutions"]["lessons"][lesson]["groups"]["hidden"][1] > 0, (lesson, output)
        # (05: 5 of its 6 hidden tests pass)
        assert float(kept[lesson]) == (float(solutions[lesson]) if lesson != "05_zero2" else round(20 * 5 / 6, 2)), lesson
    assert solutions["total"] == solutions["max"] and solutions["status"] == "ok", output
    failing = report["students"]["keeps_buckets"]["lessons"]["05_zero2"]["failing"]
    assert list(failing) == ["tests/hidden/test_hidden_05.py::test_at_rest_my_gradient_slices_and_no_bucket_left_over"]


def test_a_class_with_a_hang_a_crash_and_edited_tests_each_costs_its_own_row(graded_runs):
    (rows, report), output = graded_runs["class"]
    assert set(rows) == {"good", "blocks", "crashes", "edits_tests"}, output
    assert float(rows["good"]["01_vanilla_dp"]) == report["points"]["01_vanilla_dp"] == 10, output
    for student in ("blocks", "crashes", "edits_tests"):
        assert float(rows[student]["01_vanilla_dp"]) == 0, (student, output)
        assert float(rows[student]["seconds"]) < RUN_LIMIT + 15, (student, output)  # its limit, and a margin
    assert rows["blocks"]["status"] == f"timed out after {RUN_LIMIT} s", output
    assert rows["good"]["status"] == rows["crashes"]["status"] == rows["edits_tests"]["status"] == "ok"
    reasons = {s: set(report["students"][s]["lessons"]["01_vanilla_dp"]["failing"].values()) for s in rows}
    assert any("GradeTimeout" in r for r in reasons["blocks"]), reasons["blocks"]
    # the crash is named; a rank still connecting when its peer died may report the lost peer instead
    assert any("boom" in r for r in reasons["crashes"]), reasons["crashes"]
    assert not any("NotImplementedError" in r for r in reasons["crashes"]), reasons["crashes"]
    assert all("NotImplementedError: 01_vanilla_dp.py: average the gradients" in r for r in reasons["edits_tests"])


def test_a_lesson_is_regraded_with_the_reference_of_a_file_it_uses(graded_runs):
    table = " ".join(graded_runs["regrade"].split())
    assert "05_zero2 1/1 20/20 PASS" in table, graded_runs["regrade"]
    assert re.search(r"03_buckets \d+/\d+ [\d.]+/15 FAIL", table), graded_runs["regrade"]  # 03 pays for it
    assert "05_zero2: graded with the reference bucket.py (the edition's fails tests/test_bucket.py)" in table
    assert "NotImplementedError: bucket.py: launch the full buckets, in order" in table


def test_points_split_over_weighted_groups_with_partial_credit():
    spec = {"points": 10, "partial": True, "uses": {},
            "visible": {"weight": 6, "tests": ["tests/a.py"], "weights": {"tests/a.py::heavy": 3}},
            "hidden": {"weight": 4, "tests": ["tests/hidden/b.py"], "weights": {}}}
    results = {"tests/a.py::heavy[1]": (True, ""), "tests/a.py::light": (False, "boom"),
               "tests/hidden/b.py::x": (True, ""), "tests/hidden/b.py::y": (False, "bang")}
    row = grade.score(results, "l", spec)
    assert row["earned"] == 6 * 3 / 4 + 4 * 1 / 2  # heavy weighs 3 of 4; hidden: 1 of 2
    assert row["failing"] == {"tests/a.py::light": "boom", "tests/hidden/b.py::y": "bang"}
    assert grade.score(results, "l", dict(spec, partial=False))["earned"] == 0
    # one group counted (the hidden tests, make grade's; or the visible ones, inside an edition):
    # it earns all of the lesson's points
    hidden_only = grade.score(results, "l", spec, kinds=("hidden",))
    assert (hidden_only["points"], hidden_only["earned"]) == (10, 5)
    visible_only = grade.score(results, "l", spec, kinds=("visible",))
    assert (visible_only["points"], visible_only["earned"]) == (10, 7.5)


def test_each_failing_test_is_recorded_with_the_line_that_says_why(tmp_path, monkeypatch):
    # the grader's plugin, run as the grader runs it (--tb=native): the reason comes from the
    # exception itself, whatever pytest prints
    (tmp_path / "test_x.py").write_text(
        "import pytest\n"
        "def test_ok():\n    pass\n"
        "def test_says_why():\n    x = [1, 2]\n    assert len(x) == 3, 'wanted three'\n"
        "def test_plain_assert():\n    assert 1 + 1 == 3\n"
        "def test_a_rank_failed():\n    raise RuntimeError('rank 1 failed:\\nTraceback (most recent call last):\\n'\n"
        "                       '  File \"x.py\", line 1\\nValueError: bad shape')\n"
        "def test_region():\n    raise NotImplementedError('01_vanilla_dp.py: average the gradients')\n"
        "@pytest.fixture\ndef broken():\n    raise KeyError('no such rank')\n"
        "def test_setup_fails(broken):\n    pass\n"
        "def test_region_under_a_wrapper():\n    try:\n        raise NotImplementedError('06_zero3.py: gather a unit')\n"
        "    except NotImplementedError as e:\n        raise RuntimeError('the step failed') from e\n"
        "class Odd(Exception):\n    def __str__(self):\n        raise ValueError('no text')\n"
        "def test_an_exception_without_text():\n    raise Odd()\n"
        "def test_an_assert_showing_output():\n    assert 'ok' in 'ValueError: in the output', 'the run printed'\n")
    monkeypatch.setenv("PYTHONPATH", ROOT)
    results, status, _, _ = grade.run_tests(str(tmp_path), ["test_x.py"], 60, 120)
    assert status == "ok", results
    assert results == {"test_x.py::test_ok": (True, ""),
                       "test_x.py::test_says_why": (False, "AssertionError: wanted three"),
                       "test_x.py::test_plain_assert": (False, "AssertionError: assert (1 + 1) == 3"),
                       "test_x.py::test_a_rank_failed": (False, "ValueError: bad shape"),
                       "test_x.py::test_region": (False, "NotImplementedError: 01_vanilla_dp.py: average the gradients"),
                       "test_x.py::test_setup_fails": (False, "KeyError: 'no such rank'"),
                       "test_x.py::test_region_under_a_wrapper": (False, "NotImplementedError: 06_zero3.py: gather a unit"),
                       "test_x.py::test_an_exception_without_text": (False, "test_x.Odd: <exception str() failed>"),
                       "test_x.py::test_an_assert_showing_output": (False, "AssertionError: the run printed")}


def test_grade_class_grades_as_many_at_once_as_this_process_has_cpus(tmp_path, monkeypatch, capsys):
    # a container or `taskset` allows 3 of the machine's 64 CPUs: 64 gradings at once would take turns
    from scripts.course import grade_class
    (tmp_path / "alice").mkdir()
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 5, 9}, raising=False)
    monkeypatch.setattr(grade_class, "grade_one", lambda student, *_: {"student": student, "rows": [], "status": "ok",
                                                                       "seconds": 0.0})
    monkeypatch.setattr(grade_class, "write", lambda *_: None)
    assert grade_class.main([str(tmp_path), "--lessons", "01"]) == 0
    assert f"grading 1 submissions from {tmp_path}, 3 at a time" in capsys.readouterr().out


def test_grade_class_without_a_folder_says_so_in_one_line():
    # -n: make checks the recipe's guard without running set-up or grading anything
    out = subprocess.run(["make", "-n", "grade-class"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode != 0 and out.stderr.strip().count("\n") == 0, out.stderr
    assert "make grade-class SUBMISSIONS=DIR" in out.stderr


def test_an_edition_that_cannot_be_written_says_so_in_one_line(tmp_path, capsys):
    blocked = tmp_path / "a_file"
    blocked.write_text("")
    assert se.main([str(blocked / "student")]) == 1  # not a traceback from os.makedirs
    assert capsys.readouterr().err.startswith(f"error: cannot write the edition to {blocked / 'student'}: Not a directory")


@pytest.mark.parametrize("filtered", [True, False])  # False: a Python without tarfile.data_filter
def test_an_archive_unpacks_inside_its_folder_only(tmp_path, monkeypatch, filtered):
    import io
    import tarfile

    from scripts.course import grade_class
    if not filtered:
        monkeypatch.delattr(tarfile, "data_filter", raising=False)

    def archive(name, members):
        path = tmp_path / name
        with tarfile.open(path, "w:gz") as t:
            for member, data in members.items():
                info = tarfile.TarInfo(member)
                info.size = len(data)
                t.addfile(info, io.BytesIO(data))
        return str(path)
    good = archive("good.tar.gz", {"alice/01_vanilla_dp.py": b"x = 1\n"})
    assert grade_class.unpack(good, str(tmp_path / "a")).endswith("alice")
    bad = archive("bad.tar.gz", {"../escaped.py": b"x = 1\n", "01_vanilla_dp.py": b"x = 1\n"})
    with pytest.raises((ValueError, tarfile.TarError)):
        grade_class.unpack(bad, str(tmp_path / "b"))
    assert not (tmp_path / "escaped.py").exists()
