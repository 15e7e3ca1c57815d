"""The middle of the pipeline, in the order a span goes through it.

* :mod:`.stamping`: the identity of an event (run, agent, Lamport sequence, event id, causal
  parents), given when the operation starts: by the capture API to its own spans, and by the span
  processor to the spans of other instrumentations. Needs only ``opentelemetry-api``, like the
  capture API that calls it; so do :mod:`.span_attributes` (the one place that reaches into the
  SDK's spans) and :mod:`.causal_links` (where model calls and the tool results sent back to the
  model meet).
* :mod:`.processor`: ``AgentCapSpanProcessor``, which stamps the spans started inside an agent.
* :mod:`.model_calls`: what a model-call span records, read into the ``model_call`` payload, and
  :mod:`.call_identity`: the rule that one model call is one event, which every step applies.
* :mod:`.mapping`: finished spans to event-log records (``model.Batch``), which the exporters
  store.

This package imports nothing itself, so the capture API can use its first stage without the SDK.
"""
