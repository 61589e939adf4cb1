"""Task data: vendored GSM8K with pinned hashes, the tokenizer and renderer, the dataset seam."""
