"""Empirical privacy auditing in one training run (Steinke, Nasr & Jagielski 2023, arXiv 2305.08846).

* :mod:`~dp_adam_bench.audit.bound` — the epsilon lower bound of Theorem 3.1 from the canaries' guesses.
* :mod:`~dp_adam_bench.audit.whitebox` — gradient canaries through the real trainer, privatizer, variant and noise
  mechanism; the auditor sees the parameters after every step.
* :mod:`~dp_adam_bench.audit.blackbox` — input canaries (mislabeled examples) scored by loss on the final model.
* :mod:`~dp_adam_bench.audit.meter` — the mechanism meter: noise std, sensitivity, sampling rate, noise
  correlation and post-processing measured from one run and tested against the accountant's assumptions.
* :mod:`~dp_adam_bench.audit.controls` — deliberately broken privatizers (and a broken cyclic Poisson sampler) an
  audit must catch.
"""
