"""Training: the minibatch update and reading trained weights back."""
