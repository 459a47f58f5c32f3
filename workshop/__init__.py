"""The bundled-model workshop (repository only): how assets/ was made on a 2-core CPU.

The corpus (the Python standard library's source, pinned by hash in assets/data/manifest.json), its
BPE tokenizer, the tiny Llama code target's pretraining, and the build of its EAGLE-3 / EAGLE-3.1
drafters with the library's own regeneration and TTT trainer:

    python -m workshop.build_data           # manifest + tokenizer
    python -m workshop.pretrain_target      # the target (resumable)
    python -m workshop.bundle               # regenerated data, vocab map, both drafters

Nothing in eagle_jax imports it: what users of the library train with lives in eagle_jax.training.
"""
