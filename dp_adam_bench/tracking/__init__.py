"""Run store (one folder per run) and the W&B adapter."""
