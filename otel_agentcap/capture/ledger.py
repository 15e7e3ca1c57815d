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
from typing import Any, Final, Literal, NamedTuple, Protocol

from otel_agentcap import jsonsafe
from otel_agentcap.errors import RecordedToolError

CrashPolicy = Literal["at_least_once", "at_most_once"]
#: What happens to an invocation whose claim was held by a process that died (its lease expired):
#: ``at_least_once`` runs the body again (as the next attempt), ``at_most_once`` raises
#: :class:`~otel_agentcap.errors.ToolOutcomeUnknown` naming the invocation, now and on every retry.
DEFAULT_CRASH_POLICY: Final[CrashPolicy] = "at_least_once"
CRASH_POLICIES: Final = frozenset({"at_least_once", "at_most_once"})

ClaimState = Literal["claimed", "running", "succeeded", "failed", "unknown"]


def call_digest(tool: str, canonical_input: str) -> str:
    """The identity of a call within its invocation id: SHA-256 (hex) of the tool name and the
    canonical JSON of its input (keys sorted, as ``jsonsafe.dumps(..., sort_keys=True)``)."""
    return hashlib.sha256(f"{tool}\x1f{canonical_input}".encode()).hexdigest()


class LedgerCall(NamedTuple):
    """One invocation identity, as the ledger keys it."""

    run_id: str
    agent_id: str
    invocation_id: str
    tool: str
    digest: str
    crash_policy: CrashPolicy = DEFAULT_CRASH_POLICY


class LedgerClaim(NamedTuple):
    """The answer to :meth:`ToolLedger.claim`.

    ``state`` is ``claimed`` (the caller runs the body, as ``attempt``), ``running`` (another
    process holds a live claim: ask again later), ``succeeded`` / ``failed`` (the recorded outcome:
    ``result`` in the ``codec``'s encoding, or ``error`` as :func:`encode_error` wrote it), or
    ``unknown`` (the claim's holder died and the tool's policy is at most once). ``ordinal`` is 0
    for the first call recorded under the invocation id and k > 0 for the k-th call that reused the
    id with another tool or input."""

    state: ClaimState
    attempt: int = 1
    ordinal: int = 0
    result: Any = None
    error: Any = None
    codec: str | None = None
    result_event_id: str | None = None
    result_event_seq: int | None = None


class ToolLedger(Protocol):
    """Records tool invocations in a store shared by processes, before their bodies run.

    Calls are synchronous; ``claim`` and ``complete`` are one round trip each on the success path.
    Implementations keep a claim alive while its body runs (``claim`` ... ``complete`` /
    ``release``) and let it expire when the process dies."""

    def claim(self, call: LedgerCall) -> LedgerClaim: ...

    def complete(
        self,
        call: LedgerCall,
        attempt: int,
        *,
        succeeded: bool,
        result: Any,
        error: Any,
        codec: str,
        invocation_event_id: str,
        result_event_id: str,
        result_event_seq: int,
    ) -> None:
        """Record the outcome of the caller's claim (never raises: a store that is down gets it
        later)."""
        ...

    def release(self, call: LedgerCall, attempt: int) -> None:
        """Give up the caller's claim without an outcome (the body was interrupted), so the next
        claim runs it again. Never raises."""
        ...


_ledger: ToolLedger | None = None


def set_tool_ledger(ledger: ToolLedger | None) -> None:
    """Install the ledger that protects ``Tool.invoke`` calls (``configure()`` installs the
    PostgreSQL one); None returns to in-process exactly-once only."""
    global _ledger
    _ledger = ledger


def tool_ledger() -> ToolLedger | None:
    """The installed ledger, or None."""
    return _ledger


class Codec(Protocol):
    """How a tool's result is written to the ledger and read back in another process.

    ``encode`` returns a value JSON can hold (it is stored as ``jsonb``); ``decode`` gets that value
    back, parsed."""

    name: str

    def encode(self, value: Any) -> Any: ...

    def decode(self, data: Any) -> Any: ...


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
    ``args`` and instance attributes in the payload encoding."""
    cls = type(error)
    try:
        message = str(error)
    except Exception:
        message = f"<{cls.__name__}>"
    state = getattr(error, "__dict__", None)
    return {
        "module": cls.__module__,
        "qualname": cls.__qualname__,
        "message": message,
        "args": jsonsafe.to_jsonable(list(error.args)),
        "state": jsonsafe.to_jsonable(dict(state)) if state else {},
    }


def rebuild_error(record: Any, invocation_id: str, tool: str) -> BaseException:
    """The error ``record`` (from :func:`encode_error`) stands for, as its own type when that type
    is importable here (its module already imported) and can be rebuilt so that it reads the same;
    else a :class:`~otel_agentcap.errors.RecordedToolError` carrying the type name and message."""
    if not isinstance(record, dict):
        return RecordedToolError("<unknown>", repr(record), invocation_id, tool)
    module = str(record.get("module", ""))
    qualname = str(record.get("qualname", ""))
    message = str(record.get("message", ""))
    type_name = qualname if module == "builtins" else f"{module}.{qualname}"
    rebuilt = _rebuild(module, qualname, record)
    if rebuilt is not None:
        try:
            if str(rebuilt) == message:
                return rebuilt
        except Exception:
            pass
    return RecordedToolError(type_name, message, invocation_id, tool)


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
