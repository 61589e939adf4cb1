"""The pytest plugin: hooks, stage rules and session fixtures of the gated experiment."""
