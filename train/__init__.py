"""`python -m train.<command>`: the console scripts' training commands (ttt, export, regenerate, vocab_map, eval)
run from the repository."""
