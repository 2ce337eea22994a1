"""The order 06-08's units run in, learned from forward, so every rank issues the same collectives
in the same order whatever its data did (docs/drop_in.md, "Model shapes 06-08 train").

It starts as the listed order. A call further on in it means this rank skipped the units between:
`forward` returns them, to gather and free all the same. A call it does not have next (a unit
called again, or out of order) is made on demand, as FSDP2 makes every call, and the schedule
becomes that forward's calls. Backward runs the entries in reverse (`last_use`: a unit's last)."""
import collections


class Schedule:
    def __init__(self, units):
        self.order, self.todo, self.back = list(units), [], 0

    def start_forward(self):
        self.ran, self.called, self.at, self.learn = [], [], 0, False

    def forward(self, index):
        """Forward calls unit `index`: the units before it in the schedule this rank skipped."""
        self.called.append(index)
        rest = self.order[self.at:]
        if index in rest:
            skipped = rest[:rest.index(index)]
            self.at += len(skipped) + 1
        else:  # called again, or out of the order: on demand, as FSDP2; learned at the end
            skipped, self.learn = [], True
        self.ran += skipped + [index]
        return skipped

    def next_forward(self):
        return self.order[self.at] if self.at < len(self.order) else None

    def end_forward(self):
        """The units of the schedule this forward did not reach; backward's entries are set."""
        skipped, self.order = self.order[self.at:], self.called if self.learn else self.order
        self.ran += skipped
        self.todo, self.back, self.uses = self.ran[::-1], 0, collections.Counter(self.ran)
        return skipped

    def backward(self, index):
        """Backward reaches unit `index`: the entries before it this rank's backward skipped."""
        if not self.ahead(index):
            raise RuntimeError(f"ZeRO3: unit {index}'s backward ran out of the reverse order of its forward calls")
        skipped = self.todo[self.back:self.todo.index(index, self.back)]
        self.back += len(skipped) + 1
        return skipped

    def ahead(self, index):
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
