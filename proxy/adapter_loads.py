"""LoRA adapters loaded at run time through the proxy, loaded again on an instance that comes
back up without them (``serve`` restarted it: its command line names only ``--lora-modules``).

The proxy sends ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` to every instance
(``forwarding.py``); what every instance took is recorded here, the load's own body by the
adapter's name (a later load of the name replaces it, an unload forgets it). When the health
checker finds an instance that was down answering again, it asks here before it marks it up:
the instance's ``/v1/models`` is read, and each recorded adapter it does not list is loaded on it
with the recorded body. An instance that refuses or fails one stays down (the next health round
tries again), so no request for a runtime adapter reaches an instance without it. Kept in the
proxy's memory: a proxy started again knows none (the instances still serve what they had).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import aiohttp
import msgspec

from lmcache_pd.proxy.routing import Upstream

logger = logging.getLogger(__name__)

LOAD_PATH = "/v1/load_lora_adapter"
UNLOAD_PATH = "/v1/unload_lora_adapter"


class _AdapterCall(msgspec.Struct):
    lora_name: str


class _Card(msgspec.Struct):
    id: str


class _Listing(msgspec.Struct):
    data: list[_Card]


class AdapterLoads:
    """The runtime loads every instance took, and their replay to an instance back up."""

    def __init__(
        self,
        session: Callable[[], aiohttp.ClientSession],
        headers: dict[str, str],
        timeout_s: float,
        on_failure: Callable[[], None],
    ) -> None:
        """``headers``: the instances' key; ``timeout_s``: each call's deadline;
        ``on_failure``: counts a replay that failed."""
        self._session = session
        self._headers = {**headers, "Content-Type": "application/json"}
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._on_failure = on_failure
        self._loads: dict[str, bytes] = {}  # adapter name -> its load's body

    def done(self, path: str, body: bytes) -> None:
        """Every instance took the load or unload ``body`` sent to ``path``."""
        try:
            name = msgspec.json.decode(body, type=_AdapterCall).lora_name
        except msgspec.DecodeError:  # vLLM took it: a body of another shape, not replayed
            logger.warning("%s: an accepted body without lora_name; not replayed", path)
            return
        if path == LOAD_PATH:
            self._loads[name] = body
        else:
            self._loads.pop(name, None)

    async def replay(self, member: Upstream) -> bool:
        """Whether ``member`` serves every recorded adapter, loading those it lacks."""
        if not self._loads:
            return True
        try:
            async with self._session().get(
                f"{member.url}/v1/models", headers=self._headers, timeout=self._timeout
            ) as response:
                listing = msgspec.json.decode(await response.read(), type=_Listing)
            served = {card.id for card in listing.data}
            for name, body in list(self._loads.items()):  # loads may come meanwhile
                if name in served:
                    continue
                async with self._session().post(
                    f"{member.url}{LOAD_PATH}",
                    data=body,
                    headers=self._headers,
                    timeout=self._timeout,
                ) as response:
                    answer = await response.text()
                if response.status != 200:
                    raise ValueError(f"{name}: {response.status} {answer[:300]!r}")
                logger.info("%s: runtime LoRA adapter %s loaded again", member.url, name)
        except (aiohttp.ClientError, TimeoutError, msgspec.DecodeError, ValueError) as exc:
            self._on_failure()
            logger.warning(
                "%s instance %s stays down: its runtime LoRA adapters not loaded again: %r",
                member.role.value,
                member.url,
                exc,
            )
            return False
        return True
