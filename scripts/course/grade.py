"""Grade a student edition: run the project's tests against its lessons, print points per lesson.

    python -m scripts.course.grade student/                  # or: make grade EDITION=student
    python -m scripts.course.grade                           # this checkout (inside an edition: itself)
    python -m scripts.course.grade student/ --lessons 01 03  # some lessons only

The tests come from this checkout, the lessons (and bucket.py) from the edition: one pytest run
with DP_LESSONS=EDITION (tests/graded.py reads it), its results read from pytest's JUnit XML.
Points, and which tests grade which lesson, live in tests/points.toml. A lesson that `uses` a
graded file it does not own (05: bucket.py, 03's) and fails while that file fails its own tests
is graded again with this checkout's copy (DP_REFERENCE=bucket), and the table says so. The
exit code is 0 once the table is printed, whatever the grade; 2 if the grading itself could not run.
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
import tomllib
import xml.etree.ElementTree as ET

from scripts.runs import ROOT

POINTS = os.path.join(ROOT, "tests", "points.toml")


def load_points(path, only=None):
    """(partial_credit, {lesson: {"points", "tests"}}), restricted to lessons starting with one
    of `only` ("01", "03_buckets", ...)."""
    with open(path, "rb") as f:
        cfg = tomllib.load(f)
    lessons = cfg.get("lessons", {})
    for name, spec in lessons.items():
        if not isinstance(spec.get("points"), (int, float)) or not spec.get("tests"):
            raise SystemExit(f"error: {path}: lessons.{name} needs points = <number> and tests = [...]")
        if not isinstance(spec.setdefault("uses", {}), dict):
            raise SystemExit(f"error: {path}: lessons.{name}.uses must be a table, e.g. {{bucket = \"tests/test_bucket.py\"}}")
    if only:
        unknown = [o for o in only if not any(n.startswith(o) for n in lessons)]
        if unknown:
            raise SystemExit(f"error: no lesson {', '.join(unknown)} in {path} (it has {', '.join(lessons)})")
        lessons = {n: s for n, s in lessons.items() if any(n.startswith(o) for o in only)}
    return bool(cfg.get("partial_credit", False)), lessons


def run_pytest(edition, specs, junit, verbose=False, reference=()):
    """One pytest run over every graded test, with the edition's lessons (but the graded files
    named in `reference`, from this checkout); returns its output."""
    env = dict(os.environ, DP_LESSONS=edition, DP_REFERENCE=",".join(reference), OMP_NUM_THREADS="1",
               PYTHONWARNINGS=os.environ.get("PYTHONWARNINGS", "ignore::FutureWarning"))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--continue-on-collection-errors",
           f"--junitxml={junit}", "-o", "junit_family=xunit1", *specs]
    if verbose:
        subprocess.run(cmd, cwd=ROOT, env=env)
        return ""
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True).stdout


def outcomes(junit):
    """{node id: (passed, reason)} from pytest's JUnit XML (xunit1: each case names its file).
    A file that failed to import appears as its path, failed."""
    results = {}
    for case in ET.parse(junit).iter("testcase"):
        path = case.get("file", "")
        module = path[:-3].replace("/", ".") if path.endswith(".py") else path
        if not case.get("classname"):  # a collection error: the file itself
            node = path or case.get("name", "").replace(".", "/") + ".py"
        else:
            klass = case.get("classname")[len(module) + 1:]
            node = "::".join(p for p in (path, klass, case.get("name")) if p)
        bad = [c for c in case if c.tag in ("failure", "error")]
        if any(c.tag == "skipped" for c in case) and not bad:
            continue  # not counted either way
        reason = _reason(bad[0]) if bad else ""
        passed = not bad and results.get(node, (True, ""))[0]  # a teardown error fails a passed test
        results[node] = (passed, reason or results.get(node, (True, ""))[1])
    return results


def _reason(element):
    """One line for a failure: the NotImplementedError of a region left as it was, if any."""
    text = (element.get("message") or "") + "\n" + (element.text or "")
    todo = re.search(r"NotImplementedError: (.*)", text)
    if todo:
        return f"NotImplementedError: {todo.group(1).strip()}"
    if element.get("message") == "collection failure":  # say why the file did not import
        errors = [l[1:].strip() for l in (element.text or "").splitlines() if l.startswith("E ")]
        text = "collection failure: " + (errors[-1] if errors else "see pytest's output (-v)")
    first = next((l.strip() for l in text.splitlines() if l.strip()), "failed")
    return first if len(first) <= 110 else first[:107] + "..."


def of(results, tests):
    """The results of `tests` (files or node ids)."""
    return {n: r for n, r in results.items() if any(n == t or n.startswith(t + "::") for t in tests)}


def regrade_with_reference(edition, lessons, results, tmp, verbose):
    """Lessons that failed while a graded file they use failed its own tests: run their tests
    again with this checkout's copy of that file. Returns {lesson: (its results, note)}, for
    that lesson's row only (a test graded for two lessons keeps its first result for the other)."""
    regraded = {}
    for name, spec in lessons.items():
        broken = [f for f, tests in spec["uses"].items()
                  if not all(ok for ok, _ in of(results, [tests]).values())]
        first = of(results, spec["tests"])
        if not broken or all(ok for ok, _ in first.values()):
            continue
        junit = os.path.join(tmp, f"junit_{name}.xml")
        run_pytest(edition, spec["tests"], junit, verbose, reference=broken)
        again = of(outcomes(junit), spec["tests"]) if os.path.exists(junit) else {}
        # the regrade unless it did worse: its failures then name the lesson's own regions
        if again and sum(ok for ok, _ in again.values()) >= sum(ok for ok, _ in first.values()):
            regraded[name] = (again, f"graded with this checkout's {', '.join(f + '.py' for f in broken)} "
                                     f"(the edition's fails {', '.join(spec['uses'][f] for f in broken)})")
    return regraded


