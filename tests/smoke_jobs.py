"""Every paper table's smoke (``dp-adam-bench sweep <table> --profile paper --smoke``, tests/test_paper_smoke.py),
run in child processes that start with the test session.

The rest of the suite runs in the one pytest process, on one core; CI has two. So the smokes start in the background
when the session starts, one child process at a time, on the other core; the tests that read them (those using the
``smoke_results`` fixture) run last (tests/conftest.py), and when they start waiting, the pytest process takes
tables from the same queue too, so that the smokes still left run two at a time. Each child gets the environment of
the session's start (tests change ``os.environ`` while the smokes run), its own temporary folders, one thread.
Under pytest-xdist there is no background thread: :class:`SharedSmokes` runs each table once across the workers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections import deque
from pathlib import Path

from fake_hub import LOCAL_DATA, hub_env

REPO = Path(__file__).resolve().parents[1]
# the presets whose paper profile loads from the hub, and the paper's numbers their plan must show
HUB_TABLES = (
    "tang_fig1_cifar10",
    "tang_fig1_snli",
    "tang_fig3_cifar10",
    "tang_fig3_snli",
    "li_e2e",
    "li_glue",
    "li_e2e_methods",
    "li_dialog",
    "li_hyperparams",
    "ganesh_fig3",
    "mf_amplified",
)
# every paper table: the hub ones and the closed-form toys (no hub, the same smoke)
SMOKE_TABLES = (*HUB_TABLES, "ganesh_fig2", "ganesh_quadratic")
# the order the smokes start in, longest first, so that the last two child processes finish close together (seconds
# alone on one thread: ganesh_fig3 85, mf_amplified 50, the tang tables and li_e2e 10-30, the toys 10)
LONGEST_FIRST = (
    "ganesh_fig3",
    "mf_amplified",
    "tang_fig3_snli",
    "tang_fig3_cifar10",
    "tang_fig1_snli",
    "li_e2e",
)


def smoke_order() -> list[str]:
    """Every table, the longest smokes first."""
    rank = {t: i for i, t in enumerate(LONGEST_FIRST)}
    return sorted(SMOKE_TABLES, key=lambda t: rank.get(t, len(rank)))


def cli_env(hub: Path, tmp: Path, base: dict | None = None) -> dict[str, str]:
    """The environment of a ``python -m dp_adam_bench`` child: the fake hub at ``hub``, run store and results under
    ``tmp``, no local data but the fake hub's Persona-Chat file (the hub for everything it serves: the paper profile's
    loaders), one thread."""
    return {
        **(os.environ if base is None else base),
        **hub_env(hub),
        "PYTHONPATH": str(REPO),
        "DP_ADAM_BENCH_RUNS": str(tmp / "runs"),
        "DP_ADAM_BENCH_RESULTS": str(tmp / "results"),
        "DP_ADAM_BENCH_DATA": str(hub / LOCAL_DATA),
        "OMP_NUM_THREADS": "1",
    }


class SmokeJobs:
    """The smokes of ``tables`` (started in this order), under ``base / <table>``, with the fake hub built under
    ``hub`` first. :meth:`start` runs them in a background thread; :meth:`wait` joins in and returns
    ``{table: (its temporary folder, the finished process)}``; :meth:`stop` kills what still runs."""

    def __init__(self, tables, base: Path, hub: Path):
        self.base, self.hub = Path(base), Path(hub)
        self.env = dict(os.environ)  # the session's environment now, before any test changes it
        self.results: dict[str, tuple[Path, subprocess.CompletedProcess]] = {}
        self._todo = deque(tables)
        self._lock = threading.Lock()
        self._procs: set[subprocess.Popen] = set()
        self._stopped = False
        self._hub_built = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._background, name="paper-smokes", daemon=True)

    def start(self) -> SmokeJobs:
        self._thread.start()
        return self

    def _run(self, args, env) -> subprocess.CompletedProcess:
        with self._lock:
            if self._stopped:
                raise RuntimeError("the paper smokes were stopped")
            proc = subprocess.Popen(
                [sys.executable, *args],
                cwd=REPO,
                env=env,
                text=True,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
            self._procs.add(proc)
        try:
            out, err = proc.communicate()
        finally:
            with self._lock:
                self._procs.discard(proc)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def _build_hub(self) -> None:
        # in a child process: the Hugging Face libraries read their cache paths when imported
        code = (
            "import sys; sys.path.insert(0, 'tests'); import fake_hub; fake_hub.build_fake_hub(sys.argv[1])"
        )
        env = {**self.env, **hub_env(self.hub), "PYTHONPATH": str(REPO)}
        out = self._run(["-c", code, str(self.hub)], env)
        if out.returncode != 0:
            raise RuntimeError(f"building the fake hub failed:\n{out.stderr[-4000:]}")

    def _next(self) -> str | None:
        with self._lock:
            return None if self._stopped or not self._todo else self._todo.popleft()

    def _work(self) -> None:
        while (table := self._next()) is not None:
            tmp = self.base / table
            tmp.mkdir()
            args = ["-m", "dp_adam_bench", "sweep", table, "--profile", "paper", "--smoke"]
            self.results[table] = (tmp, self._run(args, cli_env(self.hub, tmp, self.env)))

    def _background(self) -> None:
        try:
            self._build_hub()
            self._hub_built.set()
            self._work()
        except BaseException as err:  # noqa: BLE001 - handed to the tests by wait()
            self._error = err
            self._hub_built.set()

    def wait(self) -> dict[str, tuple[Path, subprocess.CompletedProcess]]:
        """Take the tables not yet started (a second child process beside the background one), then wait for all."""
        self._hub_built.wait()
        if self._error is None:
            self._work()
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self.results

    def stop(self) -> None:
        """Start no more smokes and kill the running ones (a session that ends early)."""
        with self._lock:
            self._stopped = True
            for proc in self._procs:
                proc.kill()
        self._thread.join()


class SharedSmokes:
    """The smokes under pytest-xdist (``pytest -n N``; the GPU check runs the suite so): no background thread, each
    table's smoke run by the first worker that asks for it, under a file lock per table in the folder every worker
    shares, and its result written there for the others; the fake hub built once, the same way. The smoke tests
    come first in the order (tests/conftest.py), longest first, so that the workers run them beside each other
    while the rest of the suite fills the cores after them. ``smokes[table]`` is ``(its folder, the process)``."""

    def __init__(self, base: Path):
        self.base = Path(base)
        self.base.mkdir(parents=True, exist_ok=True)
        self.env = dict(os.environ)
        self.hub = self.base / "hf"

    def wait(self) -> SharedSmokes:
        """What the smoke tests read (as :meth:`SmokeJobs.wait`): here each result is made when first read."""
        return self

    def _locked(self, name: str):
        from filelock import FileLock

        return FileLock(str(self.base / f"{name}.lock"))

    def _build_hub(self) -> None:
        with self._locked("hub"):
            if (self.hub / ".built").exists():
                return
            jobs = SmokeJobs([], self.base, self.hub)
            jobs.env = self.env
            jobs._build_hub()
            (self.hub / ".built").write_text("")

    def __getitem__(self, table: str) -> tuple[Path, subprocess.CompletedProcess]:
        if table not in SMOKE_TABLES:
            raise KeyError(f"{table!r} has no smoke; valid: {', '.join(SMOKE_TABLES)}")
        self._build_hub()
        tmp, done = self.base / table, self.base / f"{table}.json"
        with self._locked(table):
            if not done.exists():
                tmp.mkdir(exist_ok=True)
                args = ["-m", "dp_adam_bench", "sweep", table, "--profile", "paper", "--smoke"]
                out = SmokeJobs([], self.base, self.hub)._run(args, cli_env(self.hub, tmp, self.env))
                done.write_text(json.dumps([out.args, out.returncode, out.stdout, out.stderr]))
            args, code, stdout, stderr = json.loads(done.read_text())
        return tmp, subprocess.CompletedProcess(args, code, stdout, stderr)
