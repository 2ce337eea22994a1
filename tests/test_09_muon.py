"""Lesson 09 (Muon under ZeRO: whole matrices per owner) against single-process torch.optim.Muon +
AdamW on the same groups; its bytes, memory and Newton-Schulz FLOPs against its formulas.

Tolerances. Muon rounds its Newton-Schulz input to bf16 (torch's `_zeropower_via_newtonschulz`).
09's owner sees the gradient summed over ranks in another order than one process's, so its fp32
bits differ in the last places. So two checks:
- with the iteration in fp32 (muon_gaps.fp32_newton_schulz, in 09's ranks and in the reference)
  the arithmetic is one process's up to fp32 round-off: TOL, as every lesson;
- with torch's own bf16 iteration, an input element that rounds to another bf16 value moves that
  matrix's update by at most about its own size, Muon's step, 0.2 x lr x sqrt(max(m, n)) x
  |O_ij| < lr for these widths: MUON_BF16_ATOL = lr (measured: 0.11 lr at 2 to 4 ranks, 6 steps).
At one rank the gradient's bits are one process's: bit for bit, with torch's bf16 iteration.
In bf16 the gradients themselves round differently per rank (a few bf16 ulps), and Newton-Schulz
brings every singular direction of the gradient to the same size, the faint ones made of rounding
too: bf16 Muon ends 9-10% (of the distance the weights moved) from fp32 Muon on this model, where
AdamW's bf16 ends 4.7% from its fp32. 09 in bf16 must end no farther than MUON_BF16_SPREAD times
that from one process in bf16 (measured 0.8-0.9 times); a lost micro-step or an owner stepping
another matrix's gradient ends 50% and more away.
"""
import contextlib
import functools
import os
import subprocess
import sys
import tempfile

import pytest
import torch

from graded import load_lesson
from harness import ROOT, close, comm_ops, held, memory_theory, once, run_lesson, sent_bytes, spawn, theory_bytes
from lessonkit import common, optimizers
from model import global_batch
from scripts.learn.muon_gaps import fp32_newton_schulz
from test_checkpoint import copy_checkpoint, refused
from tolerances import TOL
from zero_parity import ARGV, BF16_LOSS_ATOL, initial_params
from zero_parity import close as fp32_close

LESSON = "09_muon"
LR = 3e-3  # common's default --lr, which ARGV keeps
MUON_BF16_ATOL = LR
MUON_BF16_SPREAD = 1.5


def argvs(world, zero3=False):
    """The runs at `world` ranks: fp32, clipping with micro-steps, bf16 without and with micro-steps
    (global batches N divides). zero3: --zero3 1's, under ZERO3's keys (the run each repeats)."""
    base = ARGV + ["--global-batch", "12" if world == 3 else "8"]
    runs = {"main": base, "accum_clip": base + ["--grad-clip", "0.05", "--grad-accum", "2"],
            "bf16": base + ["--precision", "bf16"], "bf16_accum": base + ["--precision", "bf16", "--grad-accum", "2"]}
    return {key: runs[like] + ["--zero3", "1"] for key, like in ZERO3.items()} if zero3 else runs


# --zero3 1 (ZeRO-3 with Muon: 06's units) in a launch of its own, its tests apart: they need 06's
# regions too, so a student edition's 09 is graded on 09's own (tests/points.toml)
ZERO3 = {"zero3": "main", "zero3_accum_clip": "accum_clip", "zero3_bf16": "bf16_accum"}


