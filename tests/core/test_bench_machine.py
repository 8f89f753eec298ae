"""The machine record every benchmark result carries: the CPU's family and model.

Oracle: ``/proc/cpuinfo`` read here with a regular expression, and hand-written cpuinfo
files.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

BENCH_DIR = str(Path(__file__).resolve().parents[2] / "benchmarks")
sys.path.insert(0, BENCH_DIR)
try:
    from machine import _first_cpu_fields, machine_info
finally:
    sys.path.remove(BENCH_DIR)

TWO_CPUS = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 17
model name\t: AMD EPYC 9R14

processor\t: 1
vendor_id\t: AuthenticAMD
cpu family\t: 26
model\t\t: 2
model name\t: another
"""


def test_the_first_processor_fields_are_read(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(TWO_CPUS)
    fields = _first_cpu_fields(str(cpuinfo))
    assert fields["cpu family"] == "25" and fields["model"] == "17"
    assert fields["model name"] == "AMD EPYC 9R14"


def test_a_missing_cpuinfo_gives_no_fields(tmp_path: Path) -> None:
    assert _first_cpu_fields(str(tmp_path / "absent")) == {}


@pytest.mark.skipif(not Path("/proc/cpuinfo").exists(), reason="no /proc/cpuinfo here")
def test_machine_info_records_this_cpus_family_and_model() -> None:
    text = Path("/proc/cpuinfo").read_text(encoding="ascii", errors="replace")
    info = machine_info()
    family = re.search(r"^cpu family\s*:\s*(\d+)$", text, re.M)
    model = re.search(r"^model\s*:\s*(\d+)$", text, re.M)
    if family is None:  # not an x86 cpuinfo: nothing to record
        assert "cpu_family" not in info
        return
    assert info["cpu_family"] == int(family.group(1))
    assert model is not None and info["cpu_model"] == int(model.group(1))
