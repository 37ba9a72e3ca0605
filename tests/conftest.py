import os

import pytest

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture
def isolated_dirs(tmp_path, monkeypatch):
    """Run store and results in a temporary folder."""
    monkeypatch.setenv("DP_ADAM_BENCH_RUNS", str(tmp_path / "runs"))
    monkeypatch.setenv("DP_ADAM_BENCH_RESULTS", str(tmp_path / "results"))
    return tmp_path


# --- the paper smokes (tests/smoke_jobs.py): started with the session, read by the tests using ``smoke_results`` ---

SMOKE_FIXTURE = "smoke_results"
_SMOKES_WANTED = pytest.StashKey[bool]()


def pytest_collection_modifyitems(session, config, items):
    """The tests that read the paper smokes run last, so that the smokes run beside everything else."""
    reads = [item for item in items if SMOKE_FIXTURE in getattr(item, "fixturenames", ())]
    if reads:
        items[:] = [item for item in items if SMOKE_FIXTURE not in getattr(item, "fixturenames", ())] + reads
    config.stash[_SMOKES_WANTED] = bool(reads)


@pytest.fixture(scope="session")
def smoke_jobs(tmp_path_factory):
    from smoke_jobs import SmokeJobs, smoke_order

    jobs = SmokeJobs(smoke_order(), tmp_path_factory.mktemp("smoke"), tmp_path_factory.mktemp("hf")).start()
    yield jobs
    jobs.stop()


@pytest.fixture(scope="session", autouse=True)
def _paper_smokes_start_with_the_session(request):
    """When any collected test reads the paper smokes, they start now, in the background."""
    if request.config.stash.get(_SMOKES_WANTED, False):
        request.getfixturevalue("smoke_jobs")


class FakeWandbRun:
    """What ``wandb.init`` returns, recording what the logger sends (its rows, its summary, whether it finished)."""

    def __init__(self, **kwargs):
        self.kwargs, self.summary, self.rows, self.finished, self.dir = kwargs, {}, [], False, kwargs["dir"]

    def log(self, metrics, step):
        self.rows.append({"_step": step, **metrics})

    def finish(self):
        self.finished = True


@pytest.fixture
def fake_wandb(monkeypatch):
    """``wandb.init`` replaced by :class:`FakeWandbRun`; the list of the runs it made."""
    import wandb

    made = []

    def init(**kwargs):
        made.append(FakeWandbRun(**kwargs))
        return made[-1]

    monkeypatch.setattr(wandb, "init", init)
    return made