def muon_reference(argv, fp32_iteration=False):
    """Single-process training on the whole global batch with torch.optim.Muon on 09's Muon group and
    torch.optim.AdamW on the others, fp32 masters in bf16 (rounded into the parameters after each
    step), clipped by torch.nn.utils.clip_grad_norm_: what 09 must reproduce."""
    args = common.parse_args(argv)
    model = common.build_model(args, common.Dist(0, 1, torch.device("cpu"), "gloo"))
    groups = load_lesson(LESSON).muon_groups(model, args.weight_decay)
    mixed = args.precision != "fp32"
    master = {p: optimizers.master_weights(p).view_as(p).clone() if mixed else p for g in groups for p in g["params"]}
    of = lambda use: [{**{k: v for k, v in g.items() if k != "use_muon"}, "params": [master[p] for p in g["params"]]}  # noqa: E731
                      for g in groups if bool(g.get("use_muon")) == use]
    optims = [torch.optim.Muon(of(True), lr=args.lr, adjust_lr_fn="match_rms_adamw"),
              torch.optim.AdamW(of(False), **optimizers.adamw_kwargs(args))]
    losses = []
    with fp32_newton_schulz() if fp32_iteration else contextlib.nullcontext():
        for step in range(args.steps):
            tokens = global_batch(args.seed, step, args.global_batch, args.seq_len, args.vocab_size)
            loss = model(tokens[:, :-1], tokens[:, 1:])
            loss.backward()
            for p, m in master.items():
                m.grad = p.grad.float() if m is not p else p.grad
            if args.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(list(master.values()), args.grad_clip)
            for o in optims:
                for g in o.param_groups:
                    g["lr"] = optimizers.learning_rate(args, step)
                o.step()
            with torch.no_grad():
                for p, m in master.items():
                    if m is not p:
                        p.copy_(m)
                    p.grad = m.grad = None
            losses.append(loss.item())
    return {"losses": losses, "params": {n: p.detach().float().clone() for n, p in model.named_parameters()}}


def refusals():
    """What 04's and 05's sharded optimizers say when handed torch.optim.Muon (in a rank: they shard)."""
    said = {}
    for lesson, name in (("04_zero1", "ZeRO1Optimizer"), ("05_zero2", "ZeRO2Optimizer")):
        model = torch.nn.Linear(4, 6)
        try:
            getattr(load_lesson(lesson), name)(model.parameters(), torch.optim.Muon, lr=0.02)
        except ValueError as e:
            said[lesson] = str(e)
    return said


SAVE = ["--steps", "6", "--save-every", "2"]


def checkpoints(world, root):
    """At 2 ranks: a run saving every 2 steps, and one resumed from its step 4; each way between 04's
    and 09's checkpoints, the refusal. At 3 ranks: a run resumed from the 2-rank run's step 4."""
    base, CKPT = argvs(3)["accum_clip"], root  # (12 sequences: 2 and 3 ranks divide them)
    if world == 3:
        return {"other_world": run_lesson(LESSON, base + ["--checkpoint-dir", os.path.join(CKPT, "resume"), "--resume"])}
    out = {"whole": run_lesson(LESSON, base + SAVE + ["--checkpoint-dir", os.path.join(CKPT, "09")])}
    copy_checkpoint(os.path.join(CKPT, "09"), 4, os.path.join(CKPT, "resume"))
    out["resumed"] = run_lesson(LESSON, base + ["--checkpoint-dir", os.path.join(CKPT, "resume"), "--resume"])
    run_lesson("04_zero1", base + SAVE + ["--checkpoint-dir", os.path.join(CKPT, "04")])
    out["refused"] = [refused(LESSON, base + ["--checkpoint-dir", os.path.join(CKPT, "04"), "--resume"]),
                      refused("04_zero1", base + ["--checkpoint-dir", os.path.join(CKPT, "09"), "--resume"])]
    return out


