"""Grade one student edition: run the graded tests against its lessons, print points per lesson.

    python -m scripts.course.grade student/                  # or: make grade EDITION=student
    python -m scripts.course.grade                           # this checkout (inside an edition: itself)
    python -m scripts.course.grade student/ --lessons 01 03  # some lessons only
    python -m scripts.course.grade student/ --visible        # the visible tests counted too (minutes)
    python -m scripts.course.grade_class submissions/        # a whole class: grades.csv, grades.json

Only the graded files (the lessons, bucket.py and shard.py: the files with solution regions) are taken from
the edition. They are copied into a fresh directory beside this checkout's support modules, tests
and hidden tests (tests/hidden/), and one pytest process runs every graded test there, through
scripts/course/plugin.py: each test has a time limit, the run as a whole another, and results
are recorded as tests end. So a student's edited tests or support modules change nothing, and a
lesson that hangs costs that lesson's tests only. tests/points.toml says which tests grade which
lesson (visible ones, shipped in the edition, and hidden ones), their weights, and which groups
count: the hidden ones (one launch of 3 ranks per lesson: seconds a submission), or with
--visible the visible ones too (each lesson at 1 and 2 ranks: minutes). The counted groups share
a lesson's points by their weights.

A lesson that `uses` a graded file it does not own (05: bucket.py, 03's, and shard.py, 04's) and loses points while
that file fails its own tests is graded again with this checkout's copy of it, and the table says
so. Inside a student edition there is no other copy, and no hidden test: the edition is graded
against its own files, visible tests only, and the table says that too. The exit code is 0 once
the table is printed, whatever the grade; 2 if the grading itself could not run.
"""
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import tomllib

from scripts.course import student_edition as se
from scripts.runs import ROOT, Parser, at_least

POINTS = os.path.join(ROOT, "tests", "points.toml")
INSIDE_EDITION = os.path.exists(os.path.join(ROOT, se.STAMP))  # this checkout is a student edition
KINDS = ("visible", "hidden")
VISIBLE_HELP = ("count the visible tests too, beside points.toml's groups (each lesson at 1 and 2 ranks: "
                "minutes a submission, not seconds)")


# ----------------------------------------------------------------------------- points.toml
def load_points(path, only=None):
    """(settings, {lesson: {"points", "partial", "visible", "hidden", "uses"}}), restricted to lessons
    starting with one of `only` ("01", "03_buckets", ...). A group is {"weight", "tests",
    "weights" {test: weight}}."""
    try:
        with open(path, "rb") as f:
            cfg = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as e:  # missing, a folder, not TOML
        raise SystemExit(f"error: --points {path}: {getattr(e, 'strerror', None) or e}") from None
    lessons = cfg.get("lessons", {})
    for name, spec in lessons.items():
        if not isinstance(spec.get("points"), (int, float)) or not any(k in spec for k in KINDS):
            raise SystemExit(f"error: {path}: lessons.{name} needs points = <number> and a visible and/or "
                             "hidden group: {weight = <number>, tests = [...]}")
        for kind in KINDS:
            group = spec.get(kind)
            if group is not None and (not group.get("tests") or not isinstance(group.get("weight", 1), (int, float))):
                raise SystemExit(f"error: {path}: lessons.{name}.{kind} needs tests = [...] (and weight = <number>)")
            if group is not None:
                group.setdefault("weight", 1)
                group.setdefault("weights", {})
        spec.setdefault("partial", cfg.get("partial_credit", True))
        if not isinstance(spec.setdefault("uses", {}), dict):
            raise SystemExit(f"error: {path}: lessons.{name}.uses must be a table, e.g. {{bucket = \"tests/test_bucket.py\"}}")
        for f, tests in spec["uses"].items():  # a file's tests, of either group: the counted ones decide
            spec["uses"][f] = [tests] if isinstance(tests, str) else list(tests)
    if only:
        unknown = [o for o in only if not any(n.startswith(o) for n in lessons)]
        if unknown:
            raise SystemExit(f"error: no lesson {', '.join(unknown)} in {path} (it has {', '.join(lessons)})")
        lessons = {n: s for n, s in lessons.items() if any(n.startswith(o) for o in only)}
    counted = cfg.get("groups", list(KINDS))
    if not isinstance(counted, list) or not counted or not set(counted) <= set(KINDS):
        raise SystemExit(f"error: {path}: groups must name some of {', '.join(KINDS)}, e.g. groups = [\"hidden\"]")
    settings = {"skip_worlds": cfg.get("skip_worlds", []), "test_timeout": cfg.get("test_timeout", 120),
                "timeout": cfg.get("timeout", 600), "groups": tuple(k for k in KINDS if k in counted)}
    return settings, lessons


