"""Model side of the embedded server: the engine (training, checkpoints, sampling), the tiny
Qwen3 presets and Hugging Face checkpoints it runs, the decode loop, logprob kernels, losses and
the presets' warm start (docs/local-server.md)."""
