"""Lesson 03: gradient buckets. Gradients live in a few large flat buffers, and each buffer gets
one async all-reduce as soon as all of its gradients are ready, while backward goes on.

02 pays a collective's fixed cost (latency, a kernel launch, a gloo round trip) once per
parameter, and a GPT has dozens of small ones. A bucket packs many gradients back to back in one
flat buffer (`bucket.py`), so one all-reduce moves them all; it starts once its last gradient has
been accumulated, so communication still overlaps backward. Same bytes as 01 and 02, far fewer
calls (the default GPT's 52 gradients fill 2 buckets). This is what PyTorch's
DistributedDataParallel does (`bucket_cap_mb=25` by default).
Bucket 0, which holds the last layers (their gradients come first), is capped at 1 MiB, as
DDP's (`_DEFAULT_FIRST_BUCKET_BYTES`): with one 25 MiB bucket a small model's all-reduce would
start only when backward is over, with nothing left to overlap it with. In bf16, micro-steps'
gradients add up in fp32, never in bf16: each bucket receives their fp32 sum rounded once, as
in 01.

    python 03_buckets.py                                  # one process (world size 1)
    torchrun --nproc_per_node=2 03_buckets.py             # 2 ranks on CPU (gloo)
    torchrun --nproc_per_node=4 03_buckets.py --device cuda   # 4 GPUs (nccl)
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d \\
             --rdzv-endpoint=HOST:29500 03_buckets.py    # 2 nodes, run on each
"""
import functools

import torch.distributed as dist
import torch.nn as nn

from bucket import BucketManager
from lessonkit import checkpoint, common, ddp, lifecycle, loss_scale, measure, optimizers
from model import get_batch


# ----------------------------------------------------------------------------- the strategy
class BucketedDP(ddp.Replicated):
    """Replicate `module`; gradients live in flat buckets, each all-reduced (async) as soon as it
    is full; `finish_gradient_synchronization()` waits for them all when backward is over.
    Shaped like `DistributedDataParallel(module, bucket_cap_mb=...)` (ddp.Replicated)."""

    def __init__(self, module: nn.Module, bucket_cap_mb: float = 25, first_bucket_cap_mb: float = 1,
                 find_unused_parameters: bool = False):
        super().__init__(module, find_unused_parameters)  # (ddp.Replicated says what the flag does)
        # Each p.grad becomes a view of its bucket's buffer (grads_as_views, DDP's
        # gradient_as_bucket_view): autograd accumulates straight into the buffer, nothing is
        # copied in or out, and the buckets are the gradients' memory, not an extra copy of it.
        # Buckets launch in one fixed order, bucket 0, 1, 2, ..., on every rank, even when a later
        # bucket fills first: ranks match collectives by the order they are issued, not by name,
        # so a rank launching bucket 1 while another launches bucket 0 would add unrelated
        # gradients together (or hang, if the sizes differ).
        self.buckets = BucketManager(module.parameters(), bucket_cap_mb, self._launch,
                                     first_bucket_cap_mb=first_bucket_cap_mb)  # bucket 0: starts early
        # The same event as 02 (after accumulation, passed the parameter; see 02 for why).
        for p in module.parameters():  # a tied parameter is yielded once
            if p.requires_grad:  # frozen parameters have no gradient and no place in a bucket
                p.register_post_accumulate_grad_hook(self._grad_ready)

    def _grad_ready(self, p):  # (BucketManager.ready runs under no_grad)
        if not self.require_backward_grad_sync:  # no_sync(), a non-final micro-step: accumulate
            return
        self.at_end_of_backward(self.finish_gradient_synchronization)  # as DDP: in loss.backward()
        self.buckets.ready(p)  # launches every bucket that is now full, in bucket order

    def _launch(self, bucket):
        # The global gradient is the SUM of the ranks' gradients divided by N (see 01).
        # ### BEGIN SOLUTION: all-reduce one bucket
        # GOAL: start averaging the whole bucket (bucket.buffer: its gradients, at once) over the
        #       ranks, in place, without blocking: one collective per bucket. Return its handle: the
        #       BucketManager completes it at the end of backward.
        bucket.buffer.div_(self.world_size)  # (numel,) every gradient of the bucket at once
        return dist.all_reduce(bucket.buffer, async_op=True)  # one call per bucket
        # ### END SOLUTION

    def finish_gradient_synchronization(self):
        # Launches any bucket still waiting on a gradient that never came here (a parameter this
        # rank's data skipped: it goes as zeros, its share of the mean), then waits for every
        # all-reduce. The gradients are in place, in the buckets; a parameter with no gradient on
        # this rank kept p.grad None, so it is pointed at its view, which now holds the mean that
        # the ranks that used it sent. Only one no rank used (find_unused_parameters) stays None.
        with_grad = [p for p in self.buckets.bucket_of if p.grad is not None]
        self.buckets.finish()
        unused = self.unused_everywhere(with_grad)  # find_unused_parameters: after every bucket
        for p, bucket in self.buckets.bucket_of.items():
            if p.grad is None and p not in unused:
                p.grad = bucket.view(p)


# ----------------------------------------------------------------------------- training
def main(argv=None):
    args = common.parse_args(argv, description=__doc__)
    env = common.init_distributed(args)
    model = BucketedDP(common.build_model(args, env), bucket_cap_mb=args.bucket_mb)
    # weight decay on matrices and embeddings only (optimizers.decay_groups, as nanoGPT)
    optimizer = optimizers.MixedPrecisionAdamW(optimizers.decay_groups(model, args.weight_decay), args.grad_clip,
                                           **optimizers.adamw_kwargs(args))
    scaler = loss_scale.LossScaler(env.device, enabled=args.precision == "fp16", init_scale=args.loss_scale)
    run = measure.Run(args, env, "buckets", model.module, optimizer, holders=[model], loss_scaler=scaler)
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
                loss = model(x, y) / args.grad_accum  # gradients accumulate in the buckets
                scaler.scale(loss).backward()  # the hooks launch each bucket's all-reduce once it is full;
                losses.append(loss)  # at its end, finish_gradient_synchronization() waits for all
            scaler.step(optimizer)  # fp16: unscaled in fp32; an inf or NaN on any rank: every rank skips it
            scaler.update()
            optimizer.zero_grad(set_to_none=False)  # in place: the grads stay bucket views, no copy
        ckpt.maybe_save(step + 1)  # every --save-every steps (rank 0 writes the replicated state)
    ### TRAINING SECTION END

    run.finish()
    return run


if __name__ == "__main__":
    lifecycle.run_main(main)
