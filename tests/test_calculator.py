"""The model-state calculator (zero_calc.model_state_bytes, zero_calc.largest_model and the command
line scripts/learn/zero_calc.py) against the ZeRO paper's own tables, to their printed digits.

Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models",
arXiv:1910.02054. Table 1: per-device memory of model states, K = 12, GB = 10^9 bytes.
"""
import subprocess
import sys
from decimal import ROUND_DOWN, ROUND_HALF_UP, Decimal
from fractions import Fraction

import pytest

from lessonkit import theory
from harness import ROOT
from scripts.learn import zero_calc

# Table 1 as printed: {model: {DP degree: (P_os, P_os+g, P_os+g+p)}}; DP itself is 16 Psi bytes
# in every row (120, 2048, 16000), the same as every stage at N = 1.
TABLE1 = {
    7.5e9: {1: ("120", "120", "120"), 4: ("52.5", "41.3", "30"), 16: ("35.6", "21.6", "7.5"),
            64: ("31.4", "16.6", "1.88"), 256: ("30.4", "15.4", "0.47"), 1024: ("30.1", "15.1", "0.12")},
    128e9: {1: ("2048", "2048", "2048"), 4: ("896", "704", "512"), 16: ("608", "368", "128"),
            64: ("536", "284", "32"), 256: ("518", "263", "8"), 1024: ("513", "257", "2")},
    1e12: {1: ("16000", "16000", "16000"), 4: ("7000", "5500", "4000"), 16: ("4750", "2875", "1000"),
           64: ("4187", "2218", "250"), 256: ("4046", "2054", "62.5"), 1024: ("4011", "2013", "15.6")},
}
DP = {7.5e9: "120", 128e9: "2048", 1e12: "16000"}


def as_printed(value, printed, rounding):
    """`value` rounded to as many decimals as `printed` has, the way the paper rounded."""
    decimals = len(printed.split(".")[1]) if "." in printed else 0
    return Decimal(value).quantize(Decimal(10) ** -decimals, rounding=rounding) == Decimal(printed)


@pytest.mark.parametrize("psi", sorted(TABLE1))
def test_table1_every_cell_to_its_printed_digits(psi):
    # The paper rounds its 7.5B column half up (1.875 -> 1.88, 41.25 -> 41.3) but cuts the
    # decimals off in the 128B and 1T columns (513.5 -> 513, 4187.5 -> 4187, 257.75 -> 257):
    # every one of the 54 cells below matches exactly under its column's rule, none needs slack.
    rounding = ROUND_HALF_UP if psi == 7.5e9 else ROUND_DOWN
    for world, printed in TABLE1[psi].items():
        assert as_printed(zero_calc.model_state_bytes(0, psi, world) / 1e9, DP[psi], rounding)
        for stage, cell in zip((1, 2, 3), printed):
            got = zero_calc.model_state_bytes(stage, psi, world) / 1e9
            assert as_printed(got, cell, rounding), (psi, world, stage, got, cell)


def test_the_example_in_the_text():
    # Section 5: 7.5B parameters on 64 devices, 120 GB (DP), 31.4 (P_os), 16.6 (P_os+g), 1.88 (P_os+g+p)
    got = [zero_calc.model_state_bytes(s, 7.5e9, 64) / 1e9 for s in range(4)]
    assert got == [120.0, 31.40625, 16.640625, 1.875]  # exact: 16, 4 + 12/64, 2 + 14/64, 16/64 bytes
    assert [zero_calc.gb(x) for x in got] == ["120", "31.4", "16.6", "1.88"]


def test_table2_largest_model_in_32gb():
    # Table 2, MP = 1, 64 GPUs of 32 GB: "max theoretical model size" 2B, 7.6B, 14.4B, 128B
    # (its rows with model parallelism are these numbers, as printed, times the MP degree)
    got = [zero_calc.largest_model(32e9, 64, s) / 1e9 for s in range(4)]
    assert [round(x, 1) for x in got] == [2.0, 7.6, 14.4, 128.0]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("world", [1, 3, 8, 64, 1000])
