"""DPPO Binary-TV vs GRPO experiment harness for Tinker-compatible services."""
