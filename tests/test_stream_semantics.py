"""The lessons under NCCL's stream semantics, on CPU (tests/stream_semantics.py): an async
collective's output is NaN until its wait() returns, and its inputs must be untouched until then.
Every lesson, every async path (fp32 and bf16, accumulation, 06 with and without prefetch, small
buckets so several are in flight) must run clean under it and give the same bits as without it:
the harness changes no arithmetic, only when a result becomes visible. And the harness must catch
a lesson with one wait() removed, or an input written before its wait()."""
import contextlib
import math
import os

import pytest
import torch
import torch.distributed as dist

from lessonkit.comm_meter import CommMeter
from graded import load_lesson
from harness import launches, of_lesson, run_lesson
from lessons import build
from stream_semantics import StreamSemantics, first_difference
from toy import toy_train

ARGV = ["--steps", "3", "--n-layer", "2", "--d-model", "32", "--seq-len", "16",
        "--global-batch", "8", "--log-every", "100", "--peak-params", "0"]  # (its sampling: slow)
BUCKETS = ARGV + ["--bucket-mb", "0.02"]  # ~20 KiB buckets: several in flight at once (Psi ~ 28k)
ZERO3 = ARGV[:2] + ["--n-layer", "3"] + ARGV[4:]  # 3 blocks: prefetch gathers one ahead
BF16, ACCUM = ["--precision", "bf16"], ["--grad-accum", "2"]
# name: (lesson, flags); 01 and 04 issue only blocking collectives: run for their poisoned outputs
CASES = {
    "01": ("01_vanilla_dp", ARGV),
    "02": ("02_async_allreduce", ARGV), "02_bf16": ("02_async_allreduce", ARGV + BF16),
    "02_accum": ("02_async_allreduce", ARGV + ACCUM),
    "03": ("03_buckets", BUCKETS), "03_bf16": ("03_buckets", BUCKETS + BF16),
    "03_accum": ("03_buckets", BUCKETS + ACCUM),
    "04": ("04_zero1", ARGV),
    "05": ("05_zero2", BUCKETS), "05_bf16": ("05_zero2", BUCKETS + BF16),
    "05_accum": ("05_zero2", BUCKETS + ACCUM),
    "06": ("06_zero3", ZERO3), "06_bf16": ("06_zero3", ZERO3 + BF16), "06_accum": ("06_zero3", ZERO3 + ACCUM),
    "06_no_prefetch": ("06_zero3", ZERO3 + ["--prefetch", "0"]),
    "06_no_prefetch_bf16_accum": ("06_zero3", ZERO3 + ["--prefetch", "0"] + BF16 + ACCUM),
    "07_bf16_accum": ("07_offload", ZERO3 + BF16 + ACCUM),  # 06's collectives around the copies
    "07_uneven": ("07_offload", ZERO3 + ACCUM + ["--layout", "uneven"]),  # broadcasts and reduces
    "07_chunks_bf16": ("07_offload", ZERO3 + BF16 + ["--chunk-mb", "0.1"]),  # blocks 0-1 one unit (~48 KiB each)
    # 2 ranks as two replicas of one shard: 5b)'s async all-reduce of each gradient shard
    "08_replicas": ("08_hybrid", ZERO3 + ACCUM + ["--shard-group", "1"]),
    "09_bf16_accum": ("09_muon", ARGV + BF16 + ACCUM),  # (blocking collectives only: its poisoned outputs)
    "09_zero3_bf16_accum": ("09_muon", ZERO3 + BF16 + ACCUM + ["--zero3", "1"]),  # 06's async collectives
}
# 08 on a 2 x 2 grid (a launch of 4 ranks): the shard group's gathers and reduce-scatters and the
# replicate group's all-reduce of each gradient shard, all async, in flight together
GRID = {"08_2x2_accum": ("08_hybrid", ZERO3 + ACCUM + ["--shard-group", "2"]),
        "08_2x2_bf16_no_prefetch": ("08_hybrid", ZERO3 + BF16 + ["--shard-group", "2", "--prefetch", "0"])}
# --collectives ring (scripts/perf/ring_collectives.py): the same lessons on the ring's thread
# and handles, the stand-in wrapped around the ring's functions (installed first: _ring_installed)
RING = ["--collectives", "ring"]
CASES.update({f"{name}_ring": (lesson, argv + RING) for name, (lesson, argv) in CASES.items()
              if name in ("01", "02", "03_bf16", "04", "05_accum", "06", "06_no_prefetch")})
