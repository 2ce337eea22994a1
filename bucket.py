"""Gradient buckets: 03 all-reduces them, 04 and 05 reduce-scatter them; 06 works per unit.

One collective per gradient pays the per-call latency once per parameter (a GPT has dozens of
small ones). A bucket packs many gradients into one flat buffer, so one collective moves them
all, and it can start as soon as its last gradient is ready, while backward goes on computing
the gradients of earlier layers: communication overlaps computation.

`Bucket` is the flat buffer and its layout. `BucketManager` assigns parameters to buckets,
tracks which gradients are ready, and launches the collective of each full bucket; *which*
collective is its user's choice (`launch`), so 03 all-reduces and 04 and 05 reduce-scatter.
"""
import math
from typing import Callable, Optional

import torch
import torch.nn as nn


class Bucket:
    """Parameters laid out back to back in one flat buffer, padded to a multiple of `pad_to`.

    Padding makes the buffer split evenly into `pad_to` shards (a reduce-scatter needs equal
    chunks); it stays zero.
    """

    def __init__(self, index: int, params: list, pad_to: int = 1):
        self.index = index
        self.params = params
        self.offsets = {}  # param -> (start, numel) in the flat buffer
        start = 0
        for p in params:
            self.offsets[p] = (start, p.numel())
            start += p.numel()
        self.numel = start
        self.numel_padded = math.ceil(start / pad_to) * pad_to
        self.dtype, self.device = params[0].dtype, params[0].device
        self.buffer: Optional[torch.Tensor] = None  # (numel_padded,), allocated by its user
        self.pending = set(params)  # gradients not yet ready in this backward

    def allocate(self):
        self.buffer = torch.zeros(self.numel_padded, dtype=self.dtype, device=self.device)
        return self.buffer

    def view(self, p, flat=None):
        """`p`'s slice of the bucket's buffer (or of any flat tensor with the same layout)."""
        start, numel = self.offsets[p]
        flat = self.buffer if flat is None else flat
        return flat[start:start + numel].view_as(p)

    def nbytes(self):
        return self.numel_padded * self.params[0].element_size()


