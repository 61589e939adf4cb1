"""Rollouts: sampling a batch, group-centred advantages, the immutable frozen batch."""
