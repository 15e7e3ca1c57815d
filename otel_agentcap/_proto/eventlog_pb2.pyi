from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Header(_message.Message):
    __slots__ = ("format", "schema", "producer", "batches")
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    SCHEMA_FIELD_NUMBER: _ClassVar[int]
    PRODUCER_FIELD_NUMBER: _ClassVar[int]
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    format: str
    schema: str
    producer: str
    batches: int
    def __init__(self, format: _Optional[str] = ..., schema: _Optional[str] = ..., producer: _Optional[str] = ..., batches: _Optional[int] = ...) -> None: ...

class Run(_message.Message):
    __slots__ = ("run_id", "started_at_unix_nano", "attributes_json", "trace_id", "root_span_id")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_UNIX_NANO_FIELD_NUMBER: _ClassVar[int]
    ATTRIBUTES_JSON_FIELD_NUMBER: _ClassVar[int]
    TRACE_ID_FIELD_NUMBER: _ClassVar[int]
    ROOT_SPAN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    started_at_unix_nano: int
    attributes_json: str
    trace_id: str
    root_span_id: str
    def __init__(self, run_id: _Optional[str] = ..., started_at_unix_nano: _Optional[int] = ..., attributes_json: _Optional[str] = ..., trace_id: _Optional[str] = ..., root_span_id: _Optional[str] = ...) -> None: ...

class Agent(_message.Message):
    __slots__ = ("run_id", "agent_id", "name", "parent_agent_id", "spawned_at_event_id")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    PARENT_AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    SPAWNED_AT_EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    agent_id: str
    name: str
    parent_agent_id: str
    spawned_at_event_id: str
    def __init__(self, run_id: _Optional[str] = ..., agent_id: _Optional[str] = ..., name: _Optional[str] = ..., parent_agent_id: _Optional[str] = ..., spawned_at_event_id: _Optional[str] = ...) -> None: ...

class Event(_message.Message):
    __slots__ = ("event_id", "run_id", "agent_id", "logical_seq", "wall_time_unix_nano", "event_type", "causal_parent_ids", "idempotency_key", "trace_id", "span_id", "payload_json")
    EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    LOGICAL_SEQ_FIELD_NUMBER: _ClassVar[int]
    WALL_TIME_UNIX_NANO_FIELD_NUMBER: _ClassVar[int]
    EVENT_TYPE_FIELD_NUMBER: _ClassVar[int]
    CAUSAL_PARENT_IDS_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_KEY_FIELD_NUMBER: _ClassVar[int]
    TRACE_ID_FIELD_NUMBER: _ClassVar[int]
    SPAN_ID_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_JSON_FIELD_NUMBER: _ClassVar[int]
    event_id: str
    run_id: str
    agent_id: str
    logical_seq: int
    wall_time_unix_nano: int
    event_type: str
    causal_parent_ids: _containers.RepeatedScalarFieldContainer[str]
    idempotency_key: str
    trace_id: str
    span_id: str
    payload_json: str
    def __init__(self, event_id: _Optional[str] = ..., run_id: _Optional[str] = ..., agent_id: _Optional[str] = ..., logical_seq: _Optional[int] = ..., wall_time_unix_nano: _Optional[int] = ..., event_type: _Optional[str] = ..., causal_parent_ids: _Optional[_Iterable[str]] = ..., idempotency_key: _Optional[str] = ..., trace_id: _Optional[str] = ..., span_id: _Optional[str] = ..., payload_json: _Optional[str] = ...) -> None: ...

class Conflict(_message.Message):
    __slots__ = ("reason", "existing_event_id", "detected_at_unix_nano", "row_digest", "event")
    REASON_FIELD_NUMBER: _ClassVar[int]
    EXISTING_EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    DETECTED_AT_UNIX_NANO_FIELD_NUMBER: _ClassVar[int]
    ROW_DIGEST_FIELD_NUMBER: _ClassVar[int]
    EVENT_FIELD_NUMBER: _ClassVar[int]
    reason: str
    existing_event_id: str
    detected_at_unix_nano: int
    row_digest: str
    event: Event
    def __init__(self, reason: _Optional[str] = ..., existing_event_id: _Optional[str] = ..., detected_at_unix_nano: _Optional[int] = ..., row_digest: _Optional[str] = ..., event: _Optional[_Union[Event, _Mapping]] = ...) -> None: ...

class Span(_message.Message):
    __slots__ = ("run_id", "trace_id", "span_id", "parent_span_id", "name", "kind", "start_time_unix_nano", "end_time_unix_nano", "status_code", "status_message", "service_name", "scope_name")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    TRACE_ID_FIELD_NUMBER: _ClassVar[int]
    SPAN_ID_FIELD_NUMBER: _ClassVar[int]
    PARENT_SPAN_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    START_TIME_UNIX_NANO_FIELD_NUMBER: _ClassVar[int]
    END_TIME_UNIX_NANO_FIELD_NUMBER: _ClassVar[int]
    STATUS_CODE_FIELD_NUMBER: _ClassVar[int]
    STATUS_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    SERVICE_NAME_FIELD_NUMBER: _ClassVar[int]
    SCOPE_NAME_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    trace_id: str
    span_id: str
    parent_span_id: str
    name: str
    kind: int
    start_time_unix_nano: int
    end_time_unix_nano: int
    status_code: int
    status_message: str
    service_name: str
    scope_name: str
    def __init__(self, run_id: _Optional[str] = ..., trace_id: _Optional[str] = ..., span_id: _Optional[str] = ..., parent_span_id: _Optional[str] = ..., name: _Optional[str] = ..., kind: _Optional[int] = ..., start_time_unix_nano: _Optional[int] = ..., end_time_unix_nano: _Optional[int] = ..., status_code: _Optional[int] = ..., status_message: _Optional[str] = ..., service_name: _Optional[str] = ..., scope_name: _Optional[str] = ...) -> None: ...

class Batch(_message.Message):
    __slots__ = ("header", "runs", "agents", "spans", "events", "conflicts")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    RUNS_FIELD_NUMBER: _ClassVar[int]
    AGENTS_FIELD_NUMBER: _ClassVar[int]
    SPANS_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    CONFLICTS_FIELD_NUMBER: _ClassVar[int]
    header: Header
    runs: _containers.RepeatedCompositeFieldContainer[Run]
    agents: _containers.RepeatedCompositeFieldContainer[Agent]
    spans: _containers.RepeatedCompositeFieldContainer[Span]
    events: _containers.RepeatedCompositeFieldContainer[Event]
    conflicts: _containers.RepeatedCompositeFieldContainer[Conflict]
    def __init__(self, header: _Optional[_Union[Header, _Mapping]] = ..., runs: _Optional[_Iterable[_Union[Run, _Mapping]]] = ..., agents: _Optional[_Iterable[_Union[Agent, _Mapping]]] = ..., spans: _Optional[_Iterable[_Union[Span, _Mapping]]] = ..., events: _Optional[_Iterable[_Union[Event, _Mapping]]] = ..., conflicts: _Optional[_Iterable[_Union[Conflict, _Mapping]]] = ...) -> None: ...
