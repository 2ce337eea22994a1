"""The server the tests' ranks fork from (harness.spawn), started by conftest before it imports
torch, so that the server's own import of torch runs on the other core beside pytest's collection.

Ranks are forked from a server process that has imported torch once, and torch._dynamo, which
the first optimizer step of every process imports (forkserver, with those preloaded): a rank
then starts in well under a second instead of about 4 s, and the suite runs dozens of them.
The server also preloads what every rank imports next and nobody grades: pytest (a rank runs
pytest's main module as its own, guarded), the support modules (model.py, lessonkit/) and the
parts of torch they import. Never a graded file (a lesson, bucket.py): a student's may hang at
import, and it must be read from where the test says.
Forked ranks share what the server had: its environment (from when it started) and its hash
seed. So each rank starts as a new interpreter instead (spawn) with `fresh=True`, and whenever
graded files come from elsewhere (DP_LESSONS: set before or during the run, and a student's code
must meet what torchrun gives it, a hash seed of its own included).
"""
import multiprocessing
import multiprocessing.forkserver

CONTEXT = multiprocessing.get_context("forkserver")
CONTEXT.set_forkserver_preload([
    "torch", "torch.distributed", "torch._dynamo", "torch.distributed.checkpoint", "torch.distributed.fsdp",
    "pytest", "model", *(f"lessonkit.{m}" for m in (
        "checkpoint", "common", "comm_meter", "dcp", "ddp", "flat_units", "lifecycle", "loss_scale", "measure",
        "memory_ledger", "optimizers", "reshard", "schedule", "simulate", "summary", "theory"))])


def start():
    """Start the server now (it is started at the first launch otherwise); it imports as it starts."""
    multiprocessing.forkserver.ensure_running()
