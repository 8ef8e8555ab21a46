"""mptrain.formats: the table agrees with torch.finfo, with the known layout of
each format, and with what a real cast does at the bottom of the range."""
from __future__ import annotations

import math
import re

import pytest
import torch

from mptrain import formats as formats_cli
from mptrain.precision import formats
from mptrain.precision.elements import all_formats, element
from mptrain.precision.recipe import NAMED, NAMED_WHY, ROLES

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
    assert formats_cli.main(["--torch"]) == 0
    stdout = capsys.readouterr().out
    lines = stdout.splitlines()
    for name in LAYOUT:
        assert sum(line.split()[0] == name for line in lines if line.strip()) == 1, stdout
    assert "65504" in stdout and "448" in stdout and "2^-9" in stdout


def _table_rows(text: str, first: str) -> dict[str, list[str]]:
    """The rows of the table whose header starts with ``first``, by their first cell;
    cells are parted by two or more spaces (a number and its ``(2^k)`` by one)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:1] == [first])
    rows = {}
    for line in lines[start + 2:]:
        if not line.strip():
            break
        cells = re.split(r"\s{2,}", line.strip())
        rows[cells[0]] = cells
    return rows


def test_cli_lists_every_lab_element_with_its_figures(capsys):
    """``--lab``: one row per element format the lab takes (and e4m3ieee), the figures
    of elements.py and the library type named where tests/test_lab.py compares one."""
    assert formats_cli.main(["--lab"]) == 0
    out = capsys.readouterr().out
    assert "float8_e4m3fn  " not in out.split("element")[0]  # the torch table is not printed
    rows = _table_rows(out, "element")
    names = [e.name for e in all_formats()] + ["e4m3ieee"]
    assert sorted(rows) == sorted(names)
    for name in names:
        el, cells = element(name), rows[name]
        assert len(cells) == 10, cells
        assert cells[1:3] == [el.convention, str(el.bits)]
        assert float(cells[5].split()[0]) == pytest.approx(el.max, rel=1e-5)
        assert float(cells[7].split()[0]) == pytest.approx(el.min_subnormal, rel=1e-3)
        assert cells[9] == formats.LIBRARY_TYPES.get(name, "-")
    assert rows["e4m3"][5] == "448" and rows["e2m1"][5] == "6" and rows["int8"][3:5] == ["-", "-"]
    # 256 codes less e4m3's two NaNs, the two zeros once: 253; E2M1's 16 codes: 15; symmetric int8: 255
    assert [rows[n][8] for n in ("e4m3", "e2m1", "int8", "e5m2")] == ["253", "15", "255", "247"]


def test_cli_recipes_and_default_and_bad_flag(capsys):
    assert formats_cli.main(["--recipes"]) == 0
    out = capsys.readouterr().out
    for name, specs in NAMED.items():
        block = out.split(f"\n{name}: ", 1)[1].splitlines()
        assert block[0] == NAMED_WHY[name]
        assert [line.split() for line in block[1:7]] == [[r, specs[r]] for r in ROLES]
    assert formats_cli.main([]) == 0  # no flag: both format tables, no recipes
    out = capsys.readouterr().out
    assert "float8_e4m3fn" in out and "e3m4" in out and "\ntensorwise: " not in out
    assert formats_cli.main(["--lab", "--bogus"]) == 2
    assert "unknown argument --bogus" in capsys.readouterr().err
    assert formats_cli.main(["--help"]) == 0
    usage = capsys.readouterr().out
    assert all(flag in usage for flag in formats_cli.FLAGS)
