"""The order ZeRO-3's units run in (06-08): learned from forward, so every rank issues the same
collectives in the same order whatever its data did.

A forward is a sequence of unit calls: each unit once in the order they were listed, or any
other order, a unit called twice (weights shared across depth), a unit this rank's data routes
around. The schedule is the sequence every rank follows:
- It starts as the units in the order they were listed. A call to a unit further on in it means
  this rank skipped the units in between: they are gathered and freed all the same (`skipped`),
  as on the ranks that ran them.
- A call the schedule does not have next (a unit called again, or in another order) is made on
  demand, as FSDP2 makes every call: every rank must then make the same calls in that forward.
  The schedule becomes that forward's calls, from the next forward on.
- Backward runs the forward's entries in reverse, each gathered again; a unit's gradient is
  reduce-scattered once, after its last entry (its first call in forward): `last_use`.
"""
import collections


class Schedule:
    def __init__(self, units):
        self.order = list(units)  # the unit indices, as every rank expects forward to call them
        self.ran, self.at, self.todo, self.back = [], 0, [], 0

    # forward
    def start_forward(self):
        self.ran, self.called, self.at, self.learn = [], [], 0, False

    def forward(self, index):
        """Forward calls unit `index`: the units before it in the schedule this rank skipped."""
        self.called.append(index)
        rest = self.order[self.at:]
        if index not in rest:  # called again, or out of the order: on demand, as FSDP2
            self.learn = True
            skipped = []
        else:
            skipped = rest[:rest.index(index)]
            self.at += len(skipped) + 1
        self.ran += skipped + [index]
        return skipped

    def next_forward(self):
        return self.order[self.at] if self.at < len(self.order) else None

    def end_forward(self):
        """Forward is over: the schedule's units it did not reach here (to gather and free all the
        same); backward's entries are set, and the schedule learns this forward's calls."""
        skipped = self.order[self.at:]
        self.ran += skipped
        if self.learn:
            self.order = self.called
        self.todo, self.back = self.ran[::-1], 0
        self.uses = collections.Counter(self.ran)
        return skipped

    # backward
    def backward(self, index):
        """Backward reaches unit `index`: the entries before it this rank's backward skipped."""
        rest = self.todo[self.back:]
        if index not in rest:
            raise RuntimeError(f"ZeRO3: unit {index}'s backward ran out of the reverse order of its forward calls "
                               "(a second backward through one forward, or branches autograd ran in another order)")
        self.back += rest.index(index) + 1
        return rest[:rest.index(index)]

    def ahead(self, index):
        """Whether backward has unit `index` still to run."""
        return index in self.todo[self.back:]

    def next_backward(self):
        return self.todo[self.back] if self.back < len(self.todo) else None

    def end_backward(self):
        skipped, self.back = self.todo[self.back:], len(self.todo)
        return skipped

    def last_use(self, index):
        """One of unit `index`'s entries is done in backward: was it its last?"""
        self.uses[index] -= 1
        return self.uses[index] == 0
