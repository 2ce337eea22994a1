"""Grade a class: every submission in a folder, into one grades.csv and grades.json.

    python -m scripts.course.grade_class submissions/              # or: make grade-class SUBMISSIONS=submissions
    python -m scripts.course.grade_class submissions/ --jobs 1 --out runs/grades
    python -m scripts.course.grade_class submissions/ --lessons 01 03 --test-timeout 60
    python -m scripts.course.grade_class submissions/ --visible    # the visible tests counted too

A submission is one entry of the folder, named for its student: a directory, a .zip or a
.tar.gz/.tgz holding an edition (its lessons at its top, or one folder down). Each is graded as
scripts/course/grade.py grades one edition: only its graded files (the lessons, bucket.py and shard.py)
are copied, beside this checkout's tests, hidden tests and support modules, into a fresh
directory; one pytest process per submission, with a time limit per test and one for the whole
run (points.toml's, or the flags'), killed with every process it started when it runs over. So a
submission that hangs, crashes, prints without end or edits its tests costs its own row only.
Submissions run in parallel, --jobs at a time (default: one per CPU core).

grades.csv: one row per student: each lesson's points, the total, the status ("ok", "timed out
after N s", or why it could not be graded) and the seconds it took. grades.json: the same, plus
per lesson the tests passed of each group (visible, hidden), every failing test's first error
line and the notes (a lesson regraded with the reference bucket.py). The exit code is 0 once
both files are written, whatever the grades.
"""
import concurrent.futures
import csv
import json
import os
import sys
import tarfile
import tempfile
import time
import zipfile

from scripts.course import grade
from scripts.runs import ROOT, Parser, at_least, usable_cpus

ARCHIVES = (".zip", ".tar.gz", ".tgz")


def submissions(folder, grades=None):
    """{student: path} of the folder's entries: directories and archives, by name; not the
    folder the grades go to, if it is one of them (--out DIR/grades: no student "grades")."""
    out = {}
    for entry in sorted(os.listdir(folder)):
        path = os.path.join(folder, entry)
        name = next((entry[:-len(a)] for a in ARCHIVES if entry.endswith(a)), None)
        if grades and os.path.realpath(path) == os.path.realpath(grades):
            continue
        if os.path.isdir(path):
            out[entry] = path
        elif name and os.path.isfile(path):
            out[name] = path
    return out


def unpack(path, dest):
    """The edition inside `path` (a directory, or an archive unpacked into `dest`): the
    shallowest directory holding a graded file."""
    if os.path.isfile(path):
        if path.endswith(".zip"):
            with zipfile.ZipFile(path) as z:
                for member in z.namelist():  # no absolute paths, no '..'
                    target = os.path.realpath(os.path.join(dest, member))
                    if not target.startswith(os.path.realpath(dest) + os.sep):
                        raise ValueError(f"unsafe path in the archive: {member}")
                z.extractall(dest)
        else:
            with tarfile.open(path) as t:
                if hasattr(tarfile, "data_filter"):  # Python >= 3.10.12 / 3.11.4
                    t.extractall(dest, filter="data")  # refuses links out, devices, absolute paths
                else:  # older: plain files and directories inside dest only
                    for m in t.getmembers():
                        target = os.path.realpath(os.path.join(dest, m.name))
                        if not (m.isfile() or m.isdir()) or not target.startswith(os.path.realpath(dest) + os.sep):
                            raise ValueError(f"unsafe member in the archive: {m.name}")
                    t.extractall(dest)
        path = dest
    graded = set(grade.graded_files())
    for dirpath, dirnames, filenames in sorted(os.walk(path), key=lambda w: w[0].count(os.sep)):
        dirnames[:] = [d for d in dirnames if not d.startswith((".", "__"))]
        if graded & set(filenames):
            return dirpath
    raise ValueError(f"no graded file ({', '.join(sorted(graded))}) in it")


