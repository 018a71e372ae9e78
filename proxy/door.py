"""The proxy's door: who may call its endpoints (the clients' key) and how many requests it
serves at once (the admission limit), both decided before a request's body is read.

A client without the key gets 401, one past ``max_in_flight`` gets 503 with ``Retry-After``,
each an OpenAI-shaped error body, counted by reason. ``/health`` and ``/metrics`` stay open:
probes and scrapers carry no key, and a full proxy must still say how it is.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from aiohttp import web

from lmcache_pd.bearer import BearerKey
from lmcache_pd.proxy.responses import error_response

logger = logging.getLogger(__name__)

# Probes and scrapers carry no key; every other path asks for it.
OPEN_PATHS = frozenset({"/health", "/metrics"})
# What a client refused for a full proxy is told to wait: requests end in seconds.
RETRY_AFTER_S = 1

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class Door:
    """An aiohttp middleware (new style) that checks the key and counts requests in flight."""

    __middleware_version__ = 1

    def __init__(self, key: str | None, max_in_flight: int, refused: Callable[[str], None]) -> None:
        """``key``: what clients must send as ``Authorization: Bearer KEY`` (None: nothing);
        ``refused`` counts a refusal by its reason (``unauthorized``, ``over_capacity``)."""
        self._key = None if key is None else BearerKey(key)
        self._max_in_flight = max_in_flight
        self._refused = refused
        self.in_flight = 0
        self._full = False

    async def __call__(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path in OPEN_PATHS:
            return await handler(request)
        if self._key is not None and not self._key.admits(request.headers.get("Authorization", "")):
            self._refused("unauthorized")
            logger.info("refused %s from %s: no valid API key", request.path, request.remote)
            response = error_response(
                "a valid API key is needed (Authorization: Bearer KEY)", "AuthenticationError", 401
            )
            response.headers["WWW-Authenticate"] = "Bearer"
            return response
        if self.in_flight >= self._max_in_flight:
            self._refused("over_capacity")
            if not self._full:  # one line per spell, not one per refusal
                logger.warning(
                    "%d requests in flight (max_in_flight): refusing more with 503",
                    self.in_flight,
                )
            self._full = True
            response = error_response(
                f"the proxy is serving as many requests as it takes ({self._max_in_flight}); "
                f"retry after {RETRY_AFTER_S} s",
                "ServiceUnavailable",
                503,
            )
            response.headers["Retry-After"] = str(RETRY_AFTER_S)
            return response
        if self._full:
            logger.info("below max_in_flight again: taking requests")
            self._full = False
        self.in_flight += 1
        try:
            return await handler(request)
        finally:
            self.in_flight -= 1
