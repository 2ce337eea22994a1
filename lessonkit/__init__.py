"""The lessons' kit: everything that is not a lesson, one folder below the reading path.

A lesson imports it in one line (`from lessonkit import common, measure, ...`); none of it is
needed to follow an algorithm. Each module holds one kind of thing: set-up (common), a clean
exit (lifecycle), DDP's shape for 01-03 (ddp), the optimizer side (optimizers), the ZeRO paper's
formulas (theory), measurement (measure, comm_meter, memory_ledger) and checkpoints (checkpoint,
reshard).
"""
