"""Instrumentations of model-provider SDKs (see :mod:`otel_agentcap.instrumentation.anthropic`)."""
