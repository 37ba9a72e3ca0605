"""The parts of ``benchmarks/gpu_check.py``, the GPU proof in one command (issue 34).

- ``paths``: where the check reads and writes (the committed report folder, ``results_gpu.csv``);
- ``part``: what a part is (its commands and its check), its context and its result;
- ``commands``: command lines and checks several parts share (a training run, a run of ``gpu_check.py``'s own
  in-process checks, the runs' summaries);
- one module per family of parts, with its commands, its check and, where it runs in-process, its check's code:
  ``environment`` (device, versions, fp32 math), ``suite`` (the test suite and the fp32 / fp64 conformance grid
  through pytest and their JUnit XML), ``benches`` (``bench_gpu.py``), ``tf32`` (clipped contributions' norms
  with TF32 on), ``bf16_grid`` (conformance cases through bk under bf16 autocast, the self-check on the benchmark
  models), ``paper_runs`` (the paper profile's CIFAR-10 runs and pretraining), ``ddp`` (NCCL and gloo
  data-parallel training), ``sweep`` (``sweep --jobs 2`` on one GPU);
- ``registry``: the parts in order (``PARTS``) and the in-process checks (``SUBCOMMANDS``);
- ``runner``: each part in its own process group under its time limit, within the whole budget;
- ``report``: ``report.md`` and ``results.json``, rewritten as each part ends.
"""
