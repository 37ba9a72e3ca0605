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


# --- the paper smokes (tests/smoke_jobs.py), read by the tests using ``smoke_results`` ------------------------------
# In one pytest process they start with the session, in a background thread, and their readers run last. Under
# pytest-xdist (``pytest -n N``, as the GPU check runs the suite) each worker runs the smokes its tests ask for,
# one table once across all workers (smoke_jobs.SharedSmokes), and their readers run first, the longest first.

SMOKE_FIXTURE = "smoke_results"
_SMOKES_WANTED = pytest.StashKey[bool]()


def _xdist(config) -> bool:
    """Whether this session's tests run in pytest-xdist workers (in a worker, or in the controller of -n N)."""
    return bool(os.environ.get("PYTEST_XDIST_WORKER")) or bool(getattr(config.option, "numprocesses", None))


def pytest_configure(config):
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # one core per worker: torch's intra-op threads would oversubscribe the cores the workers already share
        import torch

        torch.set_num_threads(1)


@pytest.hookimpl(trylast=True)  # after -m has deselected: `make test` (-m "not slow") starts no smoke
def pytest_collection_modifyitems(session, config, items):
    """The tests that read the paper smokes run last in one process (the smokes run beside everything else), first
    under xdist (the longest smoke first, so that the workers' last tests are short ones)."""
    reads = [item for item in items if SMOKE_FIXTURE in getattr(item, "fixturenames", ())]
    if reads:
        rest = [item for item in items if SMOKE_FIXTURE not in getattr(item, "fixturenames", ())]
        if _xdist(config):
            from smoke_jobs import smoke_order

            rank = {t: i for i, t in enumerate(smoke_order())}
            reads.sort(
                key=lambda item: rank.get(
                    getattr(item, "callspec", None) and item.callspec.params.get("experiment"), len(rank)
                )
            )
            items[:] = reads + rest
        else:
            items[:] = rest + reads
    config.stash[_SMOKES_WANTED] = bool(reads) and not _xdist(config)


@pytest.fixture(scope="session")
def smoke_jobs(tmp_path_factory, request):
    if _xdist(request.config):
        from smoke_jobs import SharedSmokes

        # the folder above this worker's base temp is the one every worker of the session shares
        yield SharedSmokes(tmp_path_factory.getbasetemp().parent / "paper_smokes")
        return
    from smoke_jobs import SmokeJobs, smoke_order

    jobs = SmokeJobs(smoke_order(), tmp_path_factory.mktemp("smoke"), tmp_path_factory.mktemp("hf")).start()
    yield jobs
    jobs.stop()


@pytest.fixture(scope="session", autouse=True)
def _paper_smokes_start_with_the_session(request):
    """In one pytest process, when any collected test reads the paper smokes, they start now, in the background."""
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


# --- a diagnosis, off unless DP_ADAM_BENCH_TRACE_CAPTURE names a file: under pytest-xdist a worker's capture file
# was found closed after a test of tests/test_sweep_slurm.py ("ValueError: I/O operation on closed file" on every
# later test of that worker). This records each closing of a capture file, with its stack, and each test after
# which one of the global capture's files is closed.
if os.environ.get("DP_ADAM_BENCH_TRACE_CAPTURE"):
    import traceback

    from _pytest import capture as _capture

    _TRACE = os.environ["DP_ADAM_BENCH_TRACE_CAPTURE"]
    _encoded_close = _capture.EncodedFile.close

    def _traced_close(self):
        if not self.closed:
            with open(_TRACE, "a") as fh:
                fh.write(f"--- pid {os.getpid()} closes {self!r}\n{''.join(traceback.format_stack())}\n")
        return _encoded_close(self)

    _capture.EncodedFile.close = _traced_close

    def _capture_state(item):
        glob = item.config.pluginmanager.getplugin("capturemanager")._global_capturing
        if glob is None:
            return None
        return [getattr(getattr(c, "tmpfile", None), "closed", None) for c in (glob.in_, glob.out, glob.err)]

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        before = _capture_state(item)
        yield
        after = _capture_state(item)
        if after != before:
            with open(_TRACE, "a") as fh:
                fh.write(
                    f"=== pid {os.getpid()} after {item.nodeid}: capture files closed {before} -> {after}\n"
                )
