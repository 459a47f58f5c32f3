"""Speculative decoding: chain and EAGLE-2 tree drafting, verification, lossless sampling, the jitted loop."""