def grade(results, lessons, partial, regraded=None):
    """[(lesson, passed, total, earned, points, reasons {reason: count})] for the table;
    `regraded` {lesson: (results, note)} replaces a lesson's own results."""
    rows = []
    for name, spec in lessons.items():
        mine = (regraded or {}).get(name, (of(results, spec["tests"]), ""))[0]
        passed = sum(ok for ok, _ in mine.values())
        total = len(mine)
        complete = total > 0 and passed == total
        earned = spec["points"] * (complete if not partial else (passed / total if total else 0))
        reasons = {}
        for ok, reason in mine.values():
            if not ok:
                reasons[reason] = reasons.get(reason, 0) + 1
        if not total:
            reasons["no test of this lesson ran"] = 1
        rows.append((name, passed, total, round(earned, 2), spec["points"], reasons))
    return rows


def table(rows):
    num = lambda x: f"{x:g}"
    lines = [f"{'lesson':<22} {'tests':>9} {'points':>9}  result"]
    for name, passed, total, earned, points, _ in rows:
        ok = total > 0 and passed == total
        lines.append(f"{name:<22} {f'{passed}/{total}':>9} {f'{num(earned)}/{num(points)}':>9}  {'PASS' if ok else 'FAIL'}")
    p, t = sum(r[1] for r in rows), sum(r[2] for r in rows)
    e, a = round(sum(r[3] for r in rows), 2), sum(r[4] for r in rows)
    lines.append(f"{'total':<22} {f'{p}/{t}':>9} {f'{num(e)}/{num(a)}':>9}")
    return "\n".join(lines)


def failures(rows):
    lines = []
    for name, *_, reasons in rows:
        for reason, count in reasons.items():
            lines.append(f"  {name}: {count} x {reason}")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("edition", nargs="?", default=ROOT, help="the edition's directory (default: this checkout)")
    p.add_argument("--points", default=POINTS, help="points and tests per lesson (default: tests/points.toml)")
    p.add_argument("--lessons", nargs="+", help="grade these lessons only, e.g. 01 03_buckets")
    p.add_argument("-v", "--verbose", action="store_true", help="show pytest's own output as it runs")
    a = p.parse_args(argv)
    edition = os.path.abspath(a.edition)
    if not os.path.isdir(edition):
        print(f"error: {a.edition} is not a directory", file=sys.stderr)
        return 2
    partial, lessons = load_points(a.points, a.lessons)
    if not any(os.path.exists(os.path.join(edition, f"{name}.py")) for name in lessons):
        print(f"error: {edition} holds none of the lessons {', '.join(lessons)}", file=sys.stderr)
        return 2
    specs = list(dict.fromkeys(t for spec in lessons.values() for t in [*spec["tests"], *spec["uses"].values()]))
    with tempfile.TemporaryDirectory() as tmp:
        junit = os.path.join(tmp, "junit.xml")
        t0 = time.monotonic()
        output = run_pytest(edition, specs, junit, a.verbose)
        if not os.path.exists(junit):
            print(f"error: pytest produced no results:\n{output}", file=sys.stderr)
            return 2
        results = outcomes(junit)
        regraded = regrade_with_reference(edition, lessons, results, tmp, a.verbose)
    rows = grade(results, lessons, partial, regraded)
    graded = set().union(*(of(results, s["tests"]) for s in lessons.values()))
    print(f"grading {edition} ({len(graded)} tests, {time.monotonic() - t0:.0f} s)\n")
    print(table(rows))
    if regraded:
        print("\n" + "\n".join(f"  {name}: {note}" for name, (_, note) in regraded.items()))
    if any(r[5] for r in rows):
        print("\nfailures:\n" + failures(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
