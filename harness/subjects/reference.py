"""The reference subject: the executable specification, against which every suite must pass."""

from __future__ import annotations

from harness.conventions import decode_payload
from harness.subjects import Subject
from reference_impl import layouts, splice

REFERENCE = Subject(
    name="reference",
    decode_payload=decode_payload,
    splice=splice.splice,
    truncate=splice.truncate,
    layouts=layouts,
)
