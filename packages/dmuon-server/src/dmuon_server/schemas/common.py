"""What every model of the API shares: non-finite numbers as strings, names, strict models.

Non-finite numbers: JSON has no NaN or infinity, so every non-finite float the recipe
reports (for example a diverged ``loss``) is sent as one of the strings ``"NaN"``,
``"Infinity"`` or ``"-Infinity"`` -- the convention of the protobuf JSON mapping. Finite
numbers stay numbers. :func:`encode_nonfinite` does the conversion.
"""

from __future__ import annotations

import math
import re
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
)

NonFinite = Literal["NaN", "Infinity", "-Infinity"]
#: A float that may be non-finite, encoded as in the module docstring.
EncodedFloat = float | NonFinite


def encode_nonfinite(value: Any) -> Any:
    """Return ``value`` with every non-finite float replaced by ``"NaN"``/``"Infinity"``/...

    Works on nested dicts and lists; other values are returned unchanged.
    """
    if isinstance(value, float) and not math.isfinite(value):
        if math.isnan(value):
            return "NaN"
        return "Infinity" if value > 0 else "-Infinity"
    if isinstance(value, dict):
        return {str(k): encode_nonfinite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [encode_nonfinite(v) for v in value]
    return value


#: Text shown to people (job names): no C0 or C1 control characters, no bidirectional
#: controls (U+061C, U+200E, U+200F, U+202A-U+202E, U+2066-U+2069), no zero-width
#: characters (U+200B-U+200D, U+2060, U+FEFF) and no line or paragraph separators
#: (U+2028, U+2029), which would let one name pass for another in a list.
NAME_PATTERN = r"^[^\x00-\x1f\x7f-\x9f\u061c\u200b-\u200f\u2028-\u202e\u2060-\u2069\ufeff]+$"

_UNSAFE = re.compile(r"[\x00-\x1f\x7f-\x9f\u061c\u200b-\u200f\u2028-\u202e\u2060-\u2069\ufeff]")


def escape_unsafe(text: str) -> str:
    """``text`` with each character `NAME_PATTERN` refuses written as ``\\uXXXX``
    (``\\u202e`` for a right-to-left override): what is shown of a name a job chose."""
    return _UNSAFE.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


class StrictModel(BaseModel):
    """Base for request bodies: unknown fields and type coercion are refused."""

    model_config = ConfigDict(extra="forbid", strict=True)
