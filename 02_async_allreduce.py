"""Lesson 02: overlap communication with backward. Each gradient's all-reduce starts, async, from
its parameter's hook, while backward goes on computing the gradients of earlier layers.

In 01 the network idles during backward and the cores idle during the all-reduces. But backward
produces gradients last layer first, and a parameter's gradient is final as soon as autograd has
accumulated it into `.grad`: its all-reduce can start right then. Before the optimizer step we
wait for every one of them. Same bytes as 01, same result; only the timing changes. (In bf16,
micro-steps' gradients add up in fp32, never in bf16: the hook finds p.grad holding their fp32 sum
rounded once, as in 01.)

    python 02_async_allreduce.py                                  # one process (world size 1)
    torchrun --nproc_per_node=2 02_async_allreduce.py             # 2 ranks on CPU (gloo)
    torchrun --nproc_per_node=4 02_async_allreduce.py --device cuda   # 4 GPUs (nccl)
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d \\
             --rdzv-endpoint=HOST:29500 02_async_allreduce.py    # 2 nodes, run on each
"""
import functools

import torch
import torch.distributed as dist
import torch.nn as nn

from lessonkit import checkpoint, common, ddp, lifecycle, loss_scale, measure, optimizers
from model import get_batch


# ----------------------------------------------------------------------------- the strategy
class AsyncAllReduceDP(ddp.Replicated):
    """Replicate `module`; every gradient's all-reduce is launched from its hook during backward,
    and `finish_gradient_synchronization()` waits for them all when backward is over. Shaped
    like `DistributedDataParallel(module)` (ddp.Replicated: `.module`, `no_sync()`, ...)."""

    def __init__(self, module: nn.Module, find_unused_parameters: bool = False):
        super().__init__(module, find_unused_parameters)  # (ddp.Replicated says what the flag does)
        self.handles = []  # async all-reduces in flight, in launch order
        # Collectives are matched across ranks by the order they are issued, not by name, so
        # every rank must launch the same parameters' all-reduces in the same order. Backward's
        # order is the same on every rank only while every rank's graph is the same; a parameter
        # one rank's data skipped (an MoE expert with no tokens there) changes it. So gradients
        # launch in one fixed order, reverse registration (roughly backward's own): a gradient
        # that is ready early waits for the ones before it (DDP's buckets keep a fixed order too).
        self.order = [p for p in reversed(list(module.parameters())) if p.requires_grad]
        self.ready, self.launched = set(), 0  # this backward's ready gradients; order[:launched] went
        self.queued_in = None  # the backward whose end runs finish_gradient_synchronization
        # Which autograd event: a post-accumulate-grad hook runs after autograd has added this
        # backward's gradient into p.grad, and it is passed the parameter, not a gradient. p.grad
        # is then exactly what the optimizer will read: both uses of the tied embedding/head
        # summed, and under accumulation the earlier micro-steps included. A plain
        # p.register_hook(fn) runs one event earlier and is passed only this backward's incoming
        # gradient, not yet in p.grad: reducing that would miss the earlier micro-steps, and
        # autograd adds it into p.grad while the async all-reduce may still be writing it.
        for p in self.order:  # a tied parameter is yielded once: one hook, one all-reduce
            p.register_post_accumulate_grad_hook(self._grad_ready)  # (frozen ones: no gradient)

    @torch.no_grad()
    def _grad_ready(self, p):
        if not self.require_backward_grad_sync:  # no_sync(), a non-final micro-step: accumulate
            return
        backward = torch._C._current_graph_task_id()  # this backward's id
        if self.queued_in != backward:  # its first gradient: wait for them all once it is over
            # The autograd engine runs a queued callback when the backward it was queued in ends,
            # inside loss.backward(), as DDP's reducer does: a loop written for DDP calls nothing
            # else before optimizer.step(). Keyed by the backward's id, not a flag cleared when it
            # runs: a backward that raised never runs its callbacks, and would leave such a flag set.
            self.queued_in = backward
            torch.autograd.Variable._execution_engine.queue_callback(self.finish_gradient_synchronization)
        self.ready.add(p)
        while self.launched < len(self.order) and self.order[self.launched] in self.ready:
            self._all_reduce_grad(self.order[self.launched])
            self.launched += 1

    def _all_reduce_grad(self, p):
        # The global gradient is the SUM of the ranks' gradients divided by N (see 01).
        # ### BEGIN SOLUTION: launch the gradient's all-reduce
        # GOAL: start averaging p.grad over the ranks, in place, without blocking backward: one
        #       collective per gradient, launched now; keep in self.handles what finishing it needs.
        p.grad.div_(self.world_size)
        self.handles.append(dist.all_reduce(p.grad, async_op=True))  # returns at once
        # ### END SOLUTION

    @torch.no_grad()
    def finish_gradient_synchronization(self):
        # What did not launch during backward, in order: a parameter with no gradient in this
        # backward (unused on this rank, or only in an earlier micro-step) and those after it.
        # One without any gradient here takes part with zeros, its share of the mean (see 01).
        with_grad = [p for p in self.order if p.grad is not None]
        for p in self.order[self.launched:]:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            self._all_reduce_grad(p)
        unused = self.unused_everywhere(with_grad)  # find_unused_parameters: after every launch
        # ### BEGIN SOLUTION: wait for the all-reduces
        # GOAL: when this returns, every collective launched this step has completed (each p.grad is
        #       the global-batch mean) and self.handles is ready for the next step.
        for work in self.handles:  # the optimizer must not read a gradient still in flight
            work.wait()
        self.handles.clear()
        # ### END SOLUTION
        for p in unused:  # no rank had a gradient: None again, so the optimizer skips it
            p.grad = None
        self.ready, self.launched = set(), 0
        self.grad_accumulation.reset()  # the optimizer step's gradients: the next backward starts a new sum


