"""docs/results.md: the measured numbers the README and docs link to, from runs of this checkout.

    make results        # every lesson at 2 ranks on CPU (make demo's table), written with one
                        # header line: the machine, torch and the commit it ran
    make results TIERS=1   # also time the test tiers (make test, make test LESSON=05, make test-all)
    make results GRADING=1 # also time make grade on this checkout (the solutions), as it counts and with --visible

The GPU section is `make gpu-check`'s (scripts/perf/gpu_check.py writes it where a GPU ran it);
each section is replaced whole by the target that measures it, the others kept as they are.
"""
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time

import torch

from scripts.learn import demo
from scripts.runs import ROOT, Parser, tool_main

PATH = os.path.join(ROOT, "docs", "results.md")
TITLE = "# Results\n\nMeasured by the make targets named in each section, on the machine its first line names.\n"


def machine():
    """One line: the CPU (or GPU), the cores, torch, the commit (-dirty: with uncommitted changes)."""
    cpu = platform.processor() or platform.machine()
    if os.path.exists("/proc/cpuinfo"):
        names = re.findall(r"model name\s*:\s*(.+)", open("/proc/cpuinfo").read())
        cpu = names[0].strip() if names else cpu
    git = lambda *a: subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout.strip()  # noqa: E731
    commit = (git("rev-parse", "--short", "HEAD") or "unknown") + ("-dirty" if git("status", "--porcelain") else "")
    return f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}, commit {commit}"


def write_section(name, body):
    """Replace section `name` of docs/results.md (between its markers) with `body`, keep the rest."""
    text = open(PATH).read() if os.path.exists(PATH) else TITLE
    start, end = f"<!-- {name} -->", f"<!-- /{name} -->"
    block = f"{start}\n{body.rstrip()}\n{end}"
    if start in text:
        text = text[:text.index(start)] + block + text[text.index(end) + len(end):]
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    with open(PATH, "w") as f:
        f.write(text)


TIERS = [("make test", {}), ("make test LESSON=05", {"LESSON": "05"}), ("make test-all", None)]


def tier_env(env):
    """The environment a tier's pytest runs in: this one, LESSON as the tier sets it (else none)."""
    return {**os.environ, "LESSON": "", **(env or {})}


def tiers():
    """Each test tier's wall time, run as its make target runs it (pytest, in this interpreter)."""
    rows = []
    for name, env in TIERS:
        marks = "slow" if env is None else "not slow"
        t0 = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "tests", "-m", marks, "-p", "no:cacheprovider"],
                              cwd=ROOT, env=tier_env(env), capture_output=True, text=True)
        last = (proc.stdout.strip().splitlines() or ["(no output)"])[-1]
        rows.append(f"| `{name}` | {time.monotonic() - t0:.0f} s | {last.strip('= ')} |")
    return "\n".join(["## The test tiers", "", f"Machine: {machine()}. `make results TIERS=1`, one tier after the "
                      "other on an otherwise idle machine.", "", "| tier | wall | pytest's last line |", "|---|---:|---|",
                      *rows])


def grading(students=4):
    """make grade's wall time on this checkout (every region filled in: full marks), counting
    points.toml's groups, then with --visible; make grade-class's per submission, a class of
    `students` copies of this checkout's graded files."""
    from scripts.course.grade import graded_files
    rows = []
    for flags in ([], ["--visible"]):
        t0 = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "scripts.course.grade", *flags], cwd=ROOT,
                              env=tier_env({}), capture_output=True, text=True)
        total = next((line for line in proc.stdout.splitlines() if line.startswith("total")), "(no total)")
        rows.append(f"| `make grade{' ' + flags[0] if flags else ''}` | {time.monotonic() - t0:.0f} s | "
                    f"{' '.join(total.split()[1:])} |")
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(students):
            os.makedirs(os.path.join(tmp, "class", f"student{i}"))
            for name in graded_files():
                shutil.copy(os.path.join(ROOT, name), os.path.join(tmp, "class", f"student{i}"))
        proc = subprocess.run([sys.executable, "-m", "scripts.course.grade_class", os.path.join(tmp, "class"),
                               "--out", tmp], cwd=ROOT, env=tier_env({}), capture_output=True, text=True)
        m = re.search(r"(\d+) students in (\d+) s \((\d+) s per submission\)", proc.stdout)
        totals = re.findall(r"^\s+student\d+\s+(\S+)", proc.stdout, re.M)  # each student's points
        rows.append(f"| `make grade-class`, {students} copies | {m[2]} s, {m[3]} s a submission | points: "
                    f"{', '.join(totals)} |" if m else f"| `make grade-class` | failed | {proc.stdout[-200:]!r} |")
    return "\n".join(["## Grading", "", f"Machine: {machine()}. `make results GRADING=1`: this checkout (the "
                      "solutions) graded, on an idle machine.", "", "| command | wall | tests, points |",
                      "|---|---:|---|", *rows])


def main():
    p = Parser("results", description=__doc__)
    p.add_argument("--tiers", action="store_true", help="also time the test tiers")
    p.add_argument("--grading", action="store_true", help="also time make grade")
    a = p.parse_args()
    nproc, precision, steps = 2, "fp32", 40
    rows = demo.collect(nproc, precision, steps, echo=True)
    write_section("cpu", "\n".join([
        "## Every lesson on CPU", "",
        f"Machine: {machine()}. `make results` (the table `make demo` prints).", "",
        demo.caption(nproc, precision, steps) + ".", "",
        "```", *demo.table(rows), "```"]))
    if a.tiers:
        write_section("tiers", tiers())
    if a.grading:
        write_section("grading", grading())
    print(f"wrote {os.path.relpath(PATH, ROOT)}")


if __name__ == "__main__":
    sys.exit(tool_main("results", main))
