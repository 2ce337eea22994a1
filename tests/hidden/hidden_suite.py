"""What the hidden tests share: one launch of 3 ranks per lesson (a world size the visible tests
never use, which divides neither the toy's 119 trainable elements nor the GPT's below), training
the toy (tied, frozen and unused parameters, ranks starting from different weights, gradient
accumulation) and a GPT of odd shapes against single-process training on the whole batch."""
import functools

import torch

import harness
from harness import gpt_train, held, memory_theory, recording, reference, run_lesson, spawn, toy_reference_grads
from lessons import build
from tolerances import GRAD_TOL, TOL
from toy import toy_reference, toy_sgd_reference, toy_train

WORLD = 3
# Psi = 13750 (13750 % 3 == 1: every flat buffer is padded), d_model 22 with 2 heads, 61 tokens
ODD_GPT = ["--steps", "3", "--n-layer", "2", "--d-model", "22", "--n-head", "2", "--seq-len", "8",
           "--global-batch", "6", "--vocab-size", "61", "--log-every", "100"]
# The visible tests' tolerances, for the same reason (tests/tolerances.py says why).
close = functools.partial(harness.close, tol=TOL)
grads_close = functools.partial(harness.grads_close, tol=GRAD_TOL)


def toy_grads(lesson, **kw):
    """In a rank: train the toy (toy_reference_grads' run), recording the gradients the optimizer
    is handed."""
    grads = []
    out = toy_train(recording(build, grads), lesson, **kw)
    return {**out, "grads": grads}


SGD = dict(optimizer_class=torch.optim.SGD, optimizer_kwargs=dict(lr=0.5))  # 04-06 take any optimizer
# The gradient's scale shows in the first step (a missing 1/N, a sum of micro-steps not averaged);
# the second is a step from weights it moved. 4 micro-steps: 1 row each, on each of 3 ranks.
SCALE_STEPS = 2


def suite(lesson, extra=None):
    """In a rank: the checks every lesson gets at 3 ranks, plus `extra` {name: fn()}. The
    gradient's scale: recorded before Adam (01-03), or through SGD (04-06 own their optimizer)."""
    out = {"toy": toy_train(build, lesson, grad_accum=2, different_init=True),
           "gpt": gpt_train(lesson, ODD_GPT + ["--grad-accum", "2"])}
    if lesson in ("01", "02", "03"):
        out["toy_grads"] = toy_grads(lesson, steps=SCALE_STEPS, grad_accum=4, different_init=True)
    else:
        out["toy_sgd"] = toy_train(build, lesson, steps=SCALE_STEPS, grad_accum=4, different_init=True, **SGD)
    for name, fn in (extra or {}).items():
        out[name] = fn()
    return out


def launch(lesson, extra=None):
    return spawn(WORLD, suite, lesson, extra, timeout=240)


def check_toy(results):
    ref = toy_reference()
    for rank_out in results:
        close(rank_out["toy"], ref)


def check_grads(results):
    """The optimizer is handed the global-batch mean gradient (01-03), or SGD lands where it
    lands with that gradient (04-06)."""
    if "toy_grads" in results[0]:
        want = toy_reference_grads(steps=SCALE_STEPS)
        for rank_out in results:
            grads_close(rank_out["toy_grads"]["grads"], want)
    else:
        want = toy_sgd_reference(steps=SCALE_STEPS)
        for rank_out in results:
            close(rank_out["toy_sgd"], want)


def check_gpt(results):
    ref = reference(ODD_GPT)
    for rank_out in results:
        close(rank_out["gpt"], ref)


def at_rest(lesson):
    """In a rank: the lesson's main() on the odd GPT; rank 0's report (every rank's memory at rest)."""
    return run_lesson(lesson, ODD_GPT)["report"]


def check_at_rest(results, key="at_rest"):
    """What a rank holds at rest, measured, is its formula: a sharded state (05's gradient slices,
    06's parameter and gradient shards) with nothing full-size left over once its step is done
    (a bucket or a unit never freed). The formulas count no padding: under N elements of at most
    4 bytes per flat buffer, so under 4 N per tensor (a buffer holds at least one tensor)."""
    n_tensors, report = len(reference(ODD_GPT)["params"]), results[0][key]  # (rank 0's: every rank's)
    theory = memory_theory(report)
    for rank, mine in enumerate(held(report)):
        for name in ("params", "grads"):
            assert 0 <= mine[name] - theory[name] < 4 * WORLD * n_tensors, (rank, name, mine[name], theory[name])