def drop_in():
    """The loop a user writes for DDP + ZeroRedundancyOptimizer(params, torch.optim.Muon), run as it
    is and with 09's ZeROMuon built in its place (no DDP: 09 reduces itself), on a model of two
    matrices, 2 micro-steps: the parameters after every step, and after a state_dict round trip."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel
    from test_drop_in import NoSync, user_loop
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(24, 40, bias=False), torch.nn.Tanh(), torch.nn.Linear(40, 8, bias=False))

    class Loss(torch.nn.Module):  # user_loop's model(x, y) -> loss
        def __init__(self, net):
            super().__init__()
            self.net = net

        def forward(self, x, y):
            return ((self.net(x) - y) ** 2).mean()
    g = torch.Generator().manual_seed(0)
    data = [[(torch.randn(4 * world, 24, generator=g), torch.randn(4 * world, 8, generator=g)) for _ in range(2)]
            for _ in range(4)]
    batches = [[(x[rank * 4:(rank + 1) * 4], y[rank * 4:(rank + 1) * 4]) for x, y in step] for step in data]
    out = {}
    with fp32_newton_schulz():  # (the module docstring: fp32's round-off, not bf16's)
        m = DistributedDataParallel(Loss(model()))
        out["torch"] = user_loop(m, ZeroRedundancyOptimizer(m.parameters(), torch.optim.Muon, lr=0.02), batches)
        zero_muon = load_lesson(LESSON).ZeROMuon
        make = lambda params: zero_muon([{"params": list(params), "use_muon": True}], muon_defaults=dict(lr=0.02))  # noqa: E731
        m = NoSync(Loss(model()))
        out["09"] = user_loop(m, make(m.parameters()), batches)

        def round_trip(m, opt):
            fresh = NoSync(Loss(model()))
            fresh.module.load_state_dict(m.module.state_dict())
            new = make(fresh.parameters())
            new.load_state_dict(opt.state_dict())
            return fresh, new
        m = NoSync(Loss(model()))
        out["09_round_trip"] = user_loop(m, make(m.parameters()), batches, round_trip=round_trip)
    return out


def suite(world, root, zero3=False):
    out = {"refusals": refusals()} if world == 1 and not zero3 else {}
    if world == 2 and not zero3:
        out["drop_in"] = drop_in()
    if world in (2, 3):
        out["checkpoints"] = (zero3_checkpoints if zero3 else checkpoints)(world, root)
    for key, argv in argvs(world, zero3).items():
        out[key] = run_lesson(LESSON, argv)
        if key != "bf16_accum":  # (its bytes held only)
            with fp32_newton_schulz():
                out[f"{key}_fp32ns"] = run_lesson(LESSON, argv)
    return out


def zero3_checkpoints(world, root):
    """--zero3 1 at 2 ranks: saved every 2 steps and resumed from step 4; at 3 ranks, resumed from
    the 2-rank run of 04's layout (checkpoints(): another layout and another world)."""
    base = argvs(3)["accum_clip"] + ["--zero3", "1"]
    if world == 3:
        return {"other_world": run_lesson(LESSON, base + ["--checkpoint-dir", os.path.join(root, "resume"), "--resume"])}
    out = {"whole": run_lesson(LESSON, base + SAVE + ["--checkpoint-dir", os.path.join(root, "09z")])}
    copy_checkpoint(os.path.join(root, "09z"), 4, os.path.join(root, "resume_z"))
    out["resumed"] = run_lesson(LESSON, base + ["--checkpoint-dir", os.path.join(root, "resume_z"), "--resume"])
    return out


@once
def results(world):
    """Each rank's suite(world), one launch per world size; the checkpoints' folder is made here,
    in pytest's process, and handed to the ranks (world 2 saves there, world 3 resumes from it)."""
    return spawn(world, suite, world, _root())


@once
def zero3_results(world):
    if world == 3:
        results(2)  # (its checkpoint, which world 3 resumes from)
    return spawn(world, suite, world, _root(), True)


@functools.lru_cache(maxsize=None)
def _root():
    return tempfile.mkdtemp(prefix="test_09_")


def ref(world, key, fp32_iteration=False):
    key = "bf16" if key == "zero3_bf16" else ZERO3.get(key, key)  # (one process: one step, whole batch)
    return _ref(tuple(argvs(world)[key]), fp32_iteration)


def of(world, key):
    return (zero3_results if key in ZERO3 else results)(world)


@functools.lru_cache(maxsize=None)
def _ref(argv, fp32_iteration):
    return muon_reference(list(argv), fp32_iteration)


