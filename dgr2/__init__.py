"""dgr2: Diffusion-GR2, a generative reasoning re-ranker converted to block diffusion."""
__version__ = "0.1.0"