def groups(spec):
    return [(kind, spec[kind]) for kind in KINDS if kind in spec]


def kind_of(test):
    """The group a test spec belongs to: the hidden tests live in tests/hidden/."""
    return "hidden" if test.startswith("tests/hidden/") else "visible"


def uses_tests(spec, f, kinds=KINDS):
    """The tests of the file `f` a lesson uses, in the groups counted."""
    return [t for t in spec["uses"][f] if kind_of(t) in kinds]


def test_specs(lessons, kinds=KINDS):
    """Every test file or node id the lessons name in the groups of `kinds` (their `uses` too),
    once, in order."""
    out = []
    for spec in lessons.values():
        out += [t for kind, g in groups(spec) if kind in kinds for t in g["tests"]]
        out += [t for f in spec["uses"] for t in uses_tests(spec, f, kinds)]
    return list(dict.fromkeys(out))


def present(spec, checkout=ROOT):
    """Whether the test file of a test spec exists in `checkout`."""
    return os.path.exists(os.path.join(checkout, spec.split("::")[0]))


# ----------------------------------------------------------------------------- running
def graded_files(checkout=ROOT):
    """The graded files: the top-level .py files of `checkout` that hold solution regions."""
    names = []
    for f in sorted(os.listdir(checkout)):
        if f.endswith(".py"):
            with open(os.path.join(checkout, f), encoding="utf-8") as fh:
                if any(se.BEGIN.match(line) for line in fh):  # an edition's are still fenced
                    names.append(f)
    return names


def sandbox(submission, dest, checkout=ROOT, reference=()):
    """Fill `dest` with `checkout`'s support modules, tests and tools (model.py, lessonkit/,
    tests/, scripts/) and the submission's graded files (but `reference`'s, from `checkout`)."""
    graded = graded_files(checkout)
    for rel in se.source_files(checkout, skip=False):
        top = "/" not in rel
        if (top and rel.endswith(".py") and rel not in graded) or rel.startswith(("lessonkit/", "tests/", "scripts/")):
            _copy(os.path.join(checkout, rel), os.path.join(dest, rel))
    for name in graded:
        src = os.path.join(checkout if name[:-3] in reference else submission, name)
        if os.path.isfile(src):  # a missing one fails its tests, with "no such file"
            _copy(src, os.path.join(dest, name))


def _copy(src, dst):
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    shutil.copyfile(src, dst)


class _Tail:
    """Read a pipe to its end, keeping only its last `keep` bytes: a run that prints without end
    costs the reading, not the memory or the disk."""

    def __init__(self, pipe, keep=20000):
        self.keep, self.data = keep, b""
        self.thread = threading.Thread(target=self._read, args=(pipe,), daemon=True)
        self.thread.start()

    def _read(self, pipe):
        for chunk in iter(lambda: pipe.read(65536), b""):
            self.data = (self.data + chunk)[-self.keep:]

    def text(self):
        self.thread.join(5)
        return self.data.decode("utf-8", "replace")


def run_tests(where, tests, test_timeout, timeout, skip_worlds=(), verbose=False):
    """One pytest process over `tests` in the directory `where`; returns (results {node id: (ok,
    reason)}, status "ok" | "timed out" | "error", seconds, the output's tail). `timeout`: for the
    whole run, which is killed with every process it started (its own session)."""
    results_path = os.path.join(os.path.dirname(where), f"{os.path.basename(where)}.results.jsonl")
    env = {k: v for k, v in os.environ.items() if k not in ("DP_LESSONS", "DP_REFERENCE", "PYTEST_ADDOPTS")}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHONDONTWRITEBYTECODE="1",
               DP_GRADE_RESULTS=results_path, DP_GRADE_TEST_TIMEOUT=str(test_timeout),
               DP_GRADE_SKIP_WORLDS=",".join(map(str, skip_worlds)))
    # (no hypothesis plugin: the graded tests draw nothing, and it takes 2 s of a grading's 20 to import)
    cmd = [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "-p", "no:hypothesispytest", "-p", "scripts.course.plugin",
           "--tb=native", "--continue-on-collection-errors", "-o", "addopts=", *tests]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=where, env=env, stdin=subprocess.DEVNULL, start_new_session=True,
                            stdout=None if verbose else subprocess.PIPE, stderr=subprocess.STDOUT)
    try:  # a file written without end (a log, a checkpoint) stops at 256 MiB
        resource.prlimit(proc.pid, resource.RLIMIT_FSIZE, (256 * 2 ** 20, 256 * 2 ** 20))
    except (OSError, AttributeError, ValueError):
        pass
    tail = None if verbose else _Tail(proc.stdout)
    try:
        proc.wait(timeout)
        status = "ok" if proc.returncode in (0, 1) else f"error (pytest exited {proc.returncode})"
    except subprocess.TimeoutExpired:
        status = f"timed out after {timeout:g} s"
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # what it left running: forkserver, ranks, torchrun
        except OSError:
            pass
        proc.wait()
    results = {}
    if os.path.exists(results_path):
        with open(results_path) as f:
            for line in f:
                try:
                    r = json.loads(line)
                except ValueError:
                    continue  # a line cut off by the kill
                old_ok = results.get(r["test"], (True, ""))[0]
                results[r["test"]] = (bool(r["ok"]) and old_ok, r["reason"] or results.get(r["test"], (1, ""))[1])
    return results, status, time.monotonic() - t0, tail.text() if tail else ""


