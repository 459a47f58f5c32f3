"""``python -m train.eval``: the same command as the installed ``eagle-jax-eval`` (``eagle_jax.cli.eval``)."""

from eagle_jax.cli.eval import main

if __name__ == "__main__":
    main()
