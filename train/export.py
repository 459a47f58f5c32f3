"""``python -m train.export``: the same command as the installed ``eagle-jax-export`` (``eagle_jax.cli.export``)."""

from eagle_jax.cli.export import main

if __name__ == "__main__":
    main()