def of(results, tests):
    """The results of `tests` (files or node ids)."""
    return {n: r for n, r in results.items() if any(n == t or n.startswith(t + "::") for t in tests)}


# ----------------------------------------------------------------------------- points
def score(results, name, spec, kinds=KINDS):
    """{lesson, earned, points, passed, total, failing {test: reason}, groups {kind: (passed, total)}}
    for one lesson from `results`, counting the groups of `kinds`, which share its points by weight."""
    counted = [(k, g) for k, g in groups(spec) if k in kinds]
    weight = sum(g["weight"] for _, g in counted)
    points = spec["points"] if counted else 0.0
    earned, passed, total, failing, per_group = 0.0, 0, 0, {}, {}
    for kind, g in counted:
        mine = of(results, g["tests"])
        w = {t: _weight(g, t) for t in mine}
        got = sum(w[t] for t, (ok, _) in mine.items() if ok)
        complete = bool(mine) and all(ok for ok, _ in mine.values())
        fraction = (got / sum(w.values()) if w and sum(w.values()) else 0.0) if spec["partial"] else float(complete)
        earned += points * g["weight"] / (weight or 1) * fraction
        n_ok = sum(ok for ok, _ in mine.values())
        passed, total = passed + n_ok, total + len(mine)
        per_group[kind] = (n_ok, len(mine))
        failing.update({t: reason for t, (ok, reason) in mine.items() if not ok})
        if not mine:
            failing[f"{kind} tests of {name}"] = "no test of this group ran"
    return {"lesson": name, "earned": round(earned, 2), "points": round(points, 2), "passed": passed,
            "total": total, "failing": failing, "groups": per_group}


def _weight(group, test):
    """A test's weight in its group: the most specific entry of `weights` (a node id, its
    function without parameters, its file), else 1."""
    base = test.split("[")[0]
    for key in (test, base, test.split("::")[0]):
        if key in group["weights"]:
            return group["weights"][key]
    return 1


def grade_submission(submission, lessons, settings, checkout=ROOT, work=None, verbose=False,
                     test_timeout=None, timeout=None, kinds=None):
    """Grade one edition: {"rows": [score...], "status", "seconds", "notes": [...], "tail"}.
    `kinds`: the groups counted (default: points.toml's `groups`)."""
    test_timeout = settings["test_timeout"] if test_timeout is None else test_timeout
    timeout = settings["timeout"] if timeout is None else timeout
    inside = os.path.realpath(checkout) == os.path.realpath(submission) and INSIDE_EDITION
    named = {k: [t for s in lessons.values() for t in s.get(k, {}).get("tests", [])] for k in KINDS}
    here = tuple(k for k in KINDS if named[k] and any(present(t, checkout) for t in named[k]))
    notes = []
    kinds = tuple(k for k in (kinds or settings["groups"]) if k in here) or here  # (what it names, if none)
    if named["hidden"] and "hidden" not in here:  # a student edition: the visible tests are all it has
        kinds = tuple(k for k in here if k == "visible")
        notes.append("no hidden tests here (a student edition): the visible tests share each lesson's points")
    specs = [t for t in test_specs(lessons, kinds) if present(t, checkout)]
    own = tempfile.TemporaryDirectory(prefix="grade-") if work is None else None
    work = own.name if own else work
    try:
        where = os.path.join(work, "sandbox")
        sandbox(submission, where, checkout)
        results, status, seconds, tail = run_tests(where, specs, test_timeout, timeout,
                                                   settings["skip_worlds"], verbose)
        rows = [score(results, name, spec, kinds) for name, spec in lessons.items()]
        for i, (name, spec) in enumerate(lessons.items()):
            broken = [f for f in spec["uses"] if not all(ok for ok, _ in of(results, uses_tests(spec, f, kinds)).values())]
            if not broken or rows[i]["earned"] >= rows[i]["points"]:
                continue
            if inside:
                notes.append(f"{name}: not regraded: this edition's {', '.join(f + '.py' for f in broken)} fails "
                             f"{failed_uses(spec, broken, kinds)} and an edition has no other copy")
                continue
            again_dir = os.path.join(work, f"regrade_{name}")
            sandbox(submission, again_dir, checkout, reference=broken)
            lesson_specs = [t for t in test_specs({name: dict(spec, uses={})}, kinds) if present(t, checkout)]
            again, st, sec, _ = run_tests(again_dir, lesson_specs, test_timeout, max(timeout - seconds, test_timeout),
                                          settings["skip_worlds"], verbose)
            seconds += sec
            row = score(again, name, spec, kinds)
            if row["earned"] > rows[i]["earned"]:
                rows[i] = row
                notes.append(f"{name}: graded with the reference {', '.join(f + '.py' for f in broken)} "
                             f"(the edition's fails {failed_uses(spec, broken, kinds)})")
    finally:
        if own:
            own.cleanup()
    return {"rows": rows, "status": status, "seconds": round(seconds, 1), "notes": notes, "tail": tail,
            "tests": len(results)}


