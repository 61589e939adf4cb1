"""Embedded Tinker-protocol server (model side: engine, model, vocab, warmstart)."""
