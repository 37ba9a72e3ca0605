"""``train.sampler``: the registry of samplers (issue 59), like every other pluggable piece
(:mod:`dp_adam_bench.registry`). Each entry builds the sampler the config names over ``n`` private examples:
``build(cfg, n, steps, seed)``; config validation and the API read their valid names from here. The samplers
themselves are in :mod:`dp_adam_bench.engine.sampling`; the builders in :mod:`dp_adam_bench.engine.plan` (they
read the config's batch size, epochs and, for cyclic Poisson, the cycle length). Importing this module imports no
torch."""

from __future__ import annotations

from dp_adam_bench.registry import Registry

SAMPLERS = Registry("sampler", "train.sampler")
SAMPLERS.register("single_pass", "dp_adam_bench.engine.plan:single_pass_sampler")
SAMPLERS.register("poisson", "dp_adam_bench.engine.plan:poisson_sampler")
SAMPLERS.register("shuffle", "dp_adam_bench.engine.plan:shuffle_sampler")
SAMPLERS.register("cyclic_poisson", "dp_adam_bench.engine.plan:cyclic_poisson_sampler")
SAMPLERS.register("balls_in_bins", "dp_adam_bench.engine.plan:balls_in_bins_sampler")
