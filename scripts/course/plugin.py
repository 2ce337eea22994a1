"""The grader's pytest plugin (`-p scripts.course.plugin`, loaded by scripts/course/grade.py).

    DP_GRADE_RESULTS=PATH      append one JSON line per test as it ends: {"test", "ok", "reason"}
                               (written as the run goes, so a run killed at its time limit keeps
                               the results it had)
    DP_GRADE_TEST_TIMEOUT=S    a test (or a test file's import) running longer fails with
                               GradeTimeout, and the ranks it left running are killed
    DP_GRADE_SKIP_WORLDS=4,..  deselect tests parametrized with one of these world sizes
"""
import json
import os
import re
import signal
import sys
import traceback

import pytest

RESULTS = os.environ.get("DP_GRADE_RESULTS")
TIMEOUT = float(os.environ.get("DP_GRADE_TEST_TIMEOUT") or 0)
SKIP_WORLDS = {int(w) for w in os.environ.get("DP_GRADE_SKIP_WORLDS", "").split(",") if w.strip()}


class GradeTimeout(Exception):  # an Exception: harness.once remembers it for the other tests
    pass


def _alarm(what):
    def on_alarm(signum, frame):
        _kill_ranks()
        raise GradeTimeout(f"{what} ran longer than {TIMEOUT:g} s (the grader's limit per test)")
    return on_alarm


class _limit:
    """SIGALRM after TIMEOUT seconds (main thread; the test's own code, its waits included)."""

    def __init__(self, what):
        self.what = what

    def __enter__(self):
        if TIMEOUT:
            self.old = signal.signal(signal.SIGALRM, _alarm(self.what))
            signal.setitimer(signal.ITIMER_REAL, TIMEOUT)

    def __exit__(self, *exc):
        if TIMEOUT:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, self.old)


def _kill_ranks():
    """Kill the ranks a timed-out test left running: spawned children of this process, and
    children of its multiprocessing forkserver (every forked rank). Not the forkserver itself."""
    me = os.getpid()
    parent = {}  # pid: (parent's pid, command line)
    for pid in filter(str.isdigit, os.listdir("/proc") if os.path.isdir("/proc") else []):
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                parent[int(pid)] = (ppid, f.read())
        except (OSError, IndexError, ValueError):
            pass
    servers = {pid for pid, (ppid, cmd) in parent.items() if ppid == me and b"forkserver" in cmd}
    for pid, (ppid, cmd) in parent.items():
        if ppid in servers or (ppid == me and b"spawn_main" in cmd):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def _record(test, ok, reason=""):
    if RESULTS:
        with open(RESULTS, "a") as f:
            f.write(json.dumps({"test": test, "ok": ok, "reason": reason}) + "\n")


def first_error(text):
    """The line that says why a test failed: a region left as it was, a time limit, or the
    exception a rank raised (spawn reports every rank's traceback), else the first line. `text`:
    pytest's report of a failure, whose `E` lines are the exception's (the plugin writes a test's
    exception chain so, and pytest a collection error)."""
    for pattern in (r"NotImplementedError: .*", r"GradeTimeout: .*", r"TimeoutError: .*"):
        m = re.search(pattern, text)
        if m:
            return _short(m.group(0))
    lines = [l.strip() for l in text.splitlines() if l.strip()]
    errors = [l[1:].strip() for l in lines if l.startswith("E ")]
    raised = [l for l in (errors or lines) if re.match(r"^[\w.]*(Error|Exception|Exit|Interrupt)\b", l)
              and not l.startswith(("RuntimeError: rank", "AssertionError"))]
    if errors and errors[0].startswith(("assert", "AssertionError")):
        return _short(errors[0])
    return _short(raised[-1] if raised else errors[0] if errors else lines[0] if lines else "failed")


def _short(line):
    return line if len(line) <= 160 else line[:157] + "..."


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    with _limit(item.nodeid):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    if isinstance(collector, pytest.Module):  # a test file's import (a graded file loaded there)
        with _limit(f"importing {collector.nodeid}"):
            yield
    else:
        yield


def pytest_sessionfinish(session, exitstatus):
    session.config._grade_status = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    # Every result is written (as its test ended) and pytest's summary printed: leave now. Tearing
    # down an interpreter that imported torch (its modules, the forkserver's pipes) takes 2 s, a
    # tenth of a grading.
    if RESULTS and hasattr(config, "_grade_status"):
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os._exit(config._grade_status)


def pytest_collection_modifyitems(config, items):
    if not SKIP_WORLDS:
        return
    skipped = [i for i in items if getattr(i, "callspec", None) and i.callspec.params.get("world") in SKIP_WORLDS]
    if skipped:
        config.hook.pytest_deselected(items=skipped)
        items[:] = [i for i in items if i not in skipped]


def pytest_collectreport(report):
    if report.failed:
        _record(report.nodeid, False, "collection failure: " + first_error(str(report.longrepr)))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    # why it failed, read off the exception itself, not pytest's report of every frame, which the
    # grader asks for in Python's own format (--tb=native: with pytest's, an untouched edition's
    # grading took 60 s here, against 38 s)
    report = (yield).get_result()
    if report.failed and call.excinfo is not None:
        try:
            report.grade_reason = first_error("\n".join("E   " + line for line in _chain(call.excinfo.value)))
        except Exception:  # (a student's exception can do anything, even in its __str__)
            pass


def _chain(error):
    """The lines of an exception and of those it was raised from or while handling, each as
    Python prints its last line ("Type: message", a rank's traceback in it; pytest's account of
    an assert), the outermost first: a region's NotImplementedError or a time limit anywhere in
    the chain is found. (A __str__ that raises prints as Python prints it.)"""
    lines, seen = [], set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        lines += "".join(traceback.format_exception_only(type(error), error)).splitlines()
        error = error.__cause__ or (None if error.__suppress_context__ else error.__context__)
    return lines


def _reason(report):
    return getattr(report, "grade_reason", None) or first_error(str(report.longrepr))


def pytest_runtest_logreport(report):
    # one record per test: its call, or the setup/teardown that failed
    if report.when == "call" or (report.failed and report.when == "setup"):
        if report.skipped:
            return
        _record(report.nodeid, report.passed, "" if report.passed else _reason(report))
    elif report.failed and report.when == "teardown":
        _record(report.nodeid, False, "teardown: " + _reason(report))