# ----------------------------------------------------------------------------- training
def main(argv=None):
    args = common.parse_args(argv, description=__doc__)
    env = common.init_distributed(args)
    model = AsyncAllReduceDP(common.build_model(args, env))
    # weight decay on matrices and embeddings only (optimizers.decay_groups, as nanoGPT)
    optimizer = optimizers.MixedPrecisionAdamW(optimizers.decay_groups(model, args.weight_decay), args.grad_clip,
                                           **optimizers.adamw_kwargs(args))
    scaler = loss_scale.LossScaler(env.device, enabled=args.precision == "fp16", init_scale=args.loss_scale)
    run = measure.Run(args, env, "async_allreduce", model.module, optimizer, holders=[model], loss_scaler=scaler)
    ckpt = checkpoint.Checkpointer(args, env, run.strategy, model.module,  # --checkpoint-dir
                                   functools.partial(optimizers.checkpoint_shards, optimizer), loss_scaler=scaler)
    start = ckpt.resume()  # 0, or with --resume the step the newest checkpoint stopped at

    ### TRAINING SECTION BEGIN
    for step in range(start, args.steps):
        with run.step(step) as losses:
            optimizers.set_learning_rate(optimizer, args, step)  # --lr-schedule, first (as nanoGPT)
            for micro in range(args.grad_accum):
                x, y = get_batch(args, env, step, micro)
                # Only the last micro-step's hooks launch (nanoGPT toggles this flag the same way
                # rather than wrap the other micro-steps in DDP's `no_sync()`).
                model.require_backward_grad_sync = micro == args.grad_accum - 1
                loss = model(x, y) / args.grad_accum  # gradients accumulate in .grad
                scaler.scale(loss).backward()  # the hooks launch the all-reduces; at its end, wait for them all
                losses.append(loss)
            scaler.step(optimizer)  # fp16: unscaled in fp32; an inf or NaN on any rank: every rank skips it
            scaler.update()
            optimizer.zero_grad()
        ckpt.maybe_save(step + 1)  # every --save-every steps (rank 0 writes the replicated state)
    ### TRAINING SECTION END

    run.finish()
    return run


if __name__ == "__main__":
    lifecycle.run_main(main)
