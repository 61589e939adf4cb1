"""Model side of the embedded server: the engine (training, checkpoints, sampling), the tiny
Qwen3 presets it runs, the decode loop, the fused output head, losses and the presets' warm start
(docs/local-server.md)."""
