"""Model-state memory per device under DP and ZeRO-1/2/3, as in the ZeRO paper's Tables 1 and 2.

    python -m scripts.learn.zero_calc --params 7.5B --world 64              # every stage: 120, 31.4, 16.6, 1.88 GB
    python -m scripts.learn.zero_calc --params 1T --world 1 4 16 64 256 1024
    python -m scripts.learn.zero_calc --fit 32GB --world 64 --stage 3       # the largest model that fits: 128B
    python -m scripts.learn.zero_calc --fit 80GiB --world 8 --k 16          # every stage, 16 bytes of optimizer state
    python -m scripts.learn.zero_calc --table1                              # the paper's Table 1, recomputed
    python -m scripts.learn.zero_calc --params 7.5B --world 64 --precision fp32   # 4 + 4 + 8 bytes

Model states only (Rajbhandari et al. 2020, section 3.1): 2 bytes of fp16/bf16 parameters, 2 of
gradients and K of optimizer state per parameter (K = 12 for mixed-precision Adam: fp32 master
weights and two fp32 moments). --precision: fp16 (the paper's) and bf16 are both 2 + 2 + 12
(fp16's loss scale is one number, not a per-parameter state); fp32 keeps 4-byte parameters and
gradients and no master copy: 4 + 4 + 8. Activations, buffers and fragmentation come on top.
GB = 10^9 bytes, as in the paper; GiB = 2^30.
"""
import argparse
import math
import re
from decimal import ROUND_HALF_UP, Decimal
from fractions import Fraction

from scripts.runs import Parser, at_least