def distance(a, b, argv):
    """How far run a's parameters are from run b's, over how far b moved them (2-norms, all tensors)."""
    init = initial_params(argv)
    num = sum((a["params"][n] - b["params"][n]).pow(2).sum() for n in b["params"]).sqrt()
    return (num / sum((b["params"][n] - init[n]).pow(2).sum() for n in b["params"]).sqrt()).item()


def bf16_close(world, fp32_iteration, key="bf16"):
    """09 in bf16 against one process in bf16: losses within zero_parity's BF16_LOSS_ATOL; parameters
    no farther than MUON_BF16_SPREAD x as far as bf16 Muon itself ends from fp32 Muon."""
    got, want = of(world, key)[0][f"{key}_fp32ns" if fp32_iteration else key], ref(world, "bf16", fp32_iteration)
    torch.testing.assert_close(got["losses"], want["losses"], rtol=0, atol=BF16_LOSS_ATOL)
    spread = distance(want, ref(world, "main", fp32_iteration), argvs(world)["bf16"])
    assert distance(got, want, argvs(world)["bf16"]) <= MUON_BF16_SPREAD * spread


# ----------------------------------------------------------------------------- the tests
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_every_rank_holds_the_same_weights(world):
    for key, out in ((k, v) for k, v in results(world)[0].items() if k not in ("refusals", "checkpoints", "drop_in")):
        for other in results(world)[1:]:
            assert all(torch.equal(other[key]["params"][n], p) for n, p in out["params"].items()), key


def test_one_rank_is_single_process_muon_bit_for_bit():
    for key in ("main", "bf16"):  # (clipping: torch's norm adds the squares in another order)
        got, want = results(1)[0][key], ref(1, key)
        assert got["losses"] == want["losses"], key
        assert all(torch.equal(got["params"][n], p) for n, p in want["params"].items()), key


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_matches_single_process_muon_with_the_iteration_in_fp32(world):
    for key in ("main", "accum_clip"):
        fp32_close(results(world)[0][f"{key}_fp32ns"], ref(world, key, fp32_iteration=True))  # (the key bias: zero_parity's)
    bf16_close(world, fp32_iteration=True)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_with_torchs_bf16_iteration_within_one_step_of_muon(world):
    for key in ("main", "accum_clip"):
        close(results(world)[0][key], ref(world, key), dict(rtol=0, atol=MUON_BF16_ATOL))
    bf16_close(world, fp32_iteration=False)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_zero3_matches_single_process_muon_on_every_rank(world):
    """--zero3 1 held as 09 is above: the same weights on every rank; bit for bit at one rank; TOL
    with the iteration in fp32; within MUON_BF16_ATOL, or MUON_BF16_SPREAD in bf16, with torch's."""
    out = zero3_results(world)
    for key in (k for k in out[0] if k != "checkpoints"):
        assert all(torch.equal(o[key]["params"][n], p) for o in out[1:] for n, p in out[0][key]["params"].items()), key
    if world == 1:
        assert out[0]["zero3"]["losses"] == ref(1, "zero3")["losses"]
        assert all(torch.equal(out[0]["zero3"]["params"][n], p) for n, p in ref(1, "zero3")["params"].items())
    for key in ("zero3", "zero3_accum_clip"):
        fp32_close(out[0][f"{key}_fp32ns"], ref(world, key, fp32_iteration=True))
        close(out[0][key], ref(world, key), dict(rtol=0, atol=MUON_BF16_ATOL))
    for fp32_iteration in (True, False):
        bf16_close(world, fp32_iteration, "zero3_bf16")


