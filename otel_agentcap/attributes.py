"""Attribute names: OpenTelemetry GenAI semantic conventions where they exist, ``agentcap.*`` for ours."""

from __future__ import annotations

from typing import Final

# GenAI semantic conventions (https://opentelemetry.io/docs/specs/semconv/gen-ai/).
GEN_AI_OPERATION_NAME: Final = "gen_ai.operation.name"
GEN_AI_PROVIDER_NAME: Final = "gen_ai.provider.name"
GEN_AI_SYSTEM: Final = "gen_ai.system"
GEN_AI_AGENT_ID: Final = "gen_ai.agent.id"
GEN_AI_AGENT_NAME: Final = "gen_ai.agent.name"
GEN_AI_CONVERSATION_ID: Final = "gen_ai.conversation.id"
GEN_AI_TOOL_NAME: Final = "gen_ai.tool.name"
GEN_AI_TOOL_CALL_ID: Final = "gen_ai.tool.call.id"
GEN_AI_TOOL_TYPE: Final = "gen_ai.tool.type"
#: Tool arguments and result as JSON text: content, set only when content capture is on.
GEN_AI_TOOL_CALL_ARGUMENTS: Final = "gen_ai.tool.call.arguments"
GEN_AI_TOOL_CALL_RESULT: Final = "gen_ai.tool.call.result"
GEN_AI_REQUEST_MODEL: Final = "gen_ai.request.model"
GEN_AI_RESPONSE_MODEL: Final = "gen_ai.response.model"
GEN_AI_RESPONSE_ID: Final = "gen_ai.response.id"
GEN_AI_RESPONSE_FINISH_REASONS: Final = "gen_ai.response.finish_reasons"
GEN_AI_USAGE_INPUT_TOKENS: Final = "gen_ai.usage.input_tokens"
GEN_AI_USAGE_OUTPUT_TOKENS: Final = "gen_ai.usage.output_tokens"
ERROR_TYPE: Final = "error.type"

# Values of gen_ai.operation.name.
OP_INVOKE_AGENT: Final = "invoke_agent"
OP_CREATE_AGENT: Final = "create_agent"
OP_EXECUTE_TOOL: Final = "execute_tool"
OP_CHAT: Final = "chat"
#: The root span of a run (``ac.run``): a GenAI workflow.
OP_INVOKE_WORKFLOW: Final = "invoke_workflow"

# otel_agentcap's own attributes. A span holding an event carries RUN_ID, AGENT_ID, EVENT_ID,
# EVENT_TYPE, EVENT_SEQ and the GenAI agent id and name; EVENT_IDEMPOTENCY_KEY only when it is not
# "seq:{seq}" and EVENT_CAUSAL_PARENT_IDS only when there are parents (see stamping.Stamp).
RUN_ID: Final = "agentcap.run.id"
#: JSON object: the attributes given to ``run(run_id, **attributes)``, on the spans of the run's
#: agent executions (stored in ``agentcap.runs.attributes``).
RUN_ATTRIBUTES: Final = "agentcap.run.attributes"
AGENT_ID: Final = "agentcap.agent.id"
#: On a run's root span (``invoke_workflow {run id}``): true. Its ``agentcap.run.id`` is the run's.
RUN_ROOT: Final = "agentcap.run.root"
#: On a run's root span in an ``otlp-json`` or ``jaeger-json`` export only (capture never sets it):
#: the run's start as its log recorded it (``agentcap.runs.started_at``, Unix nanoseconds), when
#: that is not the root span's start. An import starts the run there.
RUN_STARTED_AT: Final = "agentcap.run.started_at_unix_nano"
#: Attribute of each span link that names a causal parent: the parent event's id (also listed in
#: the span's ``agentcap.event.causal_parent_ids``, as link attributes do not survive every
#: translation, Jaeger's included).
LINK_EVENT_ID: Final = "agentcap.causal_parent.event_id"
#: Links per span made for causal parents; parents beyond it stay in the attributes only.
MAX_CAUSAL_LINKS: Final = 32
EVENT_ID: Final = "agentcap.event.id"
EVENT_TYPE: Final = "agentcap.event.type"
EVENT_SEQ: Final = "agentcap.event.seq"
EVENT_IDEMPOTENCY_KEY: Final = "agentcap.event.idempotency_key"
EVENT_CAUSAL_PARENT_IDS: Final = "agentcap.event.causal_parent_ids"
EVENT_PAYLOAD: Final = "agentcap.event.payload"

# On an agent_spawn event: the child it created.
CHILD_AGENT_ID: Final = "agentcap.child.agent_id"
CHILD_AGENT_NAME: Final = "agentcap.child.name"
# On an agent_spawn event recorded while the spawn registry did not answer (or answered from this
# host's file only): the delivery registers the spawn before storing the event, and leaves the
# event out if another process registered the child first.
SPAWN_UNREGISTERED: Final = "agentcap.spawn.unregistered"
# On a child's agent_start event: where it came from.
PARENT_AGENT_ID: Final = "agentcap.parent.agent_id"
SPAWNED_AT_EVENT_ID: Final = "agentcap.spawned_at_event_id"

# The closing event of an operation (the tool_result or agent_error of an execute_tool span, the
# agent_end or agent_error of an invoke_agent span), set on the span just before it ends as one
# JSON attribute: {"id": event id, "type": event type, "seq": n, "key": idempotency key,
# "parents": [ids], "payload": payload}. Run and agent are the span's, its time the span's end.
# An attribute rather than a span event: OpenTelemetry is deprecating the Span Event API
# (OTEP 4430), and one attribute costs a fraction of a span event.
OUTCOME: Final = "agentcap.outcome"

# Earlier versions recorded the closing event as a span event named SPAN_EVENT_PREFIX + type that
# holds the same record in SPAN_EVENT_RECORD; the mapping still reads those (e.g. from a collector
# replaying old spans).
SPAN_EVENT_PREFIX: Final = "agentcap."
SPAN_EVENT_RECORD: Final = "agentcap.event"