STAGES = {0: "DP", 1: "ZeRO-1 (P_os)", 2: "ZeRO-2 (P_os+g)", 3: "ZeRO-3 (P_os+g+p)"}
# bytes per parameter: (parameters, gradients, K = optimizer state), as lessonkit/theory.STATE_BYTES
PRECISIONS = {"fp16": (2, 2, 12), "bf16": (2, 2, 12), "fp32": (4, 4, 8)}
_COUNT = {"": 1, "K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}
_BYTES = {"": 1, "B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12,
          "KIB": 2 ** 10, "MIB": 2 ** 20, "GIB": 2 ** 30, "TIB": 2 ** 40}


# ----------------------------------------------------------------------------- the formulas
# The ZeRO paper's Table 1 and Table 2 (theory.py holds the ones the runs are held to): model
# states per device, mixed precision, 2 bytes of parameters + 2 of gradients + K of optimizer state
# (precision: PRECISIONS' bytes instead; k, when given, replaces the precision's K).
def model_state_bytes(stage, psi, world, k=None, precision="fp16"):
    """Bytes per device at ZeRO `stage` (0 = plain DP, 1 = P_os, 2 = P_os+g, 3 = P_os+g+p), with
    P, G, K bytes of parameters, gradients, optimizer state (fp16, bf16: 2, 2, 12):
    (P + G + K) Psi, (P + G) Psi + K Psi / N, P Psi + (G + K) Psi / N, (P + G + K) Psi / N."""
    return float(psi * _bytes_per_param(stage, world, k, precision))


def largest_model(memory_bytes, world, stage, k=None, precision="fp16"):
    """The most parameters whose model states fit in `memory_bytes` per device at `stage` on
    `world` devices (Table 2's "max theoretical model size"); exact, in rational arithmetic."""
    return int(Fraction(memory_bytes) / _bytes_per_param(stage, world, k, precision))


def _bytes_per_param(stage, world, k, precision="fp16"):
    if stage not in (0, 1, 2, 3) or world < 1:
        raise ValueError(f"stage must be 0-3 and world at least 1, got stage {stage}, world {world}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    p, g, default_k = PRECISIONS[precision]
    n, k = Fraction(world), Fraction(default_k if k is None else k)
    return {0: p + g + k, 1: p + g + k / n, 2: p + (g + k) / n, 3: (p + g + k) / n}[stage]


# ----------------------------------------------------------------------------- the command line
def parse_count(text):
    """'7.5B', '7.5e9', '1T', '350M' -> a number of parameters."""
    m = re.fullmatch(r"\s*([0-9.]+(?:e[+-]?[0-9]+)?)\s*([KMBGT]?)\s*", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"not a parameter count: {text!r} (e.g. 7.5B, 7.5e9, 1T)")
    return float(m.group(1)) * _COUNT[m.group(2).upper()]


def parse_bytes(text):
    """'32GB' (10^9), '80GiB' (2^30), '1.5e10' -> bytes."""
    m = re.fullmatch(r"\s*([0-9.]+(?:e[+-]?[0-9]+)?)\s*([KMGT]?I?B)?\s*", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"not a memory size: {text!r} (e.g. 32GB, 80GiB)")
    return float(m.group(1)) * _BYTES[(m.group(2) or "").upper()]


def gb(x):
    """As Table 1 prints its 7.5B column: three significant digits, at most two decimals, half
    up (120, 41.3, 1.88, 0.47). (Its 128B and 1T columns cut the decimals off: 513 for 513.5.)"""
    if x <= 0:
        return "0"
    decimals = max(0, 2 - math.floor(math.log10(x)))
    decimals = min(decimals, 2) if x >= 0.1 else decimals
    q = Decimal(x).quantize(Decimal(10) ** -decimals, rounding=ROUND_HALF_UP)
    return f"{q.normalize() if decimals else q:,f}"


def count(psi):
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if psi >= scale:
            return f"{psi / scale:.3g}{unit}"
    return f"{psi:.0f}"


def bytes_line(k, precision):
    p, g, default_k = PRECISIONS[precision]
    k = default_k if k is None else k
    return f"{precision}: {p} + {g} + K bytes per parameter, K = {k:g} of optimizer state"


def per_device_table(psi, worlds, k=None, unit=1e9, unit_name="GB", precision="fp16"):
    lines = [f"Psi = {count(psi)} parameters, {bytes_line(k, precision)}; model states per device, {unit_name}",
             f"{'devices':>8} " + " ".join(f"{STAGES[s]:>18}" for s in STAGES)]
    for n in worlds:
        lines.append(f"{n:>8} " + " ".join(f"{gb(model_state_bytes(s, psi, n, k, precision) / unit):>18}"
                                           for s in STAGES))
    return "\n".join(lines)


def fit_table(memory, worlds, stages, k=None, precision="fp16"):
    lines = [f"largest model whose model states fit in {memory / 1e9:g} GB per device "
             f"({memory / 2 ** 30:.3g} GiB), {bytes_line(k, precision)}",
             f"{'devices':>8} " + " ".join(f"{STAGES[s]:>18}" for s in stages)]
    for n in worlds:
        lines.append(f"{n:>8} " + " ".join(f"{count(largest_model(memory, n, s, k, precision)):>18}" for s in stages))
    return "\n".join(lines)


def main(argv=None):
    p = Parser("zero_calc", description=__doc__)
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--params", type=parse_count, help="parameters, Psi: 7.5B, 7.5e9, 1T")
    what.add_argument("--fit", type=parse_bytes, metavar="MEMORY", help="memory per device: 32GB, 80GiB")
    what.add_argument("--table1", action="store_true", help="the ZeRO paper's Table 1, recomputed")
    p.add_argument("--world", type=int, nargs="+", default=[64], help="devices (data-parallel degree)")
    p.add_argument("--stage", type=int, choices=sorted(STAGES), help="only this stage (with --fit)")
    p.add_argument("--k", type=at_least(0, float), help="bytes of optimizer state per parameter (default: the precision's, "
                                          "12 in fp16 and bf16, 8 in fp32)")
    p.add_argument("--precision", choices=sorted(PRECISIONS), default="fp16",
                   help="fp16 (the paper's) and bf16: 2 + 2 + 12 bytes per parameter; fp32: 4 + 4 + 8")
    p.add_argument("--gib", action="store_true", help="print GiB (2^30) instead of the paper's GB (10^9)")
    a = p.parse_args(argv)
    if any(n < 1 for n in a.world):
        p.error("--world must be at least 1")
    unit, unit_name = (2 ** 30, "GiB") if a.gib else (1e9, "GB")
    if a.table1:
        for psi in (7.5e9, 128e9, 1e12):
            print(per_device_table(psi, [1, 4, 16, 64, 256, 1024], a.k, unit, unit_name, a.precision) + "\n")
        print("The paper prints the 7.5B column rounded like this, but cuts the decimals off in the\n"
              "128B and 1T columns: 513 for 513.5, 4187 for 4187.5 (tests/test_calculator.py).")
    elif a.params is not None:
        print(per_device_table(a.params, a.world, a.k, unit, unit_name, a.precision))
    else:
        print(fit_table(a.fit, a.world, [a.stage] if a.stage is not None else sorted(STAGES), a.k, a.precision))


if __name__ == "__main__":
    main()
