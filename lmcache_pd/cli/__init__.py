"""The ``lmcache-pd`` command: serve pools behind the proxy, run the proxy or a consumer rank
alone, the demos, make the tiny model, and write a pools file's Kubernetes manifests.

The top of the library: each command module registers its commands on ``app``.
"""

from lmcache_pd.cli import demos, serving, tools
from lmcache_pd.cli.common import app

__all__ = ["app", "demos", "serving", "tools"]
