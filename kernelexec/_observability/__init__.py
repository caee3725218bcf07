"""Observability: OpenTelemetry traces and metrics, when the ``otel`` extra is installed.

``_otel.py`` is the only module that touches OpenTelemetry, and only after finding it
importable; without it every hook here is a no-op that imports nothing. The core calls it at a
handful of places: a session's calls, a pool's kernel starts and restarts, environment builds,
and the executor's kernel counts for the gauges.
"""
