"""mptrain.formats: the table agrees with torch.finfo, with the known layout of
each format, and with what a real cast does at the bottom of the range."""
from __future__ import annotations

import math

import pytest
import torch

from mptrain import formats as formats_cli
from mptrain.precision import formats

# Independent facts about each format (IEEE 754 / OCP FP8 specs), to check the derivation against.
LAYOUT = {  # name: (dtype, bits, exponent bits, mantissa bits, smallest normal, smallest subnormal)
    "fp32": (torch.float32, 32, 8, 23, 2.0 ** -126, 2.0 ** -149),
    "bf16": (torch.bfloat16, 16, 8, 7, 2.0 ** -126, 2.0 ** -133),
    "fp16": (torch.float16, 16, 5, 10, 2.0 ** -14, 2.0 ** -24),
    "e4m3": (torch.float8_e4m3fn, 8, 4, 3, 2.0 ** -6, 2.0 ** -9),
    "e5m2": (torch.float8_e5m2, 8, 5, 2, 2.0 ** -14, 2.0 ** -16),
}
MAX = {"fp16": 65504.0, "e4m3": 448.0, "e5m2": 57344.0, "bf16": (2 - 2 ** -7) * 2.0 ** 127,
       "fp32": (2 - 2 ** -23) * 2.0 ** 127}


def test_formats_dict_and_table_order():
    assert formats.FORMATS == {n: v[0] for n, v in LAYOUT.items()}
    assert [f.name for f in formats.table()] == list(LAYOUT)
    assert formats.info("bf16") is formats.info("bf16")  # cached
    with pytest.raises(KeyError, match="valid formats"):
        formats.info("fp64")


@pytest.mark.parametrize("name", list(LAYOUT))
def test_info_matches_finfo_and_layout(name):
    f = formats.info(name)
    dtype, bits, ebits, mbits, normal, subnormal = LAYOUT[name]
    fi = torch.finfo(dtype)
    assert f.dtype == dtype
    assert (f.bits, f.exponent_bits, f.mantissa_bits) == (bits, ebits, mbits)
    assert f.bits == fi.bits == 1 + f.exponent_bits + f.mantissa_bits
    assert f.max == fi.max == MAX[name]
    assert f.smallest_normal == fi.smallest_normal == normal
    assert f.eps == fi.eps == 2.0 ** -mbits
    assert f.smallest_subnormal == subnormal
    assert f.dynamic_range_binades == pytest.approx(math.log2(MAX[name] / subnormal))


def test_fp8_dynamic_range():
    # e4m3: 448 / 2^-9 -> 17.8 binades; e5m2: 57344 / 2^-16 -> 31.8 binades.
    assert formats.info("e4m3").dynamic_range_binades == pytest.approx(math.log2(448) + 9)
    assert formats.info("e5m2").dynamic_range_binades == pytest.approx(math.log2(57344) + 16)


@pytest.mark.parametrize("name", list(LAYOUT))
def test_bottom_and_top_of_range_survive_a_real_cast(name):
    f = formats.info(name)
    keep = torch.tensor([f.smallest_subnormal, f.smallest_normal, f.max, -f.smallest_subnormal], dtype=torch.float64)
    assert torch.equal(keep.to(f.dtype).double(), keep)
    # Half the smallest subnormal is a tie between 0 and it: round to even flushes it to 0;
    # anything above the tie rounds up to the smallest subnormal.
    half = torch.tensor([f.smallest_subnormal / 2], dtype=torch.float64)
    assert half.to(f.dtype).double().item() == 0.0
    above = torch.tensor([f.smallest_subnormal * 0.75], dtype=torch.float64)
    assert above.to(f.dtype).double().item() == f.smallest_subnormal
    # Just below the smallest normal is a subnormal: the largest one, normal - subnormal.
    below = torch.tensor([f.smallest_normal - f.smallest_subnormal], dtype=torch.float64)
    assert below.to(f.dtype).double().item() == f.smallest_normal - f.smallest_subnormal
    assert below.to(f.dtype).double().item() < f.smallest_normal


def test_ulp_of_max():
    assert formats.info("fp16").ulp_of_max == 32.0
    assert formats.info("e4m3").ulp_of_max == 32.0
    assert formats.info("e5m2").ulp_of_max == 8192.0
    assert formats.info("bf16").ulp_of_max == 2.0 ** 120


def test_cli_prints_all_five(capsys):
    # What ``python -m mptrain.formats`` prints is main()'s output; the launch itself is
    # run by tests/test_monitor.py::test_formats_cli, so here it is called in-process.
    assert formats_cli.main([]) == 0
    stdout = capsys.readouterr().out
    lines = stdout.splitlines()
    for name in LAYOUT:
        assert sum(line.split()[0] == name for line in lines if line.strip()) == 1, stdout
    assert "65504" in stdout and "448" in stdout and "2^-9" in stdout
