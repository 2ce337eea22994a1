"""Hidden tests of 09_muon: 3 ranks (owners of unequal size, padded chunks), the toy's tied, frozen
and never-used parameters with AdamW alone (whole parameters per owner, ranks starting apart),
and a GPT of odd shapes with Muon, Newton-Schulz in fp32 (test_09_muon.py says why), with
accumulation and clipping, against one process."""
import harness
from hidden_suite import ODD_GPT, WORLD, close, spawn
from lessons import build
from scripts.learn.muon_gaps import fp32_newton_schulz
from test_09_muon import muon_reference
from toy import toy_reference, toy_train

MUON_GPT = ODD_GPT + ["--grad-accum", "2", "--grad-clip", "0.05"]


def suite():
    with fp32_newton_schulz():
        gpt = harness.run_lesson("09_muon", MUON_GPT)
    return {"toy": toy_train(build, "09", grad_accum=2, different_init=True), "gpt": gpt}


@harness.once
def results():
    return spawn(WORLD, suite, timeout=240)


def test_toy_at_3_ranks_tied_frozen_unused_different_init_accumulation():
    ref = toy_reference()
    for rank_out in results():
        close(rank_out["toy"], ref)


def test_gpt_of_odd_shapes_at_3_ranks_with_muon_accumulation_and_clipping():
    ref = muon_reference(MUON_GPT, fp32_iteration=True)
    for rank_out in results():
        close({"losses": rank_out["gpt"]["losses"], "params": rank_out["gpt"]["params"]}, ref)
