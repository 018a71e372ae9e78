"""Helpers shared by the tests: free ports, configs, specs, chunks of known bytes, waits."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import torch
import yaml

from lmcache_pd.config import PDConfig, load_config
from lmcache_pd.deploy.launcher import unused_port
from lmcache_pd.keys import ChunkKey, ChunkKeyer
from lmcache_pd.protocol import DisaggSpec
from lmcache_pd.transfer.sender import SenderPool
from lmcache_pd.transfer.sender_jobs import PushJob, Saving
from lmcache_pd.transfer.staging import Staging

CHUNK_SIZE = 256
BYTES_PER_TOKEN = 512  # 128 float32 values a token: a page is 128 KiB
PAGE_BYTES = CHUNK_SIZE * BYTES_PER_TOKEN


# Every port ``free_port`` handed out in this process, so that none is handed out twice.
_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A port nobody listens on, below the kernel's ephemeral range (as the launcher picks its
    instances'): a test often binds it only after instances started, and an ephemeral port can go
    to one of their connections meanwhile (seen: the MLA test's proxy, 40 s after its pick)."""
    return unused_port(_HANDED_OUT)


def make_keyer(
    *,
    model_name: str = "demo",
    world_size: int = 1,
    worker_id: int = 0,
    kv_dtype: str = "float32",
    chunk_size: int = CHUNK_SIZE,
) -> ChunkKeyer:
    """A chunk keyer; by default keyed as the test producers (in this process or a child) key
    their chunks."""
    return ChunkKeyer(
        model_name=model_name,
        world_size=world_size,
        worker_id=worker_id,
        kv_dtype=kv_dtype,
        chunk_size=chunk_size,
    )


def write_config(directory: Path, name: str, **fields: object) -> Path:
    path = directory / f"{name}.yaml"
    path.write_text(yaml.safe_dump(fields))
    return path


def consumer_fields(num_pages: int = 64, **overrides: object) -> dict[str, object]:
    return {
        "kv_role": "kv_consumer",
        "chunk_size": CHUNK_SIZE,
        "page_bytes": PAGE_BYTES,
        "buffer_size_bytes": num_pages * PAGE_BYTES,
        "init_port": free_port(),
        "alloc_port": free_port(),
        # Transfer tests push the same token ranges again and again, each expecting them written:
        # the cache of landed chunks is off unless a test is about it.
        "cache_share": 0.0,
        **overrides,
    }


def producer_config(num_pages: int = 64, **overrides: object) -> PDConfig:
    return load_config(
        None,
        environ={},
        kv_role="kv_producer",
        chunk_size=CHUNK_SIZE,
        page_bytes=PAGE_BYTES,
        buffer_size_bytes=num_pages * PAGE_BYTES,
        **overrides,
    )


def spec_for(consumer: PDConfig | dict, req_id: str) -> DisaggSpec:
    get = consumer.get if isinstance(consumer, dict) else consumer.__getattribute__
    return DisaggSpec(
        req_id=req_id,
        receiver_host="127.0.0.1",
        receiver_init_port=get("init_port"),
        receiver_alloc_port=get("alloc_port"),
    )


def make_chunks(keys: list[ChunkKey], seed: int) -> list[tuple[bytes, torch.Tensor]]:
    """A float32 tensor of random values per chunk, one row of BYTES_PER_TOKEN a token."""
    generator = torch.Generator().manual_seed(seed)
    return [
        (k.key, torch.randn(k.end - k.start, BYTES_PER_TOKEN // 4, generator=generator))
        for k in keys
    ]


def submit_push(
    pool: SenderPool, staging: Staging, request: Saving, chunks: list[tuple[bytes, torch.Tensor]]
) -> None:
    """Stage ``chunks`` as the producer worker does (each in a page of ``staging``) and hand
    them to ``pool`` as one push of ``request``."""
    pages = staging.pages(len(chunks))
    staged = []
    for (key, tensor), page in zip(chunks, pages.__enter__(), strict=True):
        data = tensor.view(-1).view(torch.uint8)
        staged.append((key, page[: data.numel()].copy_(data)))
    pool.submit(PushJob(request, staged, pages, time.time()))


def wait_for(
    predicate,
    timeout_s: float = 5.0,
    what: str = "condition",
    explain: Callable[[], object] | None = None,
) -> None:
    """Poll ``predicate`` until true; fail the test at the deadline, with what ``explain``
    returns then (the counters that say why, read once it has failed)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            why = "" if explain is None else f"; then: {explain()}"
            pytest.fail(f"timed out after {timeout_s} s waiting for {what}{why}")
        time.sleep(0.005)


def metric_sample(url: str, name: str, **labels: str) -> float:
    """One sample of ``url``'s ``/metrics``, with exactly ``labels`` (0 if absent)."""
    text = httpx.get(f"{url}/metrics", timeout=5).text
    wanted = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        sample, _, value = line.rpartition(" ")
        if sample == (f"{name}{{{wanted}}}" if labels else name):
            return float(value)
    return 0.0
