"""What an Idempotency-Key binds: a fingerprint of the job spec that survives upgrades.

The fingerprint leaves out every field at its default value, so a spec stored by an older
server (which knew fewer fields) and the same body posted to a newer one (whose model adds
fields with defaults) have the same fingerprint.
"""

from __future__ import annotations

import hashlib
import json

from pydantic import ValidationError

from dmuon_server.schemas import JobCreate

#: Marks fingerprints of this kind; older rows hold a hash of the whole spec.
PREFIX = "v2:"


def spec_fingerprint(spec: JobCreate) -> str:
    """The fingerprint of ``spec``: a hash of its fields that differ from their defaults."""
    explicit = spec.model_dump(mode="json", exclude_defaults=True)
    text = json.dumps(explicit, sort_keys=True, separators=(",", ":"))
    return PREFIX + hashlib.sha256(text.encode()).hexdigest()


def stored_spec_fingerprint(spec_json: str) -> str | None:
    """The fingerprint of a spec as the store holds it (JSON); None when this server's
    model no longer accepts it (its key then binds nothing a new body can match)."""
    try:
        return spec_fingerprint(JobCreate.model_validate_json(spec_json))
    except ValidationError:
        return None
