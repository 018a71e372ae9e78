"""``python -m lmcache_pd.cli``: the same command as ``lmcache-pd``."""

from lmcache_pd.cli import app

app()
