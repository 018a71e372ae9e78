"""What the command modules share: the typer app, logging, the pools file with its model, and
SIGTERM that unwinds like Ctrl-C."""

from __future__ import annotations

import contextlib
import logging
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path

import typer
from rich.logging import RichHandler

from lmcache_pd.deploy.pools import PoolsConfig, load_pools
from lmcache_pd.keys import ChunkKeyer

app = typer.Typer(
    no_args_is_help=True,
    add_completion=False,
    help="lmcache-pd: disaggregated prefill/decode KV transfer for vLLM over NIXL.",
)
# Default configs of a checkout (the wheel ships none: name them on the command line).
CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(), format="%(name)s: %(message)s", handlers=[RichHandler()]
    )


def pools_and_model(pools: Path, workdir: Path | None) -> tuple[PoolsConfig, Path]:
    """The pools config, with its model built first if it is not there yet."""
    from lmcache_pd.harness.model_maker import ensure_model

    settings = load_pools(pools)
    ensure_model(Path(settings.model))
    return settings, workdir or Path(tempfile.mkdtemp(prefix="lmcache-pd-serve-"))


@contextlib.contextmanager
def terminate_on_sigterm() -> Iterator[None]:
    """SIGTERM unwinds like Ctrl-C, so that every ``with`` block stops what it started."""

    def interrupt(*_: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def keyer(chunk_size: int, model_name: str, kv_dtype: str) -> ChunkKeyer:
    """The chunk keys of a one-rank instance (the standalone consumer, the transfer demo)."""
    return ChunkKeyer(
        model_name=model_name, world_size=1, worker_id=0, kv_dtype=kv_dtype, chunk_size=chunk_size
    )
