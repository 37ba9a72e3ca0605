"""Optimizer variants (SPEC §1): each consumes the privatizer's output and updates parameters in place."""
