"""``python -m train.regenerate``: the same command as the installed ``eagle-jax-regenerate``
(``eagle_jax.cli.regenerate``)."""

from eagle_jax.cli.regenerate import main

if __name__ == "__main__":
    main()
