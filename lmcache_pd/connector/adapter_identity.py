"""A LoRA adapter's identity in chunk keys: its name, its path and a digest of its files.

vLLM keys its own prefix cache by an adapter's name and path (``("lora", name, path)`` among a
block's extra keys, ``kv_cache_utils._gen_lora_extra_hash_keys``): within one instance a name
and a path load one set of weights. Between instances they need not: two hosts may hold other
files under one path, or a file may be replaced between starts, and with name and path alone one
adapter's KV would be loaded for another's request, a wrong answer with HTTP 200. So chunk keys
also carry what the files hold: a BLAKE2b digest of the files vLLM reads (``adapter_config.json``
and the weights, ``vllm/lora/lora_model.py``), each by name, length and content, the same on
every host that holds the same files.

A digest is computed once per path per process, on the one thread this object owns, never on
vLLM's scheduler loop, which only reads the answer from memory: while it is read a request for
the adapter is ``PENDING`` and waits in vLLM's queue (the scheduler halves answer "ask again next
step"). The read is bounded in bytes and time (``ADAPTER_DIGEST_MAX_BYTES``,
``ADAPTER_DIGEST_TIMEOUT_S``); an adapter that cannot be read so (a Hugging Face id rather than
a folder, missing files, too large, too slow) is ``UNREADABLE``, and its requests are served
without disaggregation. Not seen, as vLLM's own prefix cache does not see it either: an adapter
reloaded in place (``load_inplace``) from the same path with other files.
"""

from __future__ import annotations

import enum
import hashlib
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from lmcache_pd.protocol import (
    ADAPTER_DIGEST_MAX_BYTES,
    ADAPTER_DIGEST_TIMEOUT_S,
    MAX_ADAPTER_PATHS,
)

logger = logging.getLogger(__name__)

# What vLLM reads of a PEFT adapter folder: its config, then the first weights file found.
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILES = ("adapter_model.safetensors", "adapter_model.bin", "adapter_model.pt")
READ_BYTES = 1 << 20  # per read: the stop flag and the deadline are checked between reads
DIGEST_BYTES = 16


class AdapterState(enum.Enum):
    """An adapter whose identity is not (yet) a string."""

    PENDING = "pending"  # its files are being read
    UNREADABLE = "unreadable"  # they could not be: no KV is shared for it


# A request's adapter as chunk keys take it: None for the base model.
AdapterScope = str | AdapterState | None


class UnreadableAdapter(Exception):
    """An adapter's files could not be read for its digest within the bounds."""


class AdapterIdentities:
    """Each adapter path's digest, read once on an owned thread; used by one scheduler thread."""

    def __init__(
        self,
        *,
        max_bytes: int = ADAPTER_DIGEST_MAX_BYTES,
        timeout_s: float = ADAPTER_DIGEST_TIMEOUT_S,
        max_paths: int = MAX_ADAPTER_PATHS,
    ) -> None:
        self._max_bytes, self._timeout_s, self._max_paths = max_bytes, timeout_s, max_paths
        self._digests: dict[str, Future[str | None]] = {}
        self._stop = threading.Event()
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="lmcache-pd-adapter-digest")

    def of(self, request: Any) -> AdapterScope:
        """``request``'s adapter (vLLM's ``Request.lora_request``) as chunk keys take it: its
        name, path and digest; None for the base model; ``PENDING`` while its files are read
        (the first request for a path starts the read), ``UNREADABLE`` if they could not be."""
        lora = getattr(request, "lora_request", None)
        if lora is None:
            return None
        path = str(lora.lora_path)
        future = self._digests.get(path)
        if future is None:
            self._forget_oldest_read()
            future = self._digests[path] = self._reader.submit(self._read, path)
        if not future.done():
            return AdapterState.PENDING
        digest = future.result()
        if digest is None:
            return AdapterState.UNREADABLE
        return f"{lora.lora_name}\0{path}\0{digest}"

    def close(self) -> None:
        """Stop a read in progress (at its next block) and join the thread."""
        self._stop.set()
        self._reader.shutdown(wait=True, cancel_futures=True)

    def _forget_oldest_read(self) -> None:
        if len(self._digests) >= self._max_paths:
            oldest = next((p for p, f in self._digests.items() if f.done()), None)
            if oldest is not None:
                del self._digests[oldest]

    def _read(self, path: str) -> str | None:
        """The digest of the adapter at ``path``; None (logged) if it cannot be read."""
        started = time.monotonic()
        try:
            digest = folder_digest(
                Path(path), self._max_bytes, started + self._timeout_s, self._stop
            )
        except (OSError, UnreadableAdapter) as exc:
            logger.warning(
                "LoRA adapter %s: cannot read its files for its chunk keys (%s); its requests "
                "are served without disaggregation",
                path,
                exc,
            )
            return None
        logger.info(
            "LoRA adapter %s: digest %s read in %.3f s", path, digest, time.monotonic() - started
        )
        return digest


def folder_digest(
    folder: Path, max_bytes: int, deadline: float, stop: threading.Event | None = None
) -> str:
    """A hex digest of the adapter files in ``folder``: its config and its first weights file
    (as vLLM looks for them), each by name, length and content. ``UnreadableAdapter`` when
    either is missing, past ``max_bytes`` in all, or not read by ``deadline`` (monotonic), or
    when ``stop`` is set; ``OSError`` as the files raise it."""
    weights = next((folder / n for n in WEIGHTS_FILES if (folder / n).is_file()), None)
    if not (folder / CONFIG_FILE).is_file() or weights is None:
        raise UnreadableAdapter(f"no {CONFIG_FILE} and adapter_model.* in {folder}")
    files = [folder / CONFIG_FILE, weights]
    if (total := sum(file.stat().st_size for file in files)) > max_bytes:
        raise UnreadableAdapter(f"{total} bytes, over {max_bytes}")
    digest = hashlib.blake2b(digest_size=DIGEST_BYTES, person=b"lora files")
    read = 0
    for file in files:
        name = file.name.encode()
        digest.update(len(name).to_bytes(4, "little") + name)
        start = read
        with file.open("rb") as handle:
            while block := handle.read(READ_BYTES):
                read += len(block)
                if read > max_bytes or time.monotonic() > deadline or (stop and stop.is_set()):
                    raise UnreadableAdapter(f"{file} not read within {max_bytes} bytes in time")
                digest.update(block)
        digest.update((read - start).to_bytes(8, "little"))  # where this file's bytes end
    return digest.hexdigest()
