import os
import re
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for path in (ROOT, os.path.dirname(os.path.abspath(__file__))):
    if path not in sys.path:
        sys.path.insert(0, path)
os.environ.setdefault("OMP_NUM_THREADS", "1")
import forkserver  # noqa: E402  (after sys.path, which the server takes; before anything imports torch)

forkserver.start()


def pytest_collection_finish(session):
    # The first optimizer step of a process imports torch._dynamo (torch.optim does), a second or
    # two: here that is the first single-process reference's. Import it now, while the forkserver
    # is still importing on the other core, not later, in a test, while ranks wait.
    if session.items:
        import torch._dynamo  # noqa: F401


def pytest_configure(config):
    # torch's own: importing torch.distributed.optim (ZeroRedundancyOptimizer, the tests' reference)
    # scripts its functional optimizers, and torch 2.13 deprecates torch.jit.script. Not ours to fix.
    config.addinivalue_line("filterwarnings", "ignore:`torch.jit.(script|interface)` is deprecated:DeprecationWarning")
    config.addinivalue_line("markers", "slow: the slow tier, which make test-all runs (make test runs the rest)")


# ----------------------------------------------------------------------------- the two tiers
# `make test` runs the fast tier (-m "not slow"), `make test-all` the slow one (-m slow); .ci/run
# runs both, so every test still runs (docs/testing.md's table says what each tier holds).
# Slow: whole files that check tools, notebooks, the course kit and timing, and the lesson
# files' launches at 3 and 4 ranks but 08's 2 x 2 grid (the hidden tests hold each lesson at 3).
SLOW_FILES = {
    "test_accumulation.py", "test_activations.py", "test_assignments.py", "test_at_scale.py", "test_calculator.py",
    "test_checkpoint.py", "test_course.py", "test_dcp.py", "test_debug_demos.py", "test_determinism.py",
    "test_drop_in.py", "test_failures.py", "test_gpu_check.py", "test_gpu_ready.py",
    "test_lecture.py", "test_notebooks.py", "test_resume_auto.py", "test_ring_collectives.py",
    "test_routing_replicated.py", "test_scaling_bench.py", "test_simulate.py", "test_trace_overlap.py",
}
FAST_FUZZ_SLICES = ("[1]", "[2]")  # the fuzz slice at 1 and 2 ranks; 3 and 4 ranks are slow


def _slow(item):
    name = os.path.basename(str(item.fspath))
    if name in SLOW_FILES:
        return True
    if name == "test_fuzz.py" and item.name.startswith("test_fuzz_slice"):
        return not item.name.endswith(FAST_FUZZ_SLICES)
    world = getattr(getattr(item, "callspec", None), "params", {}).get("world") or 0
    if name.startswith("test_08"):
        return False  # its 4 ranks are its 2 x 2 grid
    if name.startswith("test_09"):  # (no hidden test holds 09 at 3 ranks: its own launch at 3 does; --zero3 1: slow)
        return world == 4 or "zero3" in item.name
    if name == "test_reduce_every.py":
        return world != 2
    return name.startswith(("test_0", "test_model_shapes")) and world >= 3


def _of_lesson(item, lesson):
    """`make test LESSON=05`: the lesson's own files, and its cases in the files shared by all."""
    from harness import of_lesson  # (once the paths above are set)
    name = os.path.basename(str(item.fspath))
    if name.startswith((f"test_{lesson}_", f"test_hidden_{lesson}")):
        return True
    ids = re.split(r"[\[\]\-]", item.name)[1:]  # a parametrized test's ids: "05", "05_zero2", "toy_05", ...
    return name in ("test_stream_semantics.py", "test_accumulation.py", "test_cli.py", "test_model_shapes.py",
                    "test_dtypes.py") and \
        any(i and of_lesson(i) for i in ids)  # (of LESSON, which the environment holds)


@pytest.hookimpl(tryfirst=True)  # before -m reads the marks
def pytest_collection_modifyitems(config, items):
    lesson = os.environ.get("LESSON", "")
    if lesson and not re.fullmatch(r"0[0-9]", lesson):
        raise pytest.UsageError(f"LESSON={lesson!r}: give a lesson's two digits, 00 to 09")
    keep = []
    for item in items:
        if _slow(item):
            item.add_marker(pytest.mark.slow)
        if not lesson or _of_lesson(item, lesson):
            keep.append(item)
    if lesson:
        config.hook.pytest_deselected(items=[i for i in items if i not in keep])
        items[:] = keep
