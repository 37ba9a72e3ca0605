"""What ``benchmarks/run_all.py`` runs and how it writes ``benchmarks/README.md``.

- ``registry``: the benchmarks (script, CSV, title, presets), the one list both the runner and the README read;
- ``provenance``: which command wrote each CSV (``results_provenance.json``);
- ``tables``: reading the CSVs, markdown tables and the 'met' / 'missed by' verdicts;
- ``accounting``, ``noise``, ``fig2``, ``engines``, ``gpu``: one module per benchmark, with its targets;
- ``profiles``: which engine rows miss their target (profiled by the runner) and the README's list of profiles;
- ``readme``: the README itself, assembled from the sections above.

Every number in the README comes from the CSVs and the profiles; the only constants are the targets (the issues'
and docs/pitfalls.md's numbers to beat), each in the module of its benchmark.
"""
