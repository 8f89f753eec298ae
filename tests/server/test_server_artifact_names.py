"""Every artifact a job's listing names can be downloaded by that name: a file whose path
holds a control character (a newline cannot come back in a URL's path) is neither listed
nor served nor put in an archive, and names that do round-trip are served as listed.

Oracles: the listing itself (each `path` it gives, URL-quoted, must download the file's
bytes) and the files written, through the in-process app's HTTP client.
"""

from __future__ import annotations

import io
import tarfile
from urllib.parse import quote

from fastapi.testclient import TestClient
from server_helpers import finished_job, job_spec

#: Files a job writes in its checkpoint folder, by name: the control-character ones must
#: not be listed; the others (spaces, unicode, percent, hash, question mark) must be.
ODD = ["a\nb.bin", "tab\there.bin", "bell\x07.bin", "del\x7f.bin"]
FINE = ["with space.bin", "名字.bin", "100%.bin", "hash#.bin", "what?.bin", "plain.bin"]


def test_only_names_that_round_trip_are_listed_and_each_downloads(
    fake_client: TestClient, data_dir: object
) -> None:
    c = fake_client
    job = finished_job(c, c.post("/v1/jobs", json=job_spec(1)).json()["id"])
    folder = c.app.state.settings.job_dir(job["id"]) / "checkpoints" / "step_00000001"
    folder.mkdir(parents=True)
    for i, name in enumerate(ODD + FINE):
        (folder / name).write_bytes(f"{i}:{name}".encode())
    listed = c.get(f"/v1/jobs/{job['id']}/artifacts", params={"under": "checkpoints"}).json()
    names = sorted(a["path"].rsplit("/", 1)[-1] for a in listed["items"])
    assert names == sorted(FINE)
    for item in listed["items"]:
        r = c.get(f"/v1/jobs/{job['id']}/artifacts/{quote(item['path'])}")
        assert r.status_code == 200, (item["path"], r.text)
        name = item["path"].rsplit("/", 1)[-1]
        assert r.content == f"{(ODD + FINE).index(name)}:{name}".encode()
    for name in ODD:
        path = quote(f"checkpoints/step_00000001/{name}")
        assert c.get(f"/v1/jobs/{job['id']}/artifacts/{path}").status_code == 404
    archive = c.get(f"/v1/jobs/{job['id']}/archive/checkpoints/step_00000001")
    assert archive.status_code == 200
    with tarfile.open(fileobj=io.BytesIO(archive.content)) as tar:
        members = sorted(m.name.rsplit("/", 1)[-1] for m in tar.getmembers() if m.isfile())
    assert members == sorted(FINE)
