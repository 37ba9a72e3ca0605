"""Optimizer variants: each consumes the privatizer's output and updates parameters in place.

The variants of Ganesh, McMahan & Thakurta, "On Design Principles for Private Adaptive Optimizers" (2025,
arXiv:2507.01129), Algorithms 4-9 and §5.1 (AdaGrad), and DP-AdamBC of Tang & Lécuyer, "DP-Adam: Correcting DP Bias
in Adam's Second Moment Estimation" (2023, arXiv:2304.11208), Eq. 3 / Algorithm 1. ``docs/papers.md`` lists which
variant reproduces which algorithm; ``docs/design.md`` says how to add one.
"""
