"""Limits print with the precision they were given: a ``--max-job-memory 0.25`` or a
``memory_gib: 0.25`` is "0.25 GiB" in every message, not "0.2 GiB".

Oracle: the text the operator typed, turned into bytes the way the server reads it.
"""

from __future__ import annotations

import pytest

from dmuon_server.config import format_gib
from dmuon_server.users import Limits


@pytest.mark.parametrize("given", ["0.25", "0.1", "0.3", "1.5", "2", "12.75", "0.125", "96"])
def test_a_limit_reads_back_as_it_was_given(given: str) -> None:
    as_flag = int(float(given) * (1 << 30))  # settings_from_flags
    as_users_file = Limits(memory_gib=float(given)).job_memory(1 << 50)[0]
    assert format_gib(as_flag) == format_gib(as_users_file) == f"{given} GiB"


def test_a_computed_size_has_two_decimals() -> None:
    assert format_gib(12_345_678_901) == f"{12_345_678_901 / 2**30:.2f} GiB" == "11.50 GiB"