@pytest.mark.parametrize("world", [2, 3, 4])
def test_bytes_memory_and_newton_schulz_flops_equal_their_formulas(world):
    for key in ("main", "accum_clip", "bf16", "bf16_accum"):
        report = results(world)[0][key]["report"]
        assert sent_bytes(report) == pytest.approx(theory_bytes(report), rel=1e-12), key  # (the sums of thirds)
        ops, nbytes = comm_ops(report), 2 if key.startswith("bf16") else 4
        padded = report["n_params"] + report["padding"]
        assert ops["reduce_scatter"] == {"calls": 1, "bytes": padded * nbytes} == ops["all_gather"], key
        fp32_sum = 4 * report["n_params"] if key == "bf16_accum" else 0  # (micro-steps in bf16: their fp32 sum)
        for m, owner in zip(held(report), report["owners"]):
            assert (m["params"], m["grads"]) == (owner["params"], owner["grads"]) == (padded * nbytes, padded * nbytes + fp32_sum), key
            assert m["optimizer"] == owner["optimizer"] == owner["measured_optimizer"], key
            assert owner["measured_flops"] == owner["flops"] > 0, key
        assert sum(o["owned"] for o in report["owners"]) == report["n_params"]
        assert memory_theory(report)["optimizer"] == report["owners"][0]["optimizer"]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_zero3_bytes_memory_and_flops_equal_their_formulas_its_padding_counted_over_06s(world):
    from test_06_zero3 import padded as even, units
    for key, k in (("zero3", 1), ("zero3_accum_clip", 2), ("zero3_bf16", 2)):
        report, b = zero3_results(world)[0][key]["report"], 2 if key == "zero3_bf16" else 4
        padded, unit_sizes = report["n_params"] + report["padding"], units(argvs(world, zero3=True)[key])[0]
        assert sent_bytes(report) == pytest.approx(theory_bytes(report), rel=1e-12), key
        ops, n_units = comm_ops(report), len(unit_sizes)  # 06's: per unit and micro-step, 2 gathers, 1 reduce-scatter
        assert ops["all_gather"] == {"calls": 2 * k * n_units, "bytes": 2 * k * padded * b}, key
        assert ops["reduce_scatter"] == {"calls": k * n_units, "bytes": k * padded * b}, key
        # the padding over 06's even units, gathered twice and reduce-scattered once a micro-step
        over = padded - sum(even(n, world) for n in unit_sizes)
        assert report["extra_over_06"] == pytest.approx(3 * k * over * b * (world - 1) / world, rel=1e-12) and over > 0
        for m, owner in zip(held(report), report["owners"]):  # my fp32 shards: padded / N of every unit
            assert m["params"] == owner["params"] == 4 * padded // world and m["master_weights"] == 0, key
            assert m["grads"] == owner["grads"] <= m["params"], key
            assert m["optimizer"] == owner["optimizer"] == owner["measured_optimizer"], key
            assert owner["measured_flops"] == owner["flops"] > 0, key
        assert sum(o["owned"] for o in report["owners"]) == report["n_params"]


def test_owners_balance_newton_schulz_work_not_bytes():
    lesson = load_lesson(LESSON)
    # a square matrix of 65,536 elements and two thin ones of 69,632: Newton-Schulz costs the square
    # one about 20x what a thin one costs
    shapes = [(256, 256), (4096, 17), (17, 4096)]
    params = [torch.zeros(s) for s in shapes]
    owner = lesson.owners(params, set(params), 2)
    # by bytes the third would join the square one (the rank with fewer elements); by work, the thin one
    assert owner[params[0]] != owner[params[1]] == owner[params[2]]
    work = [sum(lesson.newton_schulz_flops(p.shape) for p in params if owner[p] == r) for r in range(2)]
    assert max(work) - min(work) <= max(lesson.newton_schulz_flops(s) for s in shapes)


