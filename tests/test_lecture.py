"""The lecture run prints one table: six lessons, the same loss, measured bytes equal to theory.

A tiny model and 3 steps keep it to one ~15 s torchrun launch (2 ranks, all six lessons)."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_lecture_table():
    out = subprocess.run([sys.executable, "-m", "scripts.learn.lecture", "--steps", "3",
                          "--n-layer", "1", "--d-model", "32", "--seq-len", "16"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    # one header line, the column titles, a rule, six rows: nothing else
    assert len(lines) == 9, out.stdout
    assert "Warning" not in out.stdout + out.stderr and "summary" not in out.stdout
    assert not any(l.startswith(("step ", "W", "I", "[")) for l in lines), out.stdout  # no per-step lines, no logs
    rows = [l.split() for l in lines[3:9]]
    assert [r[0] for r in rows] == ["01_vanilla_dp", "02_async_allreduce", "03_buckets",
                                    "04_zero1", "05_zero2", "06_zero3"]
    for r in rows:
        assert r[2] == "\u2713", r  # loss equal to 01's to 4 decimals (fp32)
        sent, sent_th, *held = r[4:]
        # measured vs theory, at the printed precision (MiB, 3 decimals): sent exactly; params,
        # grads, optim within one unit of the last digit, as padding and AdamW's 4-byte step
        # counts (one per parameter a shard holds) can tip a rounding the theory does not have
        assert sent == sent_th, r
        assert all(abs(float(m) - float(t)) <= 0.001 + 1e-9 for m, t in zip(held[0::2], held[1::2])), r
