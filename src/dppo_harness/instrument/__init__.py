"""Instrumentation: per-loss-call records, pooled statistics, offline replay, cookbook metrics."""
