"""Lesson 08: hybrid sharding (HSDP). Shard inside a group of G ranks (a node), replicate across groups.

06 sends 3 Psi (N-1)/N per rank per step, at scale mostly to other nodes, over slower links.
HSDP runs 06 inside each node only and keeps a replica of the sharded model on every node. The N = R x G ranks form a grid: rank r is
in shard group r // G (a node's consecutive ranks) and replicate group r % G (one rank a node):

    # 1) all-gather unit i inside my shard group      (the fast link; prefetched as in 06)
    # 2) forward unit i
    # 3) free unit i's full parameters (keep my shard)
    # 4) all-gather unit i again for its backward     (the fast link)
    # 5) reduce-scatter unit i's gradients inside my shard group: my shard, summed over the node
    # 5b) all-reduce that gradient shard across my replicate group: summed over every rank
    # 6) the optimizer on my shard (Psi / G), the same update on every replica

Per rank and step: intra 3 Psi (G-1)/G, inter 2 (Psi/G)(R-1)/R. G defaults to torchrun's
LOCAL_WORLD_SIZE: on one node G = N, which is 06; --shard-group 1 is replication (DDP's
traffic). MiCS (Zhang et al. 2022) is this grid.

    torchrun --nproc_per_node=4 08_hybrid.py --shard-group 2         # 2 x 2 on CPU (gloo)
    torchrun --nproc_per_node=2 08_hybrid.py --shard-group 1         # 2 replicas of one shard
    torchrun --nproc_per_node=4 08_hybrid.py --shard-group 2 --link 10:5 --inter-link 0.5:100
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d \\
             --rdzv-endpoint=HOST:29500 08_hybrid.py                 # G = 8, run on each node

PyTorch: FSDP2 `fully_shard` on a DeviceMesh shaped as this grid (FSDP1: HYBRID_SHARD); DeepSpeed: MiCS.
"""
import functools
import importlib
from datetime import timedelta

import torch
import torch.distributed as dist

from lessonkit import checkpoint, common, lifecycle, loss_scale, measure, optimizers
from model import get_batch

zero3 = importlib.import_module("06_zero3")  # 08 is 06 over a shard group, plus 5b)


# ----------------------------------------------------------------------------- the grid
def hybrid_groups(shard_size, timeout=None):
    """The R x G grid's process groups for this rank: (its shard group, its replicate group).
    new_group is collective over the whole world: every rank creates every group, in the same
    order, members or not. Named (group_desc) so the measurement can tell the two links apart."""
    rank, world = dist.get_rank(), dist.get_world_size()
    kw = {"timeout": timedelta(seconds=timeout)} if timeout else {}
    # ### BEGIN SOLUTION: the grid's groups
    # GOAL: shards lists the shard groups' ranks (each G consecutive ranks: a node) and replicas
    #       the replicate groups' (each the ranks that hold the same shard, one per node), in rank
    #       order: with 4 ranks and G = 2, [[0, 1], [2, 3]] and [[0, 2], [1, 3]].
    shards = [list(range(k, k + shard_size)) for k in range(0, world, shard_size)]
    replicas = [list(range(j, world, shard_size)) for j in range(shard_size)]
    # ### END SOLUTION
    mine = {}
    for name, grid in (("shard", shards), ("replicate", replicas)):
        for ranks in grid:
            group = dist.new_group(ranks, group_desc=name, **kw)
            if rank in ranks:
                mine[name] = group
    return mine["shard"], mine["replicate"]


# ----------------------------------------------------------------------------- the strategy
class HybridShard(zero3.ZeRO3):
    """06's ZeRO3 with each unit cut over `shard_group` and every gradient shard all-reduced over
    `replicate_group`, used where a loop used FSDP2's `fully_shard` over a 2-D mesh (HSDP).

    shard_group      the ranks a unit is cut over (a node): 1) 4) 5) run there (None: all)
    replicate_group  the ranks holding the same shard as I do, one per shard group: 5b) (None:
                     no replicas, 06). The two must form a grid of the world: G x R = N.
    everything else as 06's ZeRO3

    `parameters()` are my shards of Psi / G elements; each replica holds and steps the same ones.
    """

    def __init__(self, module, units=(), mp_policy=None, shard_group=None, replicate_group=None, **kwargs):
        self.replicate_group = replicate_group
        super().__init__(module, units, mp_policy, shard_group=shard_group, **kwargs)
        self.requires_all_reduce = True
        for unit in self.units:
            unit.partial_grad = None  # my group's sum of the micro-steps not yet all-reduced (fp32)

    def set_requires_all_reduce(self, requires_all_reduce, recurse=True):
        """FSDP2's (--all-reduce-every step on all micro-steps but the last): False still runs 5) in
        my shard group at each backward but keeps its sum, in fp32, for the next backward with True,
        whose 5b) all-reduces it once: the slow link carries 1/K of the bytes, for Psi / G held."""
        self.requires_all_reduce = requires_all_reduce

    def _replicas(self):
        return dist.get_world_size(self.replicate_group) if self.replicate_group is not None else 1

    def _wait_reduce_scatters(self):
        done = [unit for unit, _, _ in self.grads_in_flight]
        super()._wait_reduce_scatters()  # 5) done: unit.grad_shard, summed over my shard group
        for unit in (done if self.replicate_group is not None else ()):  # (None: no replicas)
            if unit.partial_grad is not None or not self.requires_all_reduce:  # --all-reduce-every step:
                unit.partial_grad = (unit.grad_shard.float() if unit.partial_grad is None  # my group's sum
                                     else unit.partial_grad.add_(unit.grad_shard))      # of micro-steps, fp32
                if not self.requires_all_reduce:  # kept: nothing crosses to the replicas in this backward
                    unit.grad_shard = None
                    continue
                # the last micro-step's backward: the sum, rounded once, crosses below
                unit.grad_shard, unit.partial_grad = unit.partial_grad.to(unit.grad_shard.dtype), None
            # ### BEGIN SOLUTION: all-reduce a gradient shard across the replicas
            # GOAL: 5b) unit.grad_shard, summed over my shard group, becomes the sum over every rank,
            #       without blocking: backward goes on meanwhile, and unit.replicate_work keeps what
            #       _reduced_grad waits for before it reads the shard.
            unit.replicate_work = dist.all_reduce(unit.grad_shard, group=self.replicate_group, async_op=True)
            # ### END SOLUTION

    def _reduced_grad(self, unit):
        """06's, at the end of backward: my gradient shard, once 5b) has summed it everywhere."""
        if getattr(unit, "replicate_work", None) is not None:
            unit.replicate_work.wait()
            unit.replicate_work = None
        return super()._reduced_grad(unit)


