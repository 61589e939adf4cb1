"""The experiment's stages, in order: restoration, feasibility, gate, diagnostic, comparison."""
