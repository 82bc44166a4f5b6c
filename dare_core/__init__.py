"""DARE core library: models, diffusion math, samplers, algorithms, rewards, data, training."""
__version__ = "0.1.0"
