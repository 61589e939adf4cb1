"""Test paths for harness runs that CI starts in subprocesses. Importable from tests as
`harness_paths` (pytest's `pythonpath` holds tests/support).

Unit parity in those sessions is the loss-parity file alone: the whole unit suite runs in the same
CI already, and each stage still starts only after its unit parity passed in that session.
`pytest -m diagnostic` as a user runs it still runs all of `tests/unit` first."""

LOSS_PARITY = "tests/unit/test_losses.py"
