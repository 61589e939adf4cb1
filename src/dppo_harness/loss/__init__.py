"""Losses: the packed loss path, its registry, independent references and golden checks."""
