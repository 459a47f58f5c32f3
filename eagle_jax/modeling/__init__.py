"""Flax NNX modules: Llama-family targets and EAGLE-3/3.1 drafters."""
