"""Same seed, same configuration: bitwise-identical losses from run to run, for every lesson.

Two separate launches (fresh processes, fresh memory addresses, fresh hash seeds), so nothing
that varies between processes (dict order keyed by id(), thread timing of async collectives,
allocation addresses) can leak into the numbers.
"""
from harness import run_lesson, spawn
from scripts.runs import LESSONS

ARGV = ["--steps", "4", "--n-layer", "2", "--d-model", "32", "--seq-len", "16",
        "--global-batch", "8", "--grad-accum", "2", "--bucket-mb", "0.01",
        "--log-every", "100", "--peak-params", "0"]


def every_lesson():
    return {name: run_lesson(name, ARGV)["losses"] for name in LESSONS}


def test_same_seed_same_losses_bitwise():
    first, second = spawn(2, every_lesson, fresh=True)[0], spawn(2, every_lesson, fresh=True)[0]
    for name in LESSONS:
        assert len(first[name]) == 4
        assert first[name] == second[name], name  # exact: floats compared bit for bit
