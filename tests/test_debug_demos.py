"""scripts/learn/debug/: each demonstration shows its symptom when broken and not with --fixed.

All six runs (3 demos x broken/fixed, 2 ranks each) start at once, as torchrun subprocesses,
so the test costs their start-ups on the machine's cores (18 processes importing torch: about
30 s on 2 idle cores) plus the hang demo's 5 s timeout, not six launches one after another."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMOS = ["wrong_hook", "unused_param_hang", "read_before_wait"]


def test_debug_demos():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    procs = {}
    for demo in DEMOS:
        for mode in ([], ["--fixed"]):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                   os.path.join(ROOT, "scripts", "learn", "debug", f"{demo}.py"), *mode]
            procs[demo, bool(mode)] = subprocess.Popen(cmd, cwd=ROOT, env=env, text=True,
                                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    outs = {key: p.communicate(timeout=120) for key, p in procs.items()}
    for (demo, fixed), (out, err) in outs.items():
        context = f"{demo} {'--fixed' if fixed else '(broken)'}:\n{out}\n{err[-2000:]}"
        assert procs[demo, fixed].returncode == 0, context
        if fixed:
            assert "FIXED:" in out and "SYMPTOM" not in out, context
        else:
            assert all(f"{tag}:" in out for tag in ("SYMPTOM", "CAUSE", "FIX")), context
            assert "FIXED:" not in out, context
    assert "Timed out" in outs["unused_param_hang", False][0]
