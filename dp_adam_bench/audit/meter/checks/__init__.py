"""The meter's checks, one file each, named for the check a :class:`~dp_adam_bench.audit.meter.result.MeterCheck`
row names: the test and its power.

* ``sampling`` — sampling.py (the support against :func:`~.sampling.sampling_reference`, the rate or schedule);
* ``sensitivity`` — sensitivity.py (the slope of each release on its predicted clipped mean);
* ``noise_std`` — noise_std.py (the measured against the stated std, pooled and by coordinate group);
* ``correlation`` — correlation.py (the whitened residual's autocorrelation at lags 1..LAGS);
* ``noise_covariance`` — noise_covariance.py (every release at every step together);
* ``multiplier`` — multiplier.py (the joint noise multiplier against the accountant's);
* ``post_processing`` — an exact check, not a statistical one: ../replay.py.

stats.py holds what they share (the level ``ALPHA``, the stated error ``EFFECT``, z-test arithmetic,
:class:`~.stats.ReleaseStats`); release.py a release's statistics and its three checks; row.py every check of a row,
each at level ALPHA / (number of checks)."""
