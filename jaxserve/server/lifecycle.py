"""The server's stage from process start to exit, as ``GET /ready`` reports it.

  loading    the port answers; weights are being read (``/health`` 200, ``/ready`` 503)
  compiling  step programs are compiling; ``progress`` is the fraction compiled
  ready      every program compiled and one probe step ran (``/ready`` 200)
  draining   a SIGTERM started the drain (``/ready`` 503 again until the process exits)

The start-up thread moves it forward (``compiling``, ``set_ready``) while the event loop reads
``status()``; each update is one attribute assignment of immutable values, so a reader sees
either the old or the new state.
"""

from __future__ import annotations

import time

import msgspec

STAGES = ("loading", "compiling", "ready", "draining")


class ReadyStatus(msgspec.Struct):
    """The body of ``GET /ready``.

    Fields:
      stage: one of ``STAGES``.
      progress: 0-1; loading 0, compiling the fraction of step programs compiled, ready 1,
        draining the fraction of ``--shutdown-timeout`` used.
      elapsed_s: seconds since start-up began (draining: since the drain began).
      eta_s: seconds left until ready (compiling, from the compile rate so far), or until the
        drain timeout (draining: an upper bound); None when unknown (loading), 0 when ready.
    """

    stage: str
    progress: float
    elapsed_s: float
    eta_s: float | None


class Lifecycle:
    """The stage and its progress (module docstring).

    Args:
      ready: start in stage "ready" (the engine was started before the server).
      started: when start-up began (``time.monotonic()`` seconds; default: now): the one
        clock of every "ready" figure the server logs and exports (``ready_s``).
    """

    def __init__(self, ready: bool = False, started: float | None = None) -> None:
        self.started = time.monotonic() if started is None else started
        # (stage, programs compiled, programs in all, when compiling began, drain timeout s)
        self._state: tuple[str, int, int, float, float] = (
            "ready" if ready else "loading", 0, 0, self.started, 0.0)
        self.ready_s: float | None = 0.0 if ready else None  # start-up to ready, seconds

    @property
    def stage(self) -> str:
        return self._state[0]

    @property
    def ready(self) -> bool:
        """True in stage "ready" only (the model endpoints are open)."""
        return self._state[0] == "ready"

    def compiling(self, done: int, total: int) -> None:
        """``done`` of ``total`` step programs compiled (the start-up thread calls it)."""
        stage, _, _, since, _ = self._state
        if stage == "loading":
            stage, since = "compiling", time.monotonic()
        if stage == "compiling":
            self._state = (stage, done, total, since, 0.0)

    def startup_done(self) -> float:
        """The start-up work finished: fixes ``ready_s`` (seconds from ``started``), the number
        the start-up lines print and ``set_ready`` keeps, and returns it."""
        if self.ready_s is None:
            self.ready_s = time.monotonic() - self.started
        return self.ready_s

    def set_ready(self) -> None:
        """Start-up finished (unless a drain has begun); ``ready_s`` is ``startup_done``'s if
        it was called, else now."""
        if self._state[0] in ("loading", "compiling"):
            self.startup_done()
            self._state = ("ready", 0, 0, self.started, 0.0)

    def start_drain(self, timeout_s: float) -> None:
        """The drain began; it lasts at most ``timeout_s`` (plus the abort grace)."""
        if self._state[0] != "draining":
            self._state = ("draining", 0, 0, time.monotonic(), timeout_s)

    def status(self) -> ReadyStatus:
        """The stage, its progress, the time spent and the time left (``ReadyStatus``)."""
        stage, done, total, since, timeout_s = self._state
        now = time.monotonic()
        elapsed, eta = now - self.started, None
        if stage == "loading":
            frac = 0.0
        elif stage == "compiling":
            frac = done / total if total else 1.0
            eta = (now - since) * (total - done) / done if done else None
        elif stage == "ready":
            frac, eta = 1.0, 0.0
        else:
            elapsed = now - since
            frac = min(1.0, elapsed / timeout_s) if timeout_s > 0 else 1.0
            eta = max(0.0, timeout_s - elapsed)
        return ReadyStatus(stage, round(frac, 4), round(elapsed, 3),
                           None if eta is None else round(eta, 3))
