"""Command-line scripts for building data and training the bundled models."""
