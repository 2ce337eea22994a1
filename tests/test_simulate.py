"""--simulate-world N (lessonkit/simulate.py): every lesson as one rank of N, alone, on the fake
backend. At N = 4 a simulated rank issues the collectives a real gloo rank issues, in the same order,
with the same payloads, and holds the same bytes; at N = 8 and 64 what it holds and issues is the
formula's (theory.py), plus its padding."""
import pytest
import torch.distributed as dist

from harness import comm_ops, held, memory_theory, run_lesson, sent_bytes, spawn, theory_bytes
from scripts.runs import LESSONS

SMALL = ["--n-layer", "2", "--d-model", "32", "--n-head", "2", "--vocab-size", "64", "--seq-len", "8",
         "--steps", "2", "--measure-step", "1", "--log-every", "100"]
EXTRA = {"08_hybrid": lambda n: ["--shard-group", str(n // 2)]}  # (08: two replicas of a shard group)
TRAINERS = LESSONS + ["09_muon"]


def argv(lesson, world):
    return SMALL + ["--global-batch", str(world)] + EXTRA.get(lesson, lambda n: [])(world)


def simulated(runs):
    """In a spawned process: leave its group, run each (lesson, world, rank) simulated, alone."""
    out = []
    for lesson, world, rank in runs:
        dist.destroy_process_group()  # (init_distributed joins the fake backend's group: simulate.join)
        out.append(run_lesson(lesson, argv(lesson, world) + ["--simulate-world", str(world), "--simulate-rank",
                                                             str(rank)])["report"])
    return out


def real(world):
    return [run_lesson(lesson, argv(lesson, world))["report"] for lesson in TRAINERS]


@pytest.fixture(scope="module")
def at_4():
    """Each lesson at 4 real gloo ranks, and simulated as rank 0 and rank 3 of 4."""
    reals = spawn(4, real, 4)[0]  # (rank 0's reports: every rank's measurements gathered in each)
    sims = spawn(1, simulated, [(lesson, 4, rank) for lesson in TRAINERS for rank in (0, 3)])[0]
    return {lesson: (reals[i], sims[2 * i], sims[2 * i + 1]) for i, lesson in enumerate(TRAINERS)}


@pytest.mark.parametrize("lesson", TRAINERS)
def test_a_simulated_rank_issues_and_holds_what_a_real_rank_does(lesson, at_4):
    real_run, rank0, rank3 = at_4[lesson]
    assert rank0["comm"]["calls"] == real_run["comm"]["calls"]  # the same collectives, payloads, order
    for rank, sim in ((0, rank0), (3, rank3)):
        assert comm_ops(sim) == real_run["comm"]["per_rank"][rank]
        mine, theirs = held(sim)[0], held(real_run)[rank]
        for key in ("params", "grads", "optimizer", "master_weights", "peak_params"):
            assert mine.get(key) == theirs.get(key), (rank, key)


# A flat buffer (04, 05's buckets, 06-08's units) is padded to a multiple of N, fewer than N elements
# of at most 16 bytes of model state each; the small GPT has at most 4 such buffers (06: 3 units).
def padding_bytes(world):
    return 4 * 16 * world


@pytest.mark.parametrize("world", [8, 64])
def test_simulated_worlds_hold_and_issue_their_formulas(world):
    reports = spawn(1, simulated, [(lesson, world, world - 1) for lesson in TRAINERS])[0]
    for lesson, report in zip(TRAINERS, reports):
        mine, theory = held(report)[0], memory_theory(report)
        for key in ("params", "grads", "optimizer"):
            assert abs(mine[key] - theory[key]) <= padding_bytes(world), (lesson, key, mine[key], theory[key])
        assert report["world_size"] == world and sum(op["calls"] for op in comm_ops(report).values()) > 0, lesson
        padded = 3 * 4 * padding_bytes(world)  # (a gather twice and a reduce-scatter, of each buffer's padding)
        assert abs(sent_bytes(report) - theory_bytes(report)) <= padded, (lesson, sent_bytes(report), theory_bytes(report))


def test_make_figure1s_measure_is_the_formula_and_06s_peak_its_units_in_flight():
    from scripts.learn import figure1
    shape = ["--n-layer", "2", "--d-model", "64", "--n-head", "2"]
    for lesson in ("04_zero1", "06_zero3"):
        m = figure1.measure(lesson, shape, 8)
        # (and AdamW's step counts, which the formula leaves out: 4 bytes a parameter tensor, under 64 tensors)
        assert abs(m["held"] - figure1.formula(lesson, m["psi"], 8)) <= padding_bytes(8) + 4 * 64, lesson
    # 06: its shards plus the root, the block computing and the one prefetched, byte for byte
    assert m["peak_params"] == m["params"] + figure1.in_flight(shape, 8)
