"""Why a record could not become an evaluation record.

`reason` is a short, bounded token (it becomes the `reason` label of `tracejudge_dead_letters_total`
and a dead-letter header); `detail` is the human message naming the field and position. Parsers
raise `RecordError`; nothing else about a bad record may escape as a bare exception.
"""

from __future__ import annotations

from typing import Final

# The closed set of reasons. Adding one is fine; never put free text in `reason`.
INVALID_JSON: Final = "invalid_json"
INVALID_PROTOBUF: Final = "invalid_protobuf"
UNKNOWN_FORMAT: Final = "unknown_format"
INVALID_RECORD: Final = "invalid_record"
TOO_LARGE: Final = "too_large"
NOT_UTF8: Final = "not_utf8"

REASONS: Final = frozenset({INVALID_JSON, INVALID_PROTOBUF, UNKNOWN_FORMAT, INVALID_RECORD, TOO_LARGE,
                            NOT_UTF8})


class RecordError(ValueError):
    """A record that cannot be decoded or normalised.

    `field` is a dotted path into the record ("data.spans[2].start_time_unix_nano") when one field is
    to blame; `detail` says what was wrong with it.
    """

    def __init__(self, reason: str, detail: str, field: str | None = None):
        if reason not in REASONS:
            raise ValueError(f"unknown RecordError reason {reason!r}")
        self.reason = reason
        self.detail = detail
        self.field = field
        super().__init__(self.message)

    @property
    def message(self) -> str:
        return f"{self.field}: {self.detail}" if self.field else self.detail
