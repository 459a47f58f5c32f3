"""Weight exchange with PyTorch: HF target checkpoints and EAGLE drafter checkpoints, both ways."""
