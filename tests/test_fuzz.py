"""The differential fuzzer's fixed slice (tests/fuzz.py; `make fuzz` searches further): cases
Hypothesis draws from a fixed seed, PER_WORLD at each world size 1-4, each world's cases in one
launch of ranks. Every lesson 01-08 against its PyTorch counterpart and single-process training;
a failure prints each failing case with the one line that reproduces it."""
import pytest

import fuzz

SEED, PER_WORLD = 2025, 6  # 24 cases (make fuzz: 300): the suite's budget, as 07, 08, checkpointing and fp16 joined


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_fuzz_slice(world):
    cases = fuzz.drawn(fuzz.cases(world), PER_WORLD, SEED + world)
    found, _ = fuzz.run_batch(cases)
    failures = [fuzz.report(case, f) for case, f in zip(cases, found) if f]
    assert not failures, f"{len(failures)} of {len(cases)} cases fail:\n" + "\n".join(failures)
