"""Runs out of and into the event log: ``otel-agentcap export`` and ``otel-agentcap import``.

* :mod:`.snapshot`: a run as the log holds it, read in a fixed order;
* :mod:`.traces`: the run's trace rebuilt from it (spans, parents, causal links);
* :mod:`.agentcap_pb`, :mod:`.otlp_json`, :mod:`.jaeger_json`: the file formats;
* :mod:`.formats`: the registry of export formats;
* :mod:`.load`: reading a file (agentcap-pb, OTLP/JSON, OTLP protobuf) into a log, deduplicated.
"""