# the toy's edge cases (tied, frozen, never-used parameters; ranks starting apart; 3 micro-steps)
TOYS = {f"toy_{n}": (n, dict(grad_accum=3, different_init=True, bucket_mb=2e-4))  # 03, 05: ~3 buckets
        for n in ("02", "03", "05", "06")}
TOYS["toy_06_no_prefetch"] = ("06", dict(grad_accum=3, prefetch=False))
TOYS["toy_07"] = ("07", dict(grad_accum=3, different_init=True))
TOYS["toy_06_chunk"] = ("06", dict(grad_accum=3, chunk=2))  # the frozen layer and the next one, one unit
ASYNC = {"02", "03", "05", "06", "07", "08"}


# ----------------------------------------------------------------------------- in the ranks
def twice(run):
    """run() as it is, and under StreamSemantics; an error is kept as text, so each case fails alone."""
    out = {}
    try:
        out["plain"] = run()
    except Exception as e:
        return {"error": f"without the harness (not its doing): {type(e).__name__}: {e}"}
    try:
        with StreamSemantics() as s:
            out["checked"] = run()
        out["collectives"], out["order"] = s.checked, s.order
    except Exception as e:
        out["error"] = f"under the harness: {type(e).__name__}: {e}"
    return out


def caught(run):
    """run() under StreamSemantics: what it returned and the error it raised (None if none)."""
    result, error = None, None
    try:
        with StreamSemantics():
            result = run()
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    return {"result": result, "error": error}


@contextlib.contextmanager
def patched(cls, name, fn):
    original = getattr(cls, name)
    setattr(cls, name, fn)
    try:
        yield
    finally:
        setattr(cls, name, original)


class NoWait:
    """A Work whose wait() was removed from the lesson: it returns at once."""

    def __init__(self, work):
        self.work = work

    def wait(self, *args, **kwargs):
        return True


def unwaited_02():
    """02 with one wait() removed: the step's first all-reduce; its gradient reaches the optimizer NaN."""
    dp = load_lesson("02_async_allreduce").AsyncAllReduceDP
    launch = dp._all_reduce_grad

    def launch_one_unwaited(self, p):
        launch(self, p)
        if len(self.handles) == 1:
            self.handles[0] = NoWait(self.handles[0])
    with patched(dp, "_all_reduce_grad", launch_one_unwaited):
        return run_lesson("02_async_allreduce", ARGV)


def unwaited_06():
    """06 with one wait() removed: the last unit's reduce-scatter, every backward."""
    z = load_lesson("06_zero3").ZeRO3
    reduce_scatter = z._reduce_scatter

    def reduce_scatter_one_unwaited(self, unit):
        reduce_scatter(self, unit)
        if unit.index == len(self.units) - 1:
            unit_, work, grad_shard = self.grads_in_flight[-1]
            self.grads_in_flight[-1] = (unit_, NoWait(work), grad_shard)
    with patched(z, "_reduce_scatter", reduce_scatter_one_unwaited):
        return run_lesson("06_zero3", ZERO3)


def divided_in_flight_03():
    """03 dividing a bucket after launching its all-reduce: an input written in flight."""
    bucketed = load_lesson("03_buckets").BucketedDP

    def launch_then_divide(self, bucket):
        work = dist.all_reduce(bucket.buffer, async_op=True)
        bucket.buffer.mul_(1 / self.world_size)
        return work
    with patched(bucketed, "_launch", launch_then_divide):
        return run_lesson("03_buckets", BUCKETS)


MUTANTS = {"02_unwaited": unwaited_02, "06_unwaited": unwaited_06,
           "03_divided_in_flight": divided_in_flight_03}


def expect_error(fn):
    """The AssertionError fn() raises, as text (both ranks raise it at the same wait())."""
    try:
        fn()
    except AssertionError as e:
        return str(e)
    return None


