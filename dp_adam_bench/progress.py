"""What a run shows while it works: a progress bar on a terminal, a log line every N steps elsewhere.

On a terminal (stderr is a TTY) training shows a tqdm bar with the ETA, the last logged loss or metric and the
epsilon spent so far under the run's accountant; evaluation, decoding and sweeps show bars of their own. Off a
terminal (CI, SLURM logs, a redirected file) there are no bars: training writes a log line when it starts, one per
logged step (``train.log_every``), and one at least every :attr:`Progress.LINE_EVERY_S` seconds whatever
``log_every`` says, each with the ETA and the epsilon named by its accountant (``epsilon (rdp)=4.729``).
``DP_ADAM_BENCH_PROGRESS`` overrides the choice: ``bar``, ``lines`` or ``off``.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterable, Iterator

log = logging.getLogger("dp_adam_bench.progress")

MODES = ("auto", "bar", "lines", "off")


def mode() -> str:
    """``bar``, ``lines`` or ``off``: the ``DP_ADAM_BENCH_PROGRESS`` setting, else bars on a terminal only."""
    chosen = os.environ.get("DP_ADAM_BENCH_PROGRESS", "auto").strip().lower() or "auto"
    if chosen not in MODES:
        raise ValueError(f"DP_ADAM_BENCH_PROGRESS={chosen!r} is not one of {', '.join(MODES)}")
    if chosen == "auto":
        return "bar" if sys.stderr.isatty() else "lines"
    return chosen


def _width() -> dict:
    """tqdm's width: the terminal's, followed as it changes. Where stderr has no width (not a terminal, or a
    pseudo-terminal that reports 0 columns, e.g. under ``script`` or some CI runners, where tqdm would print nothing:
    it hides bars beyond 0 rows), ``$COLUMNS`` or 100 columns and 20 rows."""
    try:
        if os.get_terminal_size(sys.stderr.fileno()).columns > 0:
            return {"dynamic_ncols": True}
    except (OSError, ValueError):
        pass
    columns = shutil.get_terminal_size((100, 20)).columns  # $COLUMNS, if set
    return {"ncols": columns if columns > 0 else 100, "nrows": 20}


def _shown(metrics: dict) -> dict:
    """What a progress line shows of a step's metrics: epsilon, losses and the main evaluation metrics (never the
    ``diag/`` diagnostics, which are not private outputs)."""
    keys = ("epsilon", "loss", "accuracy", "bleu", "rouge")
    return {
        k: v
        for k, v in metrics.items()
        if not k.startswith("diag/") and isinstance(v, (int, float)) and any(s in k for s in keys)
    }


class Progress:
    """Training progress from ``initial`` to ``total`` steps (see the module docstring)."""

    #: seconds between two epsilon evaluations for the bar (an accountant call can cost a fraction of a second)
    EPSILON_EVERY_S = 2.0
    #: off a terminal, the longest silence between two lines (a slow step count between logged steps)
    LINE_EVERY_S = 30.0

    def __init__(
        self,
        total: int,
        initial: int = 0,
        *,
        enabled: bool = True,
        what: str = "train",
        epsilon: Callable[[], dict] | None = None,
        accountant: str | None = None,
    ):
        """``epsilon()`` returns ``{"epsilon": value}`` so far (or {}): the bar refreshes it every few seconds,
        between the logged steps that carry it. ``accountant`` names the accountant of that epsilon, shown beside
        it (``epsilon (rdp)``)."""
        self.total, self.what = int(total), what
        self.epsilon = epsilon
        self.epsilon_key = f"epsilon ({accountant})" if accountant else "epsilon"
        self._eps_next = float("-inf")
        self.mode = mode() if enabled else "off"
        self.t0 = time.time()
        self.initial = int(initial)
        self.last: dict = {}
        self.bar = None
        if self.mode == "bar":
            from tqdm import tqdm

            self.bar = tqdm(total=self.total, initial=self.initial, desc=what, unit="step", **_width())
        self._line_at = self.t0
        if self.mode == "lines":
            log.info(
                "%s step %d/%d: training starts (a line per logged step and at least every %.0f s)",
                what,
                self.initial,
                self.total,
                self.LINE_EVERY_S,
            )

    def update(self, step: int, metrics: dict, logged: bool) -> None:
        if self.mode == "off":
            return
        shown = _shown(metrics)
        now = time.time()
        # off a terminal, a line at least every LINE_EVERY_S seconds, logged step or not
        due = self.bar is None and now - self._line_at >= self.LINE_EVERY_S
        if "epsilon" in shown:
            self._eps_next = now + self.EPSILON_EVERY_S
        elif self.epsilon is not None and (
            logged or due or step == self.total or (self.bar is not None and now >= self._eps_next)
        ):  # a non-amplified run logs no epsilon (it is spent up front): ask the ledger
            shown |= self.epsilon()
            # an accountant call can cost a fraction of a second (PRV or PLD over many steps): the bar's refreshes
            # wait at least 20 times as long as the last call took, so they stay under ~5 % of the training time
            self._eps_next = now + max(self.EPSILON_EVERY_S, 20 * (time.time() - now))
        if "epsilon" in shown:  # named by its accountant
            shown[self.epsilon_key] = shown.pop("epsilon")
        self.last |= shown
        if self.bar is not None:
            self.bar.update(step - self.bar.n)
            if shown:
                self.bar.set_postfix({k: f"{v:.4g}" for k, v in self.last.items()}, refresh=False)
        elif logged or due:
            self._line_at = now
            elapsed = now - self.t0
            done = step - self.initial
            eta = f"{elapsed / done * (self.total - step):.0f} s" if done > 0 else "unknown"
            text = " ".join(f"{k}={v:.4g}" for k, v in self.last.items())
            log.info("%s step %d/%d (%.0f s, ETA %s) %s", self.what, step, self.total, elapsed, eta, text)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def iterate(items: Iterable, *, desc: str, total: int | None = None) -> Iterator:
    """``items`` with a transient bar on a terminal (evaluation, decoding), unchanged otherwise."""
    if mode() != "bar":
        yield from items
        return
    from tqdm import tqdm

    yield from tqdm(items, desc=desc, total=total, leave=False, **_width())


class SweepProgress:
    """Runs done / total across every multirun command of a sweep, polled from the run store (the runs are child
    processes): one line on stderr each time the count changes, with the elapsed time and an ETA from the runs this
    sweep completed. ``count()`` returns the number of complete runs.

    ``setup``: for a sweep whose runs take seconds to work out (composing each run's config), a callable returning
    ``(total, count)`` that the polling thread calls before its first line, while the runs already start;
    ``total`` and ``count`` are then ignored. A ``setup`` that fails shows no lines (the sweep still runs)."""

    def __init__(
        self,
        total: int | None,
        count: Callable[[], int] | None,
        *,
        what: str = "sweep",
        every_s: float = 2.0,
        setup: Callable[[], tuple[int, Callable[[], int]]] | None = None,
    ):
        import threading

        self.what, self.every_s, self._setup = what, every_s, setup
        self.t0 = time.time()
        self.total, self.count = (0, None) if setup else (int(total), count)
        self.initial = self.done = None if setup else count()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def start(self) -> SweepProgress:
        if mode() != "off":
            if self._setup is None:
                self._report()
            self._thread.start()
        return self

    def _set_up(self) -> bool:
        try:
            total, self.count = self._setup()
        except Exception as err:  # the runs themselves will say what is wrong with their configs
            log.debug("sweep progress not counted: %s", err)
            return False
        self.total = int(total)
        self.initial = self.done = self.count()
        self._report()
        return True

    def _report(self) -> None:
        elapsed = time.time() - self.t0
        new = self.done - self.initial
        eta = f", ETA {elapsed / new * (self.total - self.done) / 60:.0f} min" if new > 0 else ""
        print(
            f"{self.what}: {self.done}/{self.total} runs complete ({elapsed / 60:.0f} min{eta})",
            file=sys.stderr,
            flush=True,
        )

    def _poll(self) -> None:
        if self._setup is not None and not self._set_up():
            return
        while not self._stop.wait(self.every_s):
            self.update()

    def update(self) -> None:
        if self.count is None:  # set-up not done (or failed): nothing to count
            return
        done = self.count()
        if done != self.done:
            self.done = done
            self._report()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            # a daemon thread: a set-up still composing the sweep's jobs does not hold up the sweep's end (Ctrl-C)
            self._thread.join(timeout=self.every_s)
        if mode() != "off":
            self.update()
