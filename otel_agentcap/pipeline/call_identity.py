"""One model call is one event: the rule, in one place.

One API call may be recorded by several spans (the anthropic SDK's own span and an add-on GenAI
instrumentation's, say), each under its own event id, and every record may reach the log more
than once (exporter retries, collector redelivery, an import). A call is identified by its run
and its response id (the Message id, ``msg_...``), else by its run and its request id (the API's
``request-id`` header, the only id of an error response): :func:`call_ids`. The log holds one
``model_call`` event per call; every other record of it is kept in ``agentcap.conflicts`` naming
the event kept, under :data:`BY_RESPONSE_ID` when it shares the response id, else
:data:`BY_REQUEST_ID` (:func:`conflict_reason`). Of two records of one call seen together, the
anthropic SDK's own is kept (:func:`replaces`); the log's first writer wins over later batches.

Each step a record passes applies the rule with what this module gives:

1. the span processor (:mod:`otel_agentcap.pipeline.processor`), while the spans run: a
   model-call span started inside, or right after, another span of the same call takes that
   span's stamp, and the one that loses is marked :data:`SUPERSEDED`, so the mapping skips it;
2. the mapping (:mod:`otel_agentcap.pipeline.mapping`): a :class:`CallIndex` over a batch of spans
   keeps one event per call and moves the others to ``Batch.superseded``;
3. the rows of a batch (:func:`otel_agentcap.exporters.postgres.rows.resolve_events`), for every
   writer (the exporter, the OTLP ingest, an import): a :class:`CallIndex` over the rows marks
   each later row of a call as a conflict with the reason it would get against the stored one;
4. the writer's classification (:mod:`otel_agentcap.exporters.postgres.writer`) probes the
   stored events by the payload keys :data:`RESPONSE_ID` and :data:`REQUEST_ID` and files a
   row of a stored call under the same reasons. Migration 0002's partial unique indexes on
   ``(run_id, payload ->> 'response_id')`` and ``(run_id, payload ->> 'request_id')`` are the
   backstop: whatever a writer does, the database refuses a second event of a call (the
   migration moved the extra records of logs written before it to conflicts, keeping the SDK's).
   The writer's direct COPY path counts on them: a row of a stored call makes the COPY fail, and
   the batch takes the classifying path.

Only string ids count, as in those indexes (``jsonb_typeof(...) = 'string'``).
"""

from __future__ import annotations

import json
from typing import Any, Final, Generic, TypeVar

from otel_agentcap.jsonsafe import RawJson, to_jsonable

#: Payload keys of a ``model_call`` event that identify the call.
RESPONSE_ID: Final = "response_id"
REQUEST_ID: Final = "request_id"

#: Conflict reasons of a record of a call the log (or the batch) holds under another event id.
BY_RESPONSE_ID: Final = "model_call_response_id"
BY_REQUEST_ID: Final = "model_call_request_id"

#: Set on a model-call span whose event another span of the same call records instead.
SUPERSEDED: Final = "agentcap.event.superseded"

_Kept = TypeVar("_Kept")


def call_ids(payload: Any) -> tuple[str | None, str | None]:
    """The response id and the request id a ``model_call`` payload records (``None`` when absent).

    They identify the API call: two ``model_call`` events of one run with the same response id,
    or the same request id, record the same call. Only string values count, as in the log's
    unique indexes (``jsonb_typeof(...) = 'string'``): a value storage encodes as a JSON string
    (a ``uuid.UUID``, say) counts as that string. A payload still in its JSON text form
    (``jsonsafe.RawJson``) is parsed for this."""
    if type(payload) is dict:
        response_id = payload.get(RESPONSE_ID)
        request_id = payload.get(REQUEST_ID)
        if (response_id is None or type(response_id) is str) and (
            request_id is None or type(request_id) is str
        ):
            return response_id, request_id  # as model_call_payload writes them
    if isinstance(payload, RawJson):
        try:
            payload = json.loads(payload)
        except (ValueError, RecursionError):
            return None, None
    if not isinstance(payload, dict):
        return None, None
    return _id_text(payload.get(RESPONSE_ID)), _id_text(payload.get(REQUEST_ID))


def _id_text(value: Any) -> str | None:
    if value is None or isinstance(value, str):
        return value
    stored = to_jsonable(value)
    return stored if isinstance(stored, str) else None


def replaces(candidate_is_sdk: bool, kept_is_sdk: bool) -> bool:
    """Whether a record of a call takes the place of the record kept for it so far: only the
    anthropic SDK's own record replaces another instrumentation's. Otherwise the kept one stays
    (the processor keeps the inner of two nested add-on spans: the one that made the call)."""
    return candidate_is_sdk and not kept_is_sdk


def conflict_reason(response_id: str | None) -> str:
    """The reason a record of a call held under another event id is kept as a conflict."""
    return BY_RESPONSE_ID if response_id is not None else BY_REQUEST_ID


class CallIndex(Generic[_Kept]):
    """The calls seen so far, by (run, response id) and by (run, request id), each with what the
    caller kept for it (an event's index or id)."""

    __slots__ = ("_by_request", "_by_response")

    def __init__(self) -> None:
        self._by_response: dict[tuple[str, str], _Kept] = {}
        self._by_request: dict[tuple[str, str], _Kept] = {}

    def matches(
        self, run_id: str, response_id: str | None, request_id: str | None
    ) -> tuple[_Kept | None, _Kept | None]:
        """What is kept for the call with this response id, and for the call with this request
        id (``None`` where there is none; the two differ when the ids name two calls)."""
        by_response = None if response_id is None else self._by_response.get((run_id, response_id))
        by_request = None if request_id is None else self._by_request.get((run_id, request_id))
        return by_response, by_request

    def find(
        self, run_id: str, response_id: str | None, request_id: str | None
    ) -> tuple[_Kept, str] | None:
        """What is kept for the call these ids record (the response id decides first), with the
        conflict reason of another record of it; None for a call not seen yet."""
        by_response, by_request = self.matches(run_id, response_id, request_id)
        if by_response is not None:
            return by_response, BY_RESPONSE_ID
        if by_request is not None:
            return by_request, BY_REQUEST_ID
        return None

    def add(
        self, run_id: str, response_id: str | None, request_id: str | None, kept: _Kept
    ) -> None:
        """Record ``kept`` for the call with these ids, where nothing is recorded for them yet.
        A record matched by one id lends the call its other id, so a third record that shares
        only that one is found too."""
        if response_id is not None:
            self._by_response.setdefault((run_id, response_id), kept)
        if request_id is not None:
            self._by_request.setdefault((run_id, request_id), kept)