def harness_itself():
    """The harness on bare collectives: what it shows before and after wait(), what it refuses."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out, installed = {}, (dist.all_reduce, dist.P2POp)
    with StreamSemantics() as s:
        x = torch.full((4,), rank + 1.0)
        work = dist.all_reduce(x, async_op=True)
        out["all_reduce_before"], _ = x.clone(), work.wait()
        out["all_reduce_after"] = x.clone()
        full = torch.arange(2.0 * world) + rank
        shard = torch.empty(2)
        work = dist.reduce_scatter_tensor(shard, full, async_op=True)
        out["reduce_scatter_before"], _ = shard.clone(), work.wait()
        out["reduce_scatter_after"] = shard.clone()
        gathered = torch.empty(2 * world)
        gathered[2 * rank:2 * rank + 2] = rank + 1.0
        work = dist.all_gather_into_tensor(gathered, gathered[2 * rank:2 * rank + 2], async_op=True)  # in place
        out["all_gather_before"], _ = gathered.clone(), work.wait()
        out["all_gather_after"] = gathered.clone()
        send, recv = torch.full((3,), rank + 1.0), torch.empty(3)
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, send, (rank + 1) % world),
                                        dist.P2POp(dist.irecv, recv, (rank - 1) % world)])
        out["recv_before"] = recv.clone()
        for w in works:
            w.wait()
        out["recv_after"] = recv.clone()
        with CommMeter(world).measuring() as meter:  # entered inside: it wraps the harness's wrappers
            y = torch.ones(4)
            dist.all_reduce(y, async_op=True).wait()
        out["metered"], out["metered_result"] = meter.ops, y

        def written():
            inp = torch.ones(2 * world)
            w = dist.reduce_scatter_tensor(torch.empty(2), inp, async_op=True)
            inp.mul_(2)
            w.wait()
        out["written"] = expect_error(written)

        def freed():
            buffer = torch.empty(2 * world)
            w = dist.all_gather_into_tensor(buffer, torch.ones(2), async_op=True)
            buffer.untyped_storage().resize_(0)
            w.wait()
        out["freed"] = expect_error(freed)
        out["checked"] = s.checked
    try:
        with StreamSemantics():
            dist.all_reduce(torch.ones(5, 3), async_op=True)
    except AssertionError as e:
        out["never_waited"] = str(e)
    out["restored"] = (dist.all_reduce, dist.P2POp) == installed
    # two groups' collectives issued in opposite orders on the two ranks: gloo (a context per
    # group) completes them; NCCL may not, and the lists of calls must tell
    other = dist.new_group(group_desc="other")
    with StreamSemantics() as s:
        groups = [None, other] if rank == 0 else [other, None]
        works = [dist.all_reduce(torch.ones(3), group=g, async_op=True) for g in groups]
        for w in works:
            w.wait()
    out["crossed_order"] = s.order
    return out


def suite(world):
    if world == 4:
        return {name: twice(lambda: run_lesson(lesson, argv))
                for name, (lesson, argv) in GRID.items() if of_lesson(name)}
    out = {}
    for name, (lesson, argv) in CASES.items():
        if not of_lesson(name):
            continue
        with _ring_installed(name.endswith("_ring")):
            out[name] = twice(lambda: run_lesson(lesson, argv))
    out.update({name: twice(lambda: toy_train(build, n, **kw)) for name, (n, kw) in TOYS.items() if of_lesson(name)})
    if of_lesson("00"):
        ring = ["--n-layer", "1", "--d-model", "33", "--n-head", "3", "--vocab-size", "65", "--device", "cpu"]
        out["00"] = twice(lambda: load_lesson("00_collectives").main(ring))
    if os.environ.get("LESSON"):  # make test LESSON=0N: its cases only, above
        return out
    out["mutants"] = {name: caught(mutant) for name, mutant in MUTANTS.items()}
    out["harness"] = harness_itself()
    return out


@contextlib.contextmanager
def _ring_installed(ring):
    """The ring's collectives in dist before StreamSemantics wraps what dist holds (the lesson's
    own init then leaves them in place: ring_collectives.use), torch's again after."""
    from scripts.perf import ring_collectives
    if ring:
        ring_collectives.use("ring")
    try:
        yield
    finally:
        ring_collectives.use("torch")


results = launches(suite)  # one launch of 2 ranks for the whole file, and one of 4 for GRID


# ----------------------------------------------------------------------------- the lessons
def same_bits(a, b):
    assert a["losses"] == b["losses"]
    assert a["params"].keys() == b["params"].keys()
    for name in a["params"]:
        assert torch.equal(a["params"][name], b["params"][name]), name


@pytest.mark.parametrize("world, case", [(2, case) for case in [*CASES, *TOYS]] + [(4, case) for case in GRID])
def test_lesson_runs_clean_under_nccl_semantics_with_the_same_bits(world, case):
    for rank, out in enumerate(results(world)):
        assert "error" not in out[case], f"rank {rank}, {case}: {out[case].get('error')}"
        same_bits(out[case]["checked"], out[case]["plain"])
        if out[case]["plain"].get("report"):  # (rank 0's) CommMeter, inside the harness, counted the same
            assert out[case]["checked"]["report"]["comm"]["ops"] == out[case]["plain"]["report"]["comm"]["ops"]
        if case.removeprefix("toy_")[:2] in ASYNC:
            assert out[case]["collectives"] > 0  # the async path ran under the harness