def grade_one(student, path, lessons, settings, test_timeout, timeout, kinds=None):
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=f"grade-{student[:40]}-") as work:
        try:
            edition = unpack(path, os.path.join(work, "submission"))
        except (ValueError, OSError, zipfile.BadZipFile, tarfile.TarError) as e:
            return {"student": student, "status": f"not graded: {e}", "seconds": 0.0, "notes": [],
                    "rows": [grade.score({}, n, s) for n, s in lessons.items()]}
        out = grade.grade_submission(edition, lessons, settings, work=work,
                                     test_timeout=test_timeout, timeout=timeout, kinds=kinds)
    out.update(student=student, seconds=round(time.monotonic() - t0, 1))
    return out


def write(results, lessons, out_dir):
    os.makedirs(out_dir, exist_ok=True)
    names = list(lessons)
    with open(os.path.join(out_dir, "grades.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["student", *names, "total", "max", "status", "seconds"])
        for r in results:
            earned = [row["earned"] for row in r["rows"]]
            w.writerow([r["student"], *[f"{e:g}" for e in earned], f"{round(sum(earned), 2):g}",
                        f"{round(sum(row['points'] for row in r['rows']), 2):g}", r["status"], r["seconds"]])
    kept = ("earned", "points", "passed", "total", "groups", "failing")  # per lesson
    report = {"points": {n: s["points"] for n, s in lessons.items()},
              "students": {r["student"]: {
                  "total": round(sum(row["earned"] for row in r["rows"]), 2), "status": r["status"],
                  "seconds": r["seconds"], "notes": r["notes"],
                  "lessons": {row["lesson"]: {k: row[k] for k in kept} for row in r["rows"]}} for r in results}}
    with open(os.path.join(out_dir, "grades.json"), "w") as f:
        json.dump(report, f, indent=1)


def main(argv=None):
    p = Parser("grade_class", description=__doc__)
    p.add_argument("folder", help="one entry per student: a directory, .zip or .tar.gz")
    p.add_argument("--out", default=".", help="where grades.csv and grades.json go (default: here)")
    p.add_argument("--points", default=grade.POINTS, help="default: tests/points.toml")
    p.add_argument("--lessons", nargs="+", help="grade these lessons only, e.g. 01 03_buckets")
    p.add_argument("--jobs", type=at_least(1), default=usable_cpus(),
                   help="submissions at once (default: the CPUs this process may use)")
    p.add_argument("--test-timeout", type=at_least(1, float), help="seconds per test (default: points.toml's)")
    p.add_argument("--timeout", type=at_least(1, float), help="seconds per submission (default: points.toml's)")
    p.add_argument("--visible", action="store_true", help=grade.VISIBLE_HELP)
    a = p.parse_args(argv)
    if not os.path.isdir(a.folder):
        print(f"error: {a.folder} is not a directory", file=sys.stderr)
        return 2
    settings, lessons = grade.load_points(a.points, a.lessons)
    found = submissions(a.folder, a.out)
    if not found:
        print(f"error: no submission (directory, {', '.join(ARCHIVES)}) in {a.folder}", file=sys.stderr)
        return 2
    p.folder("--out", a.out)
    print(f"grading {len(found)} submissions from {a.folder}, {a.jobs} at a time (tests from {ROOT})")
    t0, results = time.monotonic(), []
    with concurrent.futures.ThreadPoolExecutor(max(1, a.jobs)) as pool:
        futures = [pool.submit(grade_one, s, path, lessons, settings, a.test_timeout, a.timeout,
                               grade.KINDS if a.visible else None)
                   for s, path in found.items()]
        for future in concurrent.futures.as_completed(futures):
            r = future.result()
            results.append(r)
            total = sum(row["earned"] for row in r["rows"])
            print(f"  {r['student']:<24} {total:>6g}  {r['status']}  ({r['seconds']:.0f} s)", flush=True)
    results.sort(key=lambda r: r["student"])
    write(results, lessons, a.out)
    wall = time.monotonic() - t0
    print(f"wrote {os.path.join(a.out, 'grades.csv')} and grades.json: {len(results)} students in {wall:.0f} s "
          f"({wall / len(results):.0f} s per submission)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
