"""Exporters: PostgreSQL event log."""
