"""An aiohttp application served on its own event loop in a thread of the calling process.

For programs that drive an app and talk to it from the same process: the demo and benchmarks
run the proxy this way, the tests their stand-in upstreams. ``lmcache-pd serve`` and
``lmcache-pd proxy`` do not: they run the proxy on the main thread's loop.
"""

from __future__ import annotations

import asyncio
import threading

from aiohttp import web

from lmcache_pd.proxy.app import Proxy
from lmcache_pd.proxy.config import ProxyConfig
from lmcache_pd.proxy.membership import MemberSource


class AppThread:
    """An aiohttp app on its own event loop in a thread of this process (the demo, tests and
    stand-ins); a context manager that stops it on exit."""

    START_TIMEOUT_S = 10.0
    # How long leaving waits for the app's thread to clean up and end.
    JOIN_TIMEOUT_S = 10.0

    def __init__(
        self, app: web.Application, host: str, port: int, start_timeout_s: float | None = None
    ) -> None:
        """``start_timeout_s``: how long the app may take to listen (its start-up hooks
        included; default ``START_TIMEOUT_S``)."""
        self.url = f"http://{host}:{port}"
        self._start_timeout_s = start_timeout_s or self.START_TIMEOUT_S
        self._app, self._host, self._port = app, host, port
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="aiohttp-app", daemon=True)

    def _run(self) -> None:
        async def main() -> None:
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            runner = web.AppRunner(self._app, access_log=None, handler_cancellation=True)
            await runner.setup()
            try:
                await web.TCPSite(runner, self._host, self._port).start()
                self._ready.set()
                await self._stop.wait()
            finally:
                await runner.cleanup()

        asyncio.run(main())

    def __enter__(self) -> AppThread:
        self._thread.start()
        if not self._ready.wait(self._start_timeout_s):
            raise TimeoutError(f"{self.url} not listening after {self._start_timeout_s} s")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(self.JOIN_TIMEOUT_S)


def proxy_thread(config: ProxyConfig, members: MemberSource | None = None) -> AppThread:
    """The proxy of ``config`` in a thread of this process (the demo, benchmarks, tests). Its
    start-up asks every instance's /health once (each call bounded by ``timeouts.health_s``):
    on a loaded host that alone can take longer than a plain app's start."""
    start_timeout_s = AppThread.START_TIMEOUT_S + config.timeouts.health_s
    return AppThread(Proxy(config, members).app(), config.host, config.port, start_timeout_s)
