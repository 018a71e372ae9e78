"""Our log lines inside a vLLM process: vLLM configures only its own loggers."""

from __future__ import annotations

import logging


def show_our_logs(level: str) -> None:
    """Give the ``lmcache_pd`` loggers a handler in a process vLLM runs (its engine, its API
    server): without one ours would be silent there, and a request that fell back to recompute,
    or an instance's drain, would leave no trace in its log."""
    ours = logging.getLogger("lmcache_pd")
    if not ours.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(
            logging.Formatter(
                "(lmcache-pd pid=%(process)d) %(asctime)s.%(msecs)03d %(levelname)s %(name)s: "
                "%(message)s",
                datefmt="%m-%d %H:%M:%S",
            )
        )
        ours.addHandler(handler)
        ours.setLevel(level)
        ours.propagate = False
