"""``python -m train.vocab_map``: the same command as the installed ``eagle-jax-vocab-map``
(``eagle_jax.cli.vocab_map``)."""

from eagle_jax.cli.vocab_map import main

if __name__ == "__main__":
    main()
