"""What the tool ledger is to the capture layer: the protocol a store implements (the PostgreSQL
one is :class:`otel_agentcap.exporters.postgres.ledger.PostgresToolLedger`), the codecs that carry
a result across processes, and how a recorded error is written down and rebuilt.

A tool invocation is identified by (run, agent, invocation id) *and* by its tool and input: the
ledger keeps one row per such identity, with a digest of the tool name and the canonical input
(:func:`call_digest`). Needs only the standard library and :mod:`otel_agentcap.jsonsafe`.
"""

from __future__ import annotations

import base64
import hashlib
import pickle
import sys
from typing import Any, Final

from otel_agentcap import jsonsafe
from otel_agentcap.errors import RecordedToolError

# Defined in otel_agentcap.protocols, with the package's other interfaces.
from otel_agentcap.protocols import CRASH_POLICIES as CRASH_POLICIES
from otel_agentcap.protocols import DEFAULT_CRASH_POLICY as DEFAULT_CRASH_POLICY
from otel_agentcap.protocols import ClaimState as ClaimState
from otel_agentcap.protocols import Codec as Codec
from otel_agentcap.protocols import CrashPolicy as CrashPolicy
from otel_agentcap.protocols import LedgerCall as LedgerCall
from otel_agentcap.protocols import LedgerClaim as LedgerClaim
from otel_agentcap.protocols import ToolLedger as ToolLedger


def call_digest(tool: str, canonical_input: str) -> str:
    """The identity of a call within its invocation id: SHA-256 (hex) of the tool name and the
    canonical JSON of its input (keys sorted, as ``jsonsafe.dumps(..., sort_keys=True)``)."""
    return hashlib.sha256(f"{tool}\x1f{canonical_input}".encode()).hexdigest()


_ledger: ToolLedger | None = None


def set_tool_ledger(ledger: ToolLedger | None) -> None:
    """Install the ledger that protects ``Tool.invoke`` calls (``configure()`` installs the
    PostgreSQL one); None returns to in-process exactly-once only."""
    global _ledger
    _ledger = ledger


def tool_ledger() -> ToolLedger | None:
    """The installed ledger, or None."""
    return _ledger


class JsonCodec:
    """The default: the event log's payload encoding (:mod:`otel_agentcap.jsonsafe`), read back with
    :func:`~otel_agentcap.jsonsafe.from_jsonable`. JSON types come back as they were; bytes, NaN
    and infinities, strings with NUL or lone surrogates, huge ints and dicts with keys JSON cannot
    hold come back exactly; tuples and sets come back as lists, dataclasses and pydantic models
    as dicts, dates and UUIDs as strings, enums as their values, and any other object as its
    ``{"$agentcap.repr": ..., "type": ...}`` marker."""

    name = "json"

    def encode(self, value: Any) -> Any:
        return jsonsafe.to_jsonable(value)

    def decode(self, data: Any) -> Any:
        return jsonsafe.from_jsonable(data)


class PickleCodec:
    """Results as pickles (base64 in a ``{"$agentcap.pickle": ...}`` object): any picklable value
    comes back as an equal object of its own type. Only for a database you trust: unpickling runs
    code that the stored bytes name."""

    name = "pickle"

    def encode(self, value: Any) -> Any:
        return {"$agentcap.pickle": base64.b64encode(pickle.dumps(value)).decode("ascii")}

    def decode(self, data: Any) -> Any:
        return pickle.loads(base64.b64decode(data["$agentcap.pickle"]))


JSON_CODEC: Final = JsonCodec()
_CODECS: dict[str, Codec] = {"json": JSON_CODEC, "pickle": PickleCodec()}


def register_codec(codec: Codec) -> None:
    """Make ``codec`` known by its name, so a process that replays a result it encoded can decode
    it (a tool's codec is registered when the tool is created)."""
    _CODECS.setdefault(codec.name, codec)


def codec_named(name: str | None) -> Codec | None:
    return _CODECS.get(name or "json")


# ----------------------------------------------------------------- errors


def encode_error(error: BaseException) -> dict[str, Any]:
    """A recorded error as the ledger keeps it: type (module and qualified name), message, and
    ``args`` and instance attributes, all in the payload encoding (a message with NUL or a lone
    surrogate, which jsonb cannot hold as text, becomes a ``$agentcap.str`` marker)."""
    cls = type(error)
    try:
        message = str(error)
    except Exception:
        message = f"<{cls.__name__}>"
    state = getattr(error, "__dict__", None)
    return {
        "module": jsonsafe.to_jsonable(cls.__module__),
        "qualname": jsonsafe.to_jsonable(cls.__qualname__),
        "message": jsonsafe.to_jsonable(message),
        "args": jsonsafe.to_jsonable(list(error.args)),
        "state": jsonsafe.to_jsonable(dict(state)) if state else {},
    }


def rebuild_error(record: Any, invocation_id: str, tool: str) -> BaseException:
    """The error ``record`` (from :func:`encode_error`) stands for, as its own type when that type
    is importable here (its module already imported) and can be rebuilt so that it reads the same;
    else a :class:`~otel_agentcap.errors.RecordedToolError` carrying the type name and message."""
    if not isinstance(record, dict):
        return RecordedToolError("<unknown>", repr(record), invocation_id, tool)
    module = _text(record.get("module"))
    qualname = _text(record.get("qualname"))
    message = _text(record.get("message"))
    type_name = qualname if module == "builtins" else f"{module}.{qualname}"
    rebuilt = _rebuild(module, qualname, record)
    if rebuilt is not None:
        try:
            if str(rebuilt) == message:
                return rebuilt
        except Exception:
            pass
    return RecordedToolError(type_name, message, invocation_id, tool)


def _text(field: Any) -> str:
    """A text field of an error record (plain, or a ``$agentcap.str`` marker)."""
    value = jsonsafe.from_jsonable(field) if field is not None else ""
    return value if isinstance(value, str) else str(value)


def _rebuild(module: str, qualname: str, record: dict[str, Any]) -> BaseException | None:
    owner: Any = sys.modules.get(module)  # never imports: the database names the type
    for part in qualname.split("."):
        owner = getattr(owner, part, None) if owner is not None else None
    if not isinstance(owner, type) or not issubclass(owner, BaseException):
        return None
    args = jsonsafe.from_jsonable(record.get("args") or [])
    if not isinstance(args, list):
        return None
    try:
        error = owner.__new__(owner, *args)
        error.args = tuple(args)
        state = jsonsafe.from_jsonable(record.get("state") or {})
        if isinstance(state, dict) and state:
            error.__dict__.update(state)
    except Exception:
        return None
    return error