# ----------------------------------------------------------------------------- checkpoints
def checkpoint_shards(model, optimizer, names):
    """06's, written by shard group 0 only (ranks 0 .. G-1): the other groups are its replicas,
    holding the same shards, and a checkpoint holds each element once. So the files are a 06
    checkpoint at world size G, which any grid (or 06) resumes: every rank loads its own shard."""
    shards = checkpoint.unit_shards(model, optimizer, names)
    if model.replicate_group is not None and dist.get_rank(model.replicate_group) > 0:  # a replica of group 0
        for s in shards:
            s.owned = (s.owned[0], s.owned[0])  # writes nothing; loads its shard all the same
    return shards


# ----------------------------------------------------------------------------- training
def build_model(args, env, groups):
    """06's GPT, each unit sharded over my shard group (`groups`: hybrid_groups' pair)."""
    shard_group, replicate_group = groups
    return zero3.build_model(args, env, HybridShard, shard_group=shard_group, replicate_group=replicate_group)


def main(argv=None):
    args = common.parse_args(argv, description=__doc__)
    env = common.init_distributed(args)
    node = lifecycle.env_int("LOCAL_WORLD_SIZE", 0)  # torchrun's ranks per node: G's default
    args.shard_group = args.shard_group or (node if node and env.world_size % node == 0 else env.world_size)
    groups = hybrid_groups(args.shard_group, args.timeout)  # the R x G grid
    model = build_model(args, env, groups)
    # any optimizer, over my shards (Psi / G), as over FSDP2's (weight decay: the matrices' shards)
    optimizer = torch.optim.AdamW(optimizers.decay_groups(model, args.weight_decay), **optimizers.adamw_kwargs(args))
    # fp16: dynamic loss scaling (lessonkit/loss_scale.py); its found-inf flag is all-reduced over the
    # world, not my shard group: every rank, every replica, takes the same decision
    scaler = loss_scale.LossScaler(env.device, enabled=args.precision == "fp16", init_scale=args.loss_scale)
    run = measure.Run(args, env, "hybrid", model.module, optimizer, holders=[model], loss_scaler=scaler)
    ckpt = checkpoint.Checkpointer(args, env, run.strategy, model.module,  # --checkpoint-dir
                                   functools.partial(checkpoint_shards, model, optimizer), loss_scaler=scaler)
    start = ckpt.resume()  # 0, or the step the newest checkpoint stopped at (any grid's, or 06's)

    ### TRAINING SECTION BEGIN
    for step in range(start, args.steps):
        with run.step(step) as losses:
            optimizers.set_learning_rate(optimizer, args, step)  # --lr-schedule, first (as nanoGPT)
            for micro in range(args.grad_accum):
                last = args.grad_accum - 1  # --reduce-every step: 5) and 5b) once; --all-reduce-every step: 5b) once
                model.set_requires_gradient_sync(args.reduce_every == "micro" or micro == last)
                model.set_requires_all_reduce(args.all_reduce_every == "micro" or micro == last)
                x, y = get_batch(args, env, step, micro)
                loss = model(x, y) / args.grad_accum  # 1) gather in my group 2) forward 3) free
                scaler.scale(loss).backward()  # 4) gather 5) reduce-scatter in my group 5b) all-reduce across replicas
                losses.append(loss)
            scaler.unscale_(optimizer)  # fp16: as 06 (the found-inf flag: over the world, not my group)
            if args.grad_clip > 0:
                model.clip_grad_norm_(args.grad_clip)  # one scalar all-reduce, over my shard group
            scaler.step(optimizer)  # 6) AdamW on my shards, the same on every replica (fp16: or skipped on all)
            scaler.update()
            optimizer.zero_grad()
        ckpt.maybe_save(step + 1)  # every --save-every steps (shard group 0 writes: 06's files at world G)
    ### TRAINING SECTION END

    run.finish()
    return run


if __name__ == "__main__":
    lifecycle.run_main(main)
