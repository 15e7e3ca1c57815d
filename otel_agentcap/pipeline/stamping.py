"""Allocation of event identity: sequence, deterministic id and causal parents."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from opentelemetry.trace import Link, SpanContext
from opentelemetry.util.types import AttributeValue

from otel_agentcap import attributes as attr
from otel_agentcap.attributes import LINK_EVENT_ID, MAX_CAUSAL_LINKS
from otel_agentcap.context import AgentContext, ambient_causal_parents
from otel_agentcap.model import EventRef, event_id_in, from_fields


class Stamp(NamedTuple):
    """The identity of one captured event, fixed when the operation starts."""

    run_id: str
    agent_id: str
    agent_name: str
    seq: int
    event_id: str
    event_type: str
    idempotency_key: str
    causal_parent_ids: tuple[str, ...]
    #: One span link per causal parent whose span is known (at most ``MAX_CAUSAL_LINKS``), each
    #: with the parent's event id as ``agentcap.causal_parent.event_id``.
    links: tuple[Link, ...] = ()

    @property
    def ref(self) -> EventRef:
        """This event as a causal parent, without its span (see :meth:`ref_on`)."""
        return _new_ref((self.event_id, self.seq, self.agent_id, None))

    def ref_on(self, span_context: SpanContext | None) -> EventRef:
        """This event as a causal parent carried by the span with ``span_context``."""
        return _new_ref((self.event_id, self.seq, self.agent_id, span_context))

    def attributes(self) -> dict[str, AttributeValue]:
        """The stamp as span attributes. What can be derived is left out (every attribute costs
        on the hot path): the idempotency key when it is ``seq:{seq}``, and empty causal
        parents; ``mapping`` restores both."""
        attributes: dict[str, AttributeValue] = {
            attr.RUN_ID: self.run_id,
            attr.AGENT_ID: self.agent_id,
            attr.GEN_AI_AGENT_ID: self.agent_id,
            attr.GEN_AI_AGENT_NAME: self.agent_name,
            attr.EVENT_ID: self.event_id,
            attr.EVENT_TYPE: self.event_type,
            attr.EVENT_SEQ: self.seq,
        }
        if self.idempotency_key != f"seq:{self.seq}":
            attributes[attr.EVENT_IDEMPOTENCY_KEY] = self.idempotency_key
        if self.causal_parent_ids:
            attributes[attr.EVENT_CAUSAL_PARENT_IDS] = self.causal_parent_ids
        return attributes


def stamp(
    agent: AgentContext,
    event_type: str,
    *,
    key: str | None = None,
    parents: Sequence[EventRef] = (),
    link: bool = True,
    event_id: str | None = None,
) -> Stamp:
    """Allocate the next event of ``agent``: its sequence is above the agent's last one and above
    every causal parent's (explicit ``parents`` plus those bound with ``caused_by``).

    ``key`` is the idempotency key; without one the event is keyed by its sequence, which is unique
    per agent, so the id is still deterministic for exporter retries and collector redelivery.

    ``link=False`` leaves out the span links: a closing event (a tool's result, an agent's end)
    whose parents are its span's own start event and the ``caused_by`` parents the span linked to
    when it started.

    ``event_id``: the event's id when the caller computed it already from ``key`` (the id is
    always ``event_id_in(agent.event_id_prefix, key)``).
    """
    ambient = ambient_causal_parents()
    parent_ids: tuple[str, ...] = ()
    links: tuple[Link, ...] = ()
    if not parents and ambient:  # e.g. a memory write inside caused_by
        shared = ambient_parents(ambient)
        parent_ids = shared.ids
        if link and shared.linked:
            links = new_links(shared.linked)
        seq = agent.clock.tick(shared.after)
    elif len(parents) == 1 and not ambient:  # e.g. a tool's result, caused by its invocation
        parent = parents[0]
        parent_ids = (parent.event_id,)
        seq = agent.clock.tick(parent.seq)
        if link and parent.span is not None:
            links = (_link(parent),)
    elif parents or ambient:
        after = 0
        ids: list[str] = []
        linked: list[Link] = []
        for parent in (*parents, *ambient):
            if parent.seq > after:
                after = parent.seq
            if parent.event_id not in ids:
                ids.append(parent.event_id)
                if link and parent.span is not None and len(linked) < MAX_CAUSAL_LINKS:
                    linked.append(_link(parent))
        parent_ids = tuple(ids)
        links = tuple(linked)
        seq = agent.clock.tick(after)
    else:
        seq = agent.clock.tick()
    idempotency_key = key if key is not None else f"seq:{seq}"
    run_id = agent.run_id
    agent_id = agent.agent_id
    return _new_stamp(
        (
            run_id,
            agent_id,
            agent.name,
            seq,
            event_id or event_id_in(agent.event_id_prefix, idempotency_key),
            event_type,
            idempotency_key,
            parent_ids,
            links,
        )
    )


class AmbientParents(NamedTuple):
    """What the causal parents bound with ``caused_by`` give every event stamped under them:
    worked out once per tuple of parents (see :func:`ambient_parents`), not once per event."""

    parents: tuple[EventRef, ...]
    #: The highest sequence among them (0 for none).
    after: int
    #: Their distinct event ids, in order.
    ids: tuple[str, ...]
    #: The first ``MAX_CAUSAL_LINKS`` of them whose span is known (distinct), which a span
    #: stamped under them links to: see :func:`new_links`.
    linked: tuple[EventRef, ...]
    #: ``ids`` as they follow a first id in a JSON list (``","id2","id3`` for ``["id1","id2","id3"]``).
    ids_json_tail: str


def _ambient_parents_of(parents: tuple[EventRef, ...]) -> AmbientParents:
    after = 0
    ids: list[str] = []
    linked: list[EventRef] = []
    for parent in parents:
        if parent.seq > after:
            after = parent.seq
        if parent.event_id not in ids:
            ids.append(parent.event_id)
            if parent.span is not None and len(linked) < MAX_CAUSAL_LINKS:
                linked.append(parent)
    return AmbientParents(
        parents, after, tuple(ids), tuple(linked), "".join(f'","{i}' for i in ids)
    )


_last_ambient = _ambient_parents_of(())


def ambient_parents(parents: tuple[EventRef, ...]) -> AmbientParents:
    """:class:`AmbientParents` of ``parents``, the tuple :func:`ambient_causal_parents` returned:
    one tuple object for as long as its ``caused_by`` block lasts, so the last one's is kept and
    found by identity (a tuple read and a global's assignment are atomic: threads under other
    parents replace it, never corrupt it)."""
    global _last_ambient
    last = _last_ambient
    if last.parents is parents:
        return last
    last = _last_ambient = _ambient_parents_of(parents)
    return last


def new_links(parents: tuple[EventRef, ...]) -> tuple[Link, ...]:
    """New span links to the spans of ``parents`` (each with its span), one span's: a ``Link``
    object is never given to two spans, as the SDK replaces its attributes with its own bounded
    copy when a span starts with it (and counts what that copy dropped)."""
    if len(parents) == 1:
        return (_link(parents[0]),)
    return tuple([_link(parent) for parent in parents])


def _link(parent: EventRef) -> Link:
    """The span link to the span that carries the causal parent ``parent``."""
    return Link(parent.span, {LINK_EVENT_ID: parent.event_id})  # type: ignore[arg-type]


_new_stamp = from_fields(Stamp)
_new_ref = from_fields(EventRef)
