"""``python -m serve``: the same command as the installed ``eagle-jax-serve`` (``eagle_jax.cli.serve``)."""

from eagle_jax.cli.serve import main

if __name__ == "__main__":
    main()
