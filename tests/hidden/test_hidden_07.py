"""Hidden tests of 07_offload: 3 ranks, odd shapes (every unit padded), accumulation, the
gradient's scale through SGD, and clipping over the host's gradient shards with every unit's
copies counted: one shard up and one gradient shard down per unit and micro-step."""

import harness
from hidden_suite import check_gpt, check_grads, check_toy, close, launch
from lessons import build
from toy import toy_reference, toy_train

CLIP = 0.05  # the toy's gradient norm is about 0.5: clipping changes every step
STEPS, ACCUM = 4, 2  # 12 rows: 4 a rank at 3 ranks, 2 a micro-step


def clipped_and_counted():
    """In a rank: the toy through 07 with clipping and accumulation, ranks starting different;
    with the copies its strategy counted, the bytes of my shards (padding included) and of those
    of the units that train (the frozen layer's unit reduce-scatters nothing: it has no gradient)."""
    built = []

    def building(lesson, module, **kw):
        trainer = build(lesson, module, **kw)
        built.append(trainer.model)  # the ZeRO3Offload
        return trainer
    out = toy_train(building, "07", steps=STEPS, grad_accum=ACCUM, different_init=True, grad_clip=CLIP)
    z = built[0]
    nbytes = [(u.shard.numel() * u.shard.element_size(), bool(u.trainable)) for u in z.units]
    return {**out, "copies": z.counters(), "shard_bytes": sum(b for b, _ in nbytes),
            "trained_shard_bytes": sum(b for b, trains in nbytes if trains)}


EXTRA = {"clip": clipped_and_counted}


@harness.once
def results():
    return launch("07", EXTRA)


def test_toy_at_3_ranks_tied_frozen_unused_different_init_accumulation():
    check_toy(results())


def test_gradient_scale_through_sgd_at_3_ranks_4_micro_steps():
    check_grads(results())


def test_gpt_of_odd_shapes_at_3_ranks_with_accumulation():
    check_gpt(results())


def test_clipping_over_the_hosts_gradient_shards_with_accumulation():
    ref = toy_reference(grad_clip=CLIP)
    for rank_out in results():
        close(rank_out["clip"], ref)


def test_every_unit_copies_its_shard_up_and_its_gradient_shard_down_at_every_micro_step():
    # up: every unit's shard at each micro-step's first forward (the frozen one's too: its
    # all-gather sends it); down: each trained unit's reduce-scattered shard, fp32 here
    for rank_out in results():
        out = rank_out["clip"]
        assert out["copies"]["h2d_bytes"] == STEPS * ACCUM * out["shard_bytes"], out["copies"]
        assert out["copies"]["d2h_bytes"] == STEPS * ACCUM * out["trained_shard_bytes"], out["copies"]
