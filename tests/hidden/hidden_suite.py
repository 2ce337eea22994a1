"""What the hidden tests share: one launch of 3 ranks per lesson (a world size the visible tests
never use, which divides neither the toy's 119 trainable elements nor the GPT's below), training
the toy (tied, frozen and unused parameters, ranks starting from different weights, gradient
accumulation) and a GPT of odd shapes against single-process training on the whole batch."""
import functools

import torch

import harness
from harness import gpt_train, recording, reference, spawn, toy_reference_grads
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
    """In a rank: train the toy 4 steps (toy_reference_grads' run), recording the gradients the
    optimizer is handed."""
    grads = []
    out = toy_train(recording(build, grads), lesson, **kw)
    return {**out, "grads": grads}


SGD = dict(optimizer_class=torch.optim.SGD, optimizer_kwargs=dict(lr=0.5))  # 04-06 take any optimizer


def suite(lesson, extra=None):
    """In a rank: the checks every lesson gets at 3 ranks, plus `extra` {name: fn()}. The
    gradient's scale: recorded before Adam (01-03), or through SGD (04-06 own their optimizer)."""
    out = {"toy": toy_train(build, lesson, grad_accum=2, different_init=True),
           "gpt": gpt_train(lesson, ODD_GPT + ["--grad-accum", "2"])}
    if lesson in ("01", "02", "03"):
        out["toy_grads"] = toy_grads(lesson, grad_accum=4, different_init=True)
    else:
        out["toy_sgd"] = toy_train(build, lesson, grad_accum=4, different_init=True, **SGD)
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
        want = toy_reference_grads()
        for rank_out in results:
            grads_close(rank_out["toy_grads"]["grads"], want)
    else:
        want = toy_sgd_reference()
        for rank_out in results:
            close(rank_out["toy_sgd"], want)


def check_gpt(results):
    ref = reference(ODD_GPT)
    for rank_out in results:
        close(rank_out["gpt"], ref)
