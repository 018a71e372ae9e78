"""The model names clients may ask for: every name the instances serve, the base model and each
LoRA adapter (``--lora-modules``, or loaded at run time), as vLLM's ``/v1/models`` lists them.

Learned from an instance's ``/v1/models`` at start and again when a client names one not known
yet (at most once per ``REFRESH_MIN_S``, so that names made up by a client cost the instances one
listing a second at most) or an adapter is loaded or unloaded through the proxy. A name not
served gets vLLM's own 404 at the door, before any instance computes anything; one unloaded
since the last listing reaches prefill, which answers the same 404. The same listing gives the
model's context length (``max_model_len``), which ``model_length.py`` checks requests against:
asked again (at most once per ``REFRESH_MIN_S``) while no listing has said it. The pools serve
one model at one length (the launcher starts them alike): the first instance that lists it says
it for all.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Annotated

import aiohttp
import msgspec

from lmcache_pd.proxy.routing import Upstream

logger = logging.getLogger(__name__)

REFRESH_MIN_S = 1.0


class _Card(msgspec.Struct):
    id: str
    max_model_len: Annotated[int, msgspec.Meta(ge=1)] | None = None


class _Listing(msgspec.Struct):
    data: list[_Card]


class ModelNames:
    """The names served now, as far as the last listing says."""

    def __init__(
        self,
        base: str,
        session: Callable[[], aiohttp.ClientSession],
        instances: Callable[[], list[Upstream]],
        headers: dict[str, str],
        timeout_s: float,
    ) -> None:
        """``base``: the model the pools serve, always a name; ``instances()``: those that may
        be asked for the listing (the healthy ones are)."""
        self._base = base
        self._names = frozenset({base})
        self._max_model_len: int | None = None
        self._session = session
        self._instances = instances
        self._headers = headers
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._refreshed = float("-inf")

    @property
    def base(self) -> str:
        return self._base

    async def resolve(self, name: str | None) -> str | None:
        """The served model ``name`` means (none: the base model, as vLLM takes it); None if
        it is not served: not known, nor listed by an instance asked now (unless one was asked
        less than ``REFRESH_MIN_S`` ago)."""
        if name is None or name in self._names:
            return name or self._base
        if time.monotonic() - self._refreshed < REFRESH_MIN_S:
            return None
        await self.refresh()
        return name if name in self._names else None

    async def max_model_len(self) -> int | None:
        """The model's context length as the instances list it; None while none has said (an
        instance is asked now unless one was less than ``REFRESH_MIN_S`` ago)."""
        if self._max_model_len is None and time.monotonic() - self._refreshed >= REFRESH_MIN_S:
            await self.refresh()
        return self._max_model_len

    async def refresh(self) -> None:
        """Learn the names from the first healthy instance that lists them; keep what was known
        if none does."""
        self._refreshed = time.monotonic()
        for member in [m for m in self._instances() if m.healthy]:
            try:
                async with self._session().get(
                    f"{member.url}/v1/models", headers=self._headers, timeout=self._timeout
                ) as response:
                    if response.status != 200:
                        continue
                    listing = msgspec.json.decode(await response.read(), type=_Listing)
            except (aiohttp.ClientError, TimeoutError, msgspec.DecodeError) as exc:
                logger.warning("model names: %s did not list them: %r", member.url, exc)
                continue
            self._names = frozenset({self._base, *(card.id for card in listing.data)})
            # The base model's card first; any other (an adapter's) has the same length.
            cards = sorted(listing.data, key=lambda card: card.id != self._base)
            lengths = [card.max_model_len for card in cards if card.max_model_len]
            self._max_model_len = lengths[0] if lengths else self._max_model_len
            return
