"""The private training step: sampling, clipping, noise, the loop."""
