"""The changefeed wire protocol and feed-table SQL.

JSON Schema files (``json/``), typed models with encode/decode/validate
(``models``), opaque cursors (``cursor``), close codes (``closecodes``) and the
versioned feed-table migrations (``sql/``, ``migrations``). Pure code except
``migrations``, which talks to PostgreSQL.
"""

from .access import (
    BOOTSTRAP_ROUTE_STATE,
    PRIVATE_HEADERS,
    AccessDenied,
    AccessGranted,
    allows,
    decide,
)
from .closecodes import ERROR_CLOSE_CODES, CloseCode
from .cursor import ORIGIN, Cursor, CursorCodec, ForeignCursor, Position, stamp_of
from .errors import CursorError, ProtocolError
from .migrations import (
    PgConnection,
    apply_schema,
    notify_channel,
    outdated,
    quote_schema,
    schema_version,
)
from .models import (
    RESUME_REASONS,
    Ack,
    ChangeItem,
    ChangeKind,
    ErrorFrame,
    Page,
    Registration,
    ResourceRoute,
    decode_change_frame,
    dumps,
)
from .validation import load_schema, validate

__all__ = [
    "BOOTSTRAP_ROUTE_STATE",
    "ERROR_CLOSE_CODES",
    "ORIGIN",
    "PRIVATE_HEADERS",
    "RESUME_REASONS",
    "AccessDenied",
    "AccessGranted",
    "Ack",
    "ChangeItem",
    "ChangeKind",
    "CloseCode",
    "Cursor",
    "CursorCodec",
    "CursorError",
    "ErrorFrame",
    "ForeignCursor",
    "Page",
    "PgConnection",
    "Position",
    "ProtocolError",
    "Registration",
    "ResourceRoute",
    "allows",
    "apply_schema",
    "decide",
    "decode_change_frame",
    "dumps",
    "load_schema",
    "notify_channel",
    "outdated",
    "quote_schema",
    "schema_version",
    "stamp_of",
    "validate",
]
