pytest_plugins = ["otel_agentcap.testing.postgres"]
