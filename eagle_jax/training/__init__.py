"""Training utilities for the bundled tiny target model and the EAGLE-3 drafter."""
