"""Generated code of the event-log schema (``proto/agentcap/eventlog/v1/eventlog.proto``); do not
edit: ``scripts/generate_proto.py`` regenerates it with the pinned generator."""
