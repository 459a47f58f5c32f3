"""The command-line entry points, one module per command, each with ``main(argv=None)``; installed as
console scripts (``eagle-jax-train``, ``-export``, ``-regenerate``, ``-vocab-map``, ``-eval``,
``-serve``, ``-fetch``) and run in the repository as ``python -m train.<name>`` / ``python -m serve``
(``eagle-jax-fetch`` as ``python -m eagle_jax.cli.fetch``)."""
