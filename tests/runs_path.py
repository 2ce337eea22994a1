"""Make scripts/ importable from the tests (the lesson list lives in scripts/runs.py)."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
from runs import LESSONS, available_lessons, launch  # noqa: E402,F401
