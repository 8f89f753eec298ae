"""Bad ``unix_user`` entries of the users file: refused with a message saying what to do."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dmuon_server.config import Settings
from dmuon_server.launching.identity import JobIdentities
from dmuon_server.users import Users, UsersFileError


def _users(path: Path, unix_user: object) -> Path:
    entry = {"name": "ada", "token_sha256": "0" * 64, "unix_user": unix_user}
    path.write_text(json.dumps({"users": [entry]}))
    path.chmod(0o600)
    return path


@pytest.mark.parametrize(
    ("unix_user", "message"),
    [
        ("root", "'root' is root; jobs must run as an unprivileged account"),
        ("no-such-account-here", "there is no Unix account 'no-such-account-here'"),
    ],
)
def test_an_account_jobs_cannot_run_as_stops_the_server(
    tmp_path: Path, unix_user: str, message: str
) -> None:
    users = Users(_users(tmp_path / "users.json", unix_user))
    identities = JobIdentities(Settings(data_dir=tmp_path / "data"), users)
    problem = identities.startup_problem()
    assert problem is not None and message in problem and "unix_user" in problem


@pytest.mark.parametrize("unix_user", ["Bad Name", 5, "", "a/b"])
def test_a_unix_user_that_is_no_account_name_is_refused(tmp_path: Path, unix_user: object) -> None:
    with pytest.raises(UsersFileError, match="is not a Unix account name"):
        Users(_users(tmp_path / "users.json", unix_user))
