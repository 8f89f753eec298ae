"""Property-based fuzzing of every operation in the OpenAPI schema (schemathesis).

The app runs for real (supervisor thread on, jobs through torchrun with ``fake_train``,
capped at 3 steps); no generated request may produce a 5xx, and every response must
match the schema (status code, content type, headers, body); invalid data must be refused.

One check is left out: ``positive_data_acceptance`` (a schema-valid body must be accepted).
``train.data`` must name an existing path inside the data roots, which the schema cannot
express, so a random string is rightly refused with 422 (tested in test_server_rest.py).
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import positive_data_acceptance
from server_helpers import SERVER_TESTS, kill_job_processes, make_settings, wait_until

from dmuon_server.app import create_app

_TMP = Path(tempfile.mkdtemp(prefix="dmuon-server-fuzz-"))
atexit.register(shutil.rmtree, _TMP, ignore_errors=True)
APP = create_app(make_settings(_TMP, max_concurrent_jobs=1))
schema = schemathesis.openapi.from_asgi("/openapi.json", APP)


@pytest.fixture(scope="module", autouse=True)
def _supervised() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp:
        pp = os.environ.get("PYTHONPATH")
        mp.setenv("PYTHONPATH", str(SERVER_TESTS) + (os.pathsep + pp if pp else ""))
        mp.setenv("FAKE_MAX_STEPS", "3")
        mp.setenv("FAKE_STEP_SECONDS", "0.01")
        # Schemathesis runs the app's lifespan (and with it the supervisor) during the
        # test and ends it when the test ends; restart the supervisor to clean up.
        sup = APP.state.supervisor
        try:
            yield
        finally:
            sup.start()
            for job in APP.state.store.jobs_in_states(["queued", "starting", "running"]):
                sup.cancel(job.id)
            wait_until(
                lambda: not APP.state.store.jobs_in_states(["starting", "running"]),
                60,
                "the fuzzed jobs to end",
            )
            sup.stop()
            kill_job_processes(_TMP / "data")


@schema.parametrize()
@settings(
    max_examples=60,
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
)
def test_no_server_errors(case: schemathesis.Case) -> None:
    case.call_and_validate(excluded_checks=[positive_data_acceptance])