@pytest.mark.parametrize("memory", [32e9, 80 * 2 ** 30, 12_345_678_901])
def test_largest_model_is_the_inverse(stage, world, memory):
    psi = zero_calc.largest_model(memory, world, stage)
    # the largest whole number of parameters that fits: one more does not (exact arithmetic,
    # the paper's formulas written out again: 16, 4 + 12/N, 2 + 14/N, 16/N bytes per parameter)
    per_param = [Fraction(16), 4 + Fraction(12, world), 2 + Fraction(14, world), Fraction(16, world)][stage]
    assert psi * per_param <= memory < (psi + 1) * per_param
    assert zero_calc.model_state_bytes(stage, psi, world) <= memory


@pytest.mark.parametrize("precision", ["bf16", "fp16", "fp32"])
def test_stages_agree_with_the_lessons_theory(precision):
    # theory_memory (what every lesson's report holds) is the same formula, stage by stage, in each
    # precision the lessons take
    stage = {"vanilla_dp": 0, "async_allreduce": 0, "buckets": 0, "zero1": 1, "zero2": 2, "zero3": 3}
    for strategy, s in stage.items():
        for world in (1, 2, 4, 8):
            assert theory.theory_memory(strategy, 106_240, world, precision)["total"] == \
                pytest.approx(zero_calc.model_state_bytes(s, 106_240, world, precision=precision), rel=1e-12)


def test_precision_fp16_and_bf16_are_the_papers_fp32_splits_its_16_bytes_otherwise(capsys):
    for stage in range(4):
        paper = zero_calc.model_state_bytes(stage, 1e9, 8)  # (the paper's fp16, the default)
        assert zero_calc.model_state_bytes(stage, 1e9, 8, precision="bf16") == paper
    # fp32: 4 + 4 + 8 (no master copy): 16 bytes under DP and ZeRO-3, more kept whole under ZeRO-1 and 2
    assert [zero_calc.model_state_bytes(s, 1e9, 8, precision="fp32") for s in range(4)] == \
        [16e9, 1e9 * (8 + 8 / 8), 1e9 * (4 + 12 / 8), 16e9 / 8]
    zero_calc.main(["--params", "7.5B", "--world", "64", "--precision", "fp32"])
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("Psi = 7.5B parameters, fp32: 4 + 4 + K bytes per parameter, K = 8")
    assert out[-1].split() == ["64", "120", "60.9", "31.4", "1.88"]
    with pytest.raises(ValueError, match="precision must be one of fp16, bf16, fp32"):
        zero_calc.model_state_bytes(0, 1e9, 8, precision="fp8")


def test_k_is_a_parameter():
    # e.g. K = 16: Adam with fp32 master weights, moments and an fp32 gradient copy
    assert zero_calc.model_state_bytes(1, 1e9, 4, k=16) == 1e9 * (4 + 16 / 4)
    assert zero_calc.model_state_bytes(3, 1e9, 4, k=16) == 1e9 * 20 / 4


def test_command_line(capsys):
    zero_calc.main(["--params", "7.5e9", "--world", "64"])
    row = capsys.readouterr().out.splitlines()[-1].split()
    assert row == ["64", "120", "31.4", "16.6", "1.88"]
    zero_calc.main(["--params", "7.5B", "--world", "64"])  # the same, in words
    assert capsys.readouterr().out.splitlines()[-1].split() == row
    zero_calc.main(["--fit", "32GB", "--world", "64", "--stage", "3"])
    assert capsys.readouterr().out.splitlines()[-1].split() == ["64", "128B"]
    zero_calc.main(["--fit", "32GB", "--world", "64"])
    assert capsys.readouterr().out.splitlines()[-1].split() == ["64", "2B", "7.64B", "14.4B", "128B"]
    zero_calc.main(["--table1"])
    out = capsys.readouterr().out
    assert "0.47" in out and "15.6" in out and "16,000" in out
    for bad in (["--fit", "32 apples"], ["--params", "1e9", "--k", "nan"], ["--params", "1e9", "--k", "-1"]):
        with pytest.raises(SystemExit) as e:
            zero_calc.main(bad)
        assert e.value.code == 2, bad
    assert "argument --k: must be at least 0 (and finite), got nan" in capsys.readouterr().err


def test_command_line_runs_as_a_script():
    out = subprocess.run([sys.executable, "-m", "scripts.learn.zero_calc", "--params", "7.5e9", "--world", "64"],
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.splitlines()[-1].split() == ["64", "120", "31.4", "16.6", "1.88"]
