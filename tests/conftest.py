import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for path in (ROOT, os.path.dirname(os.path.abspath(__file__))):
    if path not in sys.path:
        sys.path.insert(0, path)
os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_configure(config):
    # torch's own: importing torch.distributed.optim (ZeroRedundancyOptimizer, the tests' reference)
    # scripts its functional optimizers, and torch 2.13 deprecates torch.jit.script. Not ours to fix.
    config.addinivalue_line("filterwarnings", "ignore:`torch.jit.(script|interface)` is deprecated:DeprecationWarning")
