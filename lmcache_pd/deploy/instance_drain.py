"""An instance's drain on SIGTERM, inside its vLLM API server: leave routing at once, finish the
requests it has, then let vLLM stop.

vLLM 0.32 on SIGTERM (``vllm/entrypoints/launchers/launcher.py``) stops its engine, draining the
engine's requests for ``--shutdown-timeout`` seconds (0, its default, aborts them), while its HTTP
server goes on accepting: ``/health`` answers 200 throughout, so no router stops sending, and a
request that arrives after the engine stopped is never answered (measured: it held the server's
exit until the client gave up). What this adds, run by ``InstanceKeyGuard``, which sees every
request: on SIGTERM ``/health`` answers 503 saying draining (the proxy's health checker marks the
instance down within one interval), every new request gets 503, and vLLM's own shutdown starts
once the requests already admitted have been answered, or after ``--shutdown-timeout`` seconds
(the drain's one setting: ``drain_timeout_s`` of the pools file). vLLM's engine then drains what
is left, a prefill's pushes too (it steps while the connector has pushes outstanding), for up to
the same time again.
"""

from __future__ import annotations

import asyncio
import logging
import signal

from lmcache_pd.process_logs import show_our_logs

logger = logging.getLogger(__name__)


def vllm_shutdown_timeout_s(app: object) -> float:
    """vLLM's ``--shutdown-timeout`` from the app vLLM built (0 where the app holds no engine)."""
    engine = getattr(getattr(app, "state", None), "engine_client", None)
    return float(getattr(getattr(engine, "vllm_config", None), "shutdown_timeout", 0) or 0)


class Drain:
    """Requests in flight through the guard, and whether the server is draining."""

    def __init__(self) -> None:
        self.draining = False
        self.in_flight = 0
        self.timeout_s = 0.0
        self._idle = asyncio.Event()
        self._idle.set()
        self._task: asyncio.Task[None] | None = None

    def listen(self, app: object) -> None:
        """Take SIGTERM over from vLLM: called at the app's lifespan startup, when vLLM's own
        handler is installed (``serve_http`` adds it before its server starts), so that this one
        replaces it; vLLM's shutdown is reached through SIGINT, which it handles alike."""
        self.timeout_s = vllm_shutdown_timeout_s(app)
        show_our_logs("INFO")
        try:
            asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, self.begin)
        except (NotImplementedError, RuntimeError, ValueError) as exc:  # not the main thread
            logger.warning("no drain on SIGTERM here: %s", exc)

    def begin(self) -> None:
        """Start draining (once): from now on the guard refuses new requests."""
        if self.draining:
            return
        self.draining = True
        logger.info(
            "SIGTERM: draining, %d request(s) in flight, for up to %.0f s; /health answers 503",
            self.in_flight,
            self.timeout_s,
        )
        self._task = asyncio.get_running_loop().create_task(self._stop_when_idle())

    def enter(self) -> None:
        self.in_flight += 1
        self._idle.clear()

    def leave(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle.set()

    async def _stop_when_idle(self) -> None:
        if self.in_flight:
            try:
                await asyncio.wait_for(self._idle.wait(), self.timeout_s)
                logger.info("drained: no request left; stopping")
            except TimeoutError:
                logger.warning(
                    "drain_timeout_s (%.0f s) passed with %d request(s) in flight; stopping",
                    self.timeout_s,
                    self.in_flight,
                )
        signal.raise_signal(signal.SIGINT)  # vLLM's own shutdown