def test_04_05_and_06_refuse_muon_in_one_line_naming_09():
    said = results(1)[0]["refusals"]
    assert set(said) == {"04_zero1", "05_zero2"}, said
    for line in said.values():
        assert "\n" not in line and "whole matrices" in line and "09_muon.py" in line, line
    # 06: torch.optim.Muon refuses its flat shards in its own constructor, before any line of 06;
    # a lesson's run (lifecycle.run_main) then says why, in the same line
    code = ("import importlib, torch, torch.distributed as dist\nfrom lessonkit import lifecycle\n"
            "def main():\n    dist.init_process_group('gloo', store=dist.HashStore(), rank=0, world_size=1)\n"
            "    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 2))\n"
            "    torch.optim.Muon(importlib.import_module('06_zero3').ZeRO3(model).parameters())\n"
            "lifecycle.run_main(main)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    lines = (out.stdout + out.stderr).strip().splitlines()
    assert out.returncode == 1 and len(lines) == 1 and "pieces of matrices" in lines[0] and "09_muon.py" in lines[0], lines


def test_muon_takes_the_hidden_matrices_and_adamw_embeddings_the_tied_head_norms_and_biases():
    from model import GPT, GPTConfig
    model = GPT(GPTConfig(n_layer=2))
    name = {p: n for n, p in model.named_parameters()}
    muon, decay, rest = ({name[p] for p in g["params"]} for g in load_lesson(LESSON).muon_groups(model, 0.1))
    assert muon == {f"blocks.{i}.{m}.weight" for i in range(2) for m in ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")}
    assert decay == {"wte.weight", "wpe.weight"}  # (lm_head.weight is wte.weight: one parameter)
    assert rest == set(name.values()) - muon - decay and all(n.endswith(("bias", "ln_1.weight", "ln_2.weight",
                                                                        "ln_f.weight")) for n in rest)


def test_a_resumed_run_is_the_uninterrupted_run_at_any_world_size():
    ck = results(2)[0]["checkpoints"]
    whole, resumed = ck["whole"], ck["resumed"]
    assert resumed["losses"] == whole["losses"][4:]  # the same world: bit for bit
    assert all(torch.equal(resumed["params"][n], p) for n, p in whole["params"].items())
    other = results(3)[0]["checkpoints"]["other_world"]  # 3 ranks sum the gradients in another order
    close(other, {"losses": whole["losses"][4:], "params": whole["params"]}, dict(rtol=0, atol=MUON_BF16_ATOL))


def test_zero3_resumes_bit_for_bit_and_from_the_other_layout_at_another_world_size():
    z = zero3_results(2)[0]["checkpoints"]
    assert z["resumed"]["losses"] == z["whole"]["losses"][4:]  # the same world and layout: bit for bit
    assert all(torch.equal(z["resumed"]["params"][n], p) for n, p in z["whole"]["params"].items())
    whole = results(2)[0]["checkpoints"]["whole"]  # 04's layout at 2 ranks, resumed under --zero3 1 at 3
    close(zero3_results(3)[0]["checkpoints"]["other_world"], {"losses": whole["losses"][4:], "params": whole["params"]},
          dict(rtol=0, atol=MUON_BF16_ATOL))


def test_muons_and_adamws_checkpoints_refuse_each_other_in_one_line():
    for said in results(2)[0]["checkpoints"]["refused"]:
        assert "optimizer state is" in said and "\n" not in said, said


def test_a_loop_written_for_zero_redundancy_optimizer_with_muon_runs_09():
    out = results(2)[0]["drop_in"]
    for got, want in zip(out["09"], out["torch"], strict=True):  # after every step
        for name, p in want.items():
            torch.testing.assert_close(got[name], p, **TOL, msg=name)
    for got, want in zip(out["09_round_trip"], out["09"], strict=True):  # state_dict() holds all it needs
        assert all(torch.equal(got[name], p) for name, p in want.items())


@pytest.mark.slow
def test_make_muon_gaps_shows_why_pytorchs_sharded_muon_ends_away_from_one_process():
    from scripts.learn import muon_gaps
    gap = muon_gaps.gaps(muon_gaps.MODELS[0])  # {(strategy, iteration): (max |difference|, inputs differing, of)}
    for s in ("ZeroRedundancyOptimizer", "09 ZeROMuon"):  # whole matrices, the same bf16 inputs: one process's bits
        assert gap[(s, "bf16")][:2] == (0.0, 0), s
    assert gap[("FSDP2", "bf16")][1] == 0 and gap[("FSDP2", "bf16")][0] > 1e-4  # the same inputs, its own products
    assert all(gap[(s, "fp32")][0] < 1e-6 for s in muon_gaps.STRATEGIES)  # in fp32: fp32 round-off for all
