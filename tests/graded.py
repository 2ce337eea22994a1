"""Where the tests read the graded files (the lessons, bucket.py and shard.py) from: this checkout, or a
student edition named by DP_LESSONS. The tests load every graded file through load_lesson.
(scripts/course/grade.py does not need DP_LESSONS: it copies a submission's graded files into a
directory laid out as a checkout, and runs the tests there.)
"""
import importlib.util
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Where the graded files (the lessons, bucket.py and shard.py) are read from: this checkout, or a student
# edition (scripts/course/student_edition.py) named by DP_LESSONS. The one place the tests learn it;
# spawned ranks and torchrun's processes inherit the variable (with it set, spawn() starts
# every rank as a new interpreter). Support modules (common, model, measure) come from this
# checkout in spawned ranks, so the reference a lesson is held to is the grader's (a lesson run
# as a script by torchrun imports those beside it: the edition's copies).
# The graded tests (tests/points.toml) read it; the tools' tests (lecture, notebooks, benchmark)
# run scripts/, which always use this checkout's lessons.
LESSONS_DIR = os.path.abspath(os.environ.get("DP_LESSONS") or ROOT)


# the graded files the lessons import by name (03 and 05: bucket.py; 04 and 05: shard.py)
SHARED = ("bucket", "shard")
# the lessons that import another at their top (07, 08 and 09's --zero3 1 build on 06's units)
BUILDS_ON = {"07_offload": "06_zero3", "08_hybrid": "06_zero3", "09_muon": "06_zero3"}


def lesson_file(name):
    """The path of graded file `name` ("03_buckets", "bucket", "shard"): for running it as a script."""
    return os.path.join(LESSONS_DIR, f"{name}.py")


def load_lesson(name):
    """Import a graded file from LESSONS_DIR as a module: a lesson ("03_buckets", a name that
    is not a valid module name), "bucket" or "shard"."""
    path = lesson_file(name)
    module = sys.modules.get(name)
    if module is not None:
        if os.path.realpath(getattr(module, "__file__", "") or "") != os.path.realpath(path):
            raise ImportError(f"{name} was imported from {module.__file__} before the tests could "
                              f"load it from {LESSONS_DIR}: import it through graded.load_lesson")
        return module
    if name in BUILDS_ON:  # its `importlib.import_module("06_zero3")` must find LESSONS_DIR's, not this checkout's
        load_lesson(BUILDS_ON[name])
    if not os.path.exists(path):
        raise FileNotFoundError(f"no {name}.py in {LESSONS_DIR} (DP_LESSONS={os.environ.get('DP_LESSONS')!r})")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException as e:
        # None, not absent: a plain `import bucket` must never fall back to this checkout's
        sys.modules[name] = None
        if name not in SHARED and isinstance(e, ImportError) and e.name in SHARED:
            load_lesson(e.name)  # the lesson failed because bucket.py (shard.py) did: raise its error
        raise
    return module


# The lessons' own `from bucket import BucketManager` (`from shard import ...`) must find
# LESSONS_DIR's bucket.py (shard.py), not this checkout's (a student edition has its own): load
# them now, before any lesson is loaded. If one is broken, only what uses it fails, with its error.
for _name in SHARED:
    if os.path.exists(lesson_file(_name)):
        try:
            load_lesson(_name)
        except Exception:
            pass


def tree(path):
    """{relative path ("/"-separated): (bytes, mode)} of every file under `path`: an edition as written."""
    out = {}
    for dirpath, _, files in os.walk(path):
        for f in files:
            full = os.path.join(dirpath, f)
            with open(full, "rb") as fh:
                out[os.path.relpath(full, path).replace(os.sep, "/")] = (fh.read(), os.stat(full).st_mode)
    return out
