"""The catalog: exports, their state transitions, workers and the runtimes they report.

The catalog row, not the broker, is the source of truth for a job's state.
"""
