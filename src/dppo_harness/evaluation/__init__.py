"""Evaluation: greedy GSM8K test accuracy, answer yield and the paired interval."""
