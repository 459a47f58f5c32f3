"""``python -m train.ttt``: the same command as the installed ``eagle-jax-train`` (``eagle_jax.cli.ttt``)."""

from eagle_jax.cli.ttt import main

if __name__ == "__main__":
    main()
