"""Drafter training (TTT), its data, regeneration of training data by the target, and the draft vocabulary map."""
