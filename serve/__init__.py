"""``python -m serve`` from the repository; the server itself is ``eagle_jax.serving`` (installed as
``eagle-jax-serve``)."""