def failed_uses(spec, files, kinds):
    """The test files of `files` a lesson uses, in the groups counted, for a note."""
    return ", ".join(dict.fromkeys(t.split("::")[0] for f in files for t in uses_tests(spec, f, kinds)))


# ----------------------------------------------------------------------------- the table
def table(rows):
    num = lambda x: f"{x:g}"
    lines = [f"{'lesson':<22} {'tests':>9} {'points':>11}  result"]
    for r in rows:
        ok = r["total"] > 0 and r["passed"] == r["total"]
        tests, points = f"{r['passed']}/{r['total']}", f"{num(r['earned'])}/{num(r['points'])}"
        lines.append(f"{r['lesson']:<22} {tests:>9} {points:>11}  {'PASS' if ok else 'FAIL'}")
    p, t = sum(r["passed"] for r in rows), sum(r["total"] for r in rows)
    e, a = round(sum(r["earned"] for r in rows), 2), round(sum(r["points"] for r in rows), 2)
    lines.append(f"{'total':<22} {f'{p}/{t}':>9} {num(e) + '/' + num(a):>11}")
    return "\n".join(lines)


def failures(rows):
    """One line per distinct reason per lesson, with how many tests failed for it."""
    lines = []
    for r in rows:
        reasons = {}
        for reason in r["failing"].values():
            reasons[reason] = reasons.get(reason, 0) + 1
        lines += [f"  {r['lesson']}: {n} x {reason}" for reason, n in reasons.items()]
    return "\n".join(lines)


def main(argv=None):
    p = Parser("grade", description=__doc__)
    p.add_argument("edition", nargs="?", default=ROOT, help="the edition's directory (default: this checkout)")
    p.add_argument("--points", default=POINTS, help="points and tests per lesson (default: tests/points.toml)")
    p.add_argument("--lessons", nargs="+", help="grade these lessons only, e.g. 01 03_buckets")
    p.add_argument("--test-timeout", type=at_least(1, float), help="seconds per test (default: points.toml's)")
    p.add_argument("--timeout", type=at_least(1, float), help="seconds for the whole grading run (default: points.toml's)")
    p.add_argument("--visible", action="store_true", help=VISIBLE_HELP)
    p.add_argument("-v", "--verbose", action="store_true", help="show pytest's own output as it runs")
    a = p.parse_args(argv)
    edition = os.path.abspath(a.edition)
    if not os.path.isdir(edition):
        print(f"error: {a.edition} is not a directory", file=sys.stderr)
        return 2
    settings, lessons = load_points(a.points, a.lessons)
    if not any(os.path.exists(os.path.join(edition, f"{name}.py")) for name in lessons):
        print(f"error: {edition} holds none of the lessons {', '.join(lessons)}", file=sys.stderr)
        return 2
    if os.path.realpath(edition) == os.path.realpath(ROOT) and INSIDE_EDITION:
        print(f"grading this student edition ({edition}) against its own tests and support files")
    out = grade_submission(edition, lessons, settings, verbose=a.verbose, test_timeout=a.test_timeout,
                           timeout=a.timeout, kinds=KINDS if a.visible else None)
    rows = out["rows"]
    if not out["tests"]:
        print(f"error: no test ran ({out['status']}):\n{out['tail']}", file=sys.stderr)
        return 2
    print(f"grading {edition} ({out['tests']} tests, {out['seconds']:.0f} s, {out['status']})\n")
    print(table(rows))
    if out["notes"]:
        print("\n" + "\n".join(f"  {n}" for n in out["notes"]))
    if any(r["failing"] for r in rows):
        print("\nfailures:\n" + failures(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