@pytest.mark.parametrize("world, case", [(2, case) for case in [*CASES, *TOYS, "00"]] + [(4, case) for case in GRID])
def test_every_rank_issues_the_same_collectives_in_the_same_order(world, case):
    """Over all its process groups at once (NCCL gives each group its own stream, so two ranks
    issuing two groups' collectives in opposite orders can wait on each other for ever; gloo,
    a context per group, never notices), whatever each rank's data did (the toys' routing)."""
    orders = [out[case]["order"] for out in results(world)]
    assert orders[0], case  # the harness saw its calls
    assert first_difference(orders) is None, f"{case}: {first_difference(orders)}"


def test_00_ring_runs_clean_under_nccl_semantics():
    for rank, out in enumerate(results(2)):
        assert "error" not in out["00"], f"rank {rank}: {out['00'].get('error')}"
        for kind, o in out["00"]["checked"][rank].items():
            assert o["equal_to_torch"], kind
        assert out["00"]["collectives"] > 0  # its sends and receives went through the harness


# ----------------------------------------------------------------------------- it catches
def nan_in(run):
    return any(math.isnan(v) for v in run["losses"]) or any(p.isnan().any() for p in run["params"].values())


def test_catches_02_with_one_wait_removed():
    for out in results(2):
        m = out["mutants"]["02_unwaited"]
        assert m["error"] is not None and "never waited" in m["error"] and "all_reduce" in m["error"], m["error"]
        assert nan_in(m["result"])  # the optimizer read the gradient NaN, as NCCL may leave it


def test_catches_06_with_one_wait_removed():
    for out in results(2):
        m = out["mutants"]["06_unwaited"]
        assert m["error"] is not None and "never waited" in m["error"] and "reduce_scatter" in m["error"], m["error"]
        assert nan_in(m["result"])


def test_catches_03_writing_a_bucket_in_flight():
    for out in results(2):
        error = out["mutants"]["03_divided_in_flight"]["error"]
        assert error is not None and "dist.all_reduce" in error and "was written to" in error, error
        assert "in launch_then_divide" in error  # names where the collective was issued


# ----------------------------------------------------------------------------- the harness
def test_outputs_are_nan_until_wait_then_the_result():
    for rank, out in enumerate(results(2)):
        h = out["harness"]
        for kind in ("all_reduce", "reduce_scatter", "all_gather"):
            assert h[f"{kind}_before"].isnan().all(), kind
        assert torch.equal(h["recv_before"].isnan(), torch.ones(3, dtype=torch.bool))
        assert torch.equal(h["all_reduce_after"], torch.full((4,), 3.0))  # 1 + 2
        assert torch.equal(h["reduce_scatter_after"], 2 * torch.arange(2.0 * rank, 2.0 * rank + 2) + 1)
        assert torch.equal(h["all_gather_after"], torch.tensor([1.0, 1, 2, 2]))
        assert torch.equal(h["recv_after"], torch.full((3,), float(2 - rank)))  # from the other rank


def test_refuses_an_input_written_or_a_buffer_freed_before_wait():
    for out in results(2):
        h = out["harness"]
        assert "dist.reduce_scatter_tensor" in h["written"] and "input (4,) float32 was written to" in h["written"]
        assert "dist.all_gather_into_tensor on (4,)" in h["freed"] and "output (4,) float32 was freed" in h["freed"]
        assert "test_stream_semantics.py" in h["freed"]  # where it was issued


def test_tells_ranks_that_issue_two_groups_in_opposite_orders():
    orders = [out["harness"]["crossed_order"] for out in results(2)]
    assert orders[0] == [("all_reduce", "world", "(3,) float32"), ("all_reduce", "other", "(3,) float32")]
    assert orders[1] == orders[0][::-1]
    assert first_difference(orders) == (0, (orders[0][0], orders[1][0]))


def test_reports_a_collective_never_waited_for():
    for out in results(2):
        assert "never waited" in out["harness"]["never_waited"]
        assert "dist.all_reduce on (5, 3) float32" in out["harness"]["never_waited"]


def test_composes_with_comm_meter_and_restores_torch():
    for out in results(2):
        h = out["harness"]
        assert h["metered"] == {"all_reduce": {"calls": 1, "bytes": 16}}
        assert torch.equal(h["metered_result"], torch.full((4,), 2.0))
        assert h["restored"]
