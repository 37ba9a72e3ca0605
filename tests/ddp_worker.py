"""One rank of a data-parallel test run (tests/test_ddp.py starts one process per rank, with the environment
torchrun would give it): registers the tiny task, counts this process's noise draws, trains, and writes what it
saw (draws, the digest of its final parameters, rank 0's summary) to ``$DDP_TEST_OUT/rank<RANK>.json``.

Usage: ``python tests/ddp_worker.py <hydra overrides...>``.
"""

import json
import os
import sys
from pathlib import Path

from dp_adam_bench.engine import trainer
from dp_adam_bench.privacy.mechanisms import IndependentMechanism
from dp_adam_bench.tasks import registry

registry.TASKS["tiny"] = "tiny_task:TinyTask"  # the worker's own registry: no monkeypatch crosses processes

SEEN = {"draws": 0, "params_sha1": None}
_next = IndependentMechanism.next
_digest = trainer._params_digest


def counting_next(self):
    SEEN["draws"] += 1
    return _next(self)


def recording_digest(params):  # every rank digests its final parameters; only rank 0 reports it
    SEEN["params_sha1"] = _digest(params)
    return SEEN["params_sha1"]


def main(overrides: list[str]) -> None:
    from dp_adam_bench.train import train

    from helpers import compose_cfg

    IndependentMechanism.next = counting_next
    trainer._params_digest = recording_digest
    summary = train(compose_cfg(overrides))
    out = Path(os.environ["DDP_TEST_OUT"]) / f"rank{os.environ['RANK']}.json"
    out.write_text(json.dumps({**SEEN, "summary": summary}, default=str))


if __name__ == "__main__":
    main(sys.argv[1:])