class BucketManager:
    """Assign `params` to buckets and launch one collective per bucket, in a fixed order.

    params          the parameters whose gradients are bucketed (frozen ones are skipped)
    bucket_cap_mb   a bucket is closed before it would exceed this many MiB of gradients
    first_bucket_cap_mb  a smaller cap for bucket 0 (None: the same): its collective can then
                    start early in backward, not only once a whole 25 MiB bucket is full
    launch          launch(bucket) -> async work handle: the collective, chosen by the user
    grads_as_views  True (03, 04): each `p.grad` IS a view of its bucket's buffer, allocated once,
                    so autograd accumulates straight into the buffer, no copies (from a
                    parameter's first gradient on, as DDP's gradient_as_bucket_view; 04, which
                    never calls ready(), makes them views itself).
                    False (05): the buffer exists only while the bucket is in flight;
                    `ready(p)` copies p.grad into it and drops p.grad.
    pad_to          pad every bucket to a multiple of this (the world size for reduce-scatter)
    on_done         on_done(bucket) after its collective finished (e.g. keep my shard, free)
    max_in_flight   None (03): wait for every collective in finish(). k (05): before launching
                    a bucket, wait for the oldest while k are in flight and hand it to on_done,
                    so a bounded number of full-size buffers is ever alive during backward.
    """

    def __init__(self, params, bucket_cap_mb: float, launch: Callable, grads_as_views=True,
                 pad_to: int = 1, on_done: Optional[Callable] = None, max_in_flight: Optional[int] = None,
                 first_bucket_cap_mb: Optional[float] = None):
        unique = list({id(p): p for p in params if p.requires_grad}.values())  # tied: once
        self.launch_fn, self.on_done, self.grads_as_views = launch, on_done, grads_as_views
        self.max_in_flight = max_in_flight
        self.buckets = []
        first_cap = bucket_cap_mb if first_bucket_cap_mb is None else min(first_bucket_cap_mb, bucket_cap_mb)
        group, size = [], 0
        # Reverse registration order: backward produces the last layers' gradients first, so
        # the first bucket fills first and its collective starts earliest.
        for p in reversed(unique):
            cap = (bucket_cap_mb if self.buckets else first_cap) * 2 ** 20
            nbytes = p.numel() * p.element_size()  # the gradient's real element size
            # A flat buffer has one dtype and one device: a change of either closes the bucket.
            if group and (size + nbytes > cap or (p.dtype, p.device) != (group[0].dtype, group[0].device)):
                self.buckets.append(Bucket(len(self.buckets), group, pad_to))
                group, size = [], 0
            group.append(p)
            size += nbytes
        if group:
            self.buckets.append(Bucket(len(self.buckets), group, pad_to))
        self.bucket_of = {p: b for b in self.buckets for p in b.params}
        if grads_as_views:  # each p.grad becomes its view at p's first gradient (ready, _adopt)
            for b in self.buckets:
                b.allocate()
        self.in_flight = []  # (bucket, work) in launch order
        self.next_to_launch = 0

    @torch.no_grad()
    def ready(self, p: nn.Parameter):
        """Call when p's gradient for this backward is complete (from its post-accumulate hook)."""
        bucket = self.bucket_of[p]
        if self.grads_as_views:
            self._adopt(p, bucket)
        else:
            if bucket.buffer is None:
                bucket.allocate()
            bucket.view(p).copy_(p.grad)
            p.grad = None  # the bucket holds it now; the full gradient is not kept
        bucket.pending.discard(p)
        # Launch every full bucket in index order, never out of it: collectives are matched
        # by call order across ranks, so all ranks must launch bucket 0, then 1, ...
        # ### BEGIN SOLUTION: launch the full buckets, in order
        # GOAL: every bucket whose gradients are all ready is launched, in index order with no gap: a
        #       bucket goes only after every lower-index one went, so that all ranks issue the same
        #       collectives in the same order whatever order their gradients arrived in.
        while self.next_to_launch < len(self.buckets) and not self.buckets[self.next_to_launch].pending:
            self._launch(self.buckets[self.next_to_launch])
        # ### END SOLUTION

    @staticmethod
    def _adopt(p, bucket):
        """Make p.grad its bucket view, holding p's gradient. Autograd makes a fresh tensor for a
        parameter's first gradient, and again after zero_grad(set_to_none=True), PyTorch's
        default: copy it into the view and point p.grad at it, as DDP does with
        gradient_as_bucket_view; from then on autograd accumulates into the bucket. A parameter
        with no gradient on this rank sends zeros (its share of the mean), not last step's
        values, and keeps p.grad None: whether it gets one, after the collective, is its user's
        call (03: yes if another rank used it; None only if no rank did, with
        find_unused_parameters). After an in-place zero_grad(set_to_none=False), p.grad is a
        zeroed view, not None, and AdamW moves it, as it would in one process."""
        view = bucket.view(p)
        if p.grad is None:
            view.zero_()
        elif p.grad._base is not bucket.buffer:  # (a view's _base: the tensor it views)
            view.copy_(p.grad)
            p.grad = view

    def _launch(self, bucket):
        while self.max_in_flight is not None and len(self.in_flight) >= self.max_in_flight:
            self._complete(*self.in_flight.pop(0))  # the oldest first: collectives finish in order
        self.in_flight.append((bucket, self.launch_fn(bucket)))
        self.next_to_launch += 1

    def _complete(self, bucket, work):
        if work is not None:
            work.wait()
        if self.on_done is not None:
            self.on_done(bucket)

    @torch.no_grad()
    def finish(self):
        """Launch what has not been launched (a parameter that got no gradient on this rank
        leaves its bucket short of full: it goes with zeros for that gradient, in the same place
        in the order as on the ranks that used it, so collectives still match), then
        wait for every collective, in order. Afterwards the manager is ready for the next step."""
        while self.next_to_launch < len(self.buckets):
            bucket = self.buckets[self.next_to_launch]
            if bucket.buffer is None:
                bucket.allocate()
            for p in bucket.pending:  # no gradient in this backward, maybe one kept from earlier (no_sync)
                if self.grads_as_views:
                    self._adopt(p, bucket)
                elif p.grad is not None:
                    bucket.view(p).copy_(p.grad)
                    p.grad = None
            self._launch(bucket)
        for bucket, work in self.in_flight:
            self._complete(bucket, work)
        self.in_flight, self.next_to_launch = [], 0
        for b in self.buckets:
            b.pending = set(b.params)

    def unready(self):
        """Parameters whose gradient did not arrive in this backward (before finish())."""
        return [p for b in self.buckets for p in b.pending]
