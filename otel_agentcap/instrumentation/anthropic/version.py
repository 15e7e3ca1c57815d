from otel_agentcap.version import __version__

__all__ = ["__version__"]
