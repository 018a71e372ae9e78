"""The vLLM KV connector: the only package of lmcache-pd that imports vLLM.

vLLM loads it as ``"kv_connector_module_path": "lmcache_pd.connector"`` and takes
``LMCachePDConnector`` from it (or ``LMCacheConnectorV1``, the name an LMCache PD deployment
asks for: the same class, reading that deployment's configuration, ``lmcache_config.py``); the
class lives in ``facade.py`` and is resolved on first access, so importing a light module of
this package (``metadata``, ``stats``) does not load the facade, its halves, torch and the
transfer core with it.

Reading order: ``facade.py`` (every hook, when vLLM calls it, who it delegates to), then
``scheduler.py`` and ``worker.py`` / ``consumer_worker.py`` (the two halves), ``metadata.py``
(what the scheduler ships to the workers each step), ``stats.py`` (counters on vLLM's
``/metrics``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lmcache_pd.connector.facade import LMCachePDConnector
    from lmcache_pd.connector.facade import LMCachePDConnector as LMCacheConnectorV1

__all__ = ["LMCacheConnectorV1", "LMCachePDConnector"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from lmcache_pd.connector.facade import LMCachePDConnector

        return LMCachePDConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
