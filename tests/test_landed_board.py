"""The landed board: a fixed-size shared-memory seqlock the consumer posts on and decode's
scheduler reads (``landed_board.py``), and the consumer's serving loop that posts on it without
touching the file system. Fast lane: no process is started (reader and writer share this one)."""

from __future__ import annotations

import mmap
import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from lmcache_pd.config import load_config
from lmcache_pd.deploy import vllm_server
from lmcache_pd.keys import ChunkKeyer
from lmcache_pd.protocol import MAX_BOARD_ENTRIES, MAX_CHUNKS_PER_REQUEST, MAX_REQ_ID_CHARS
from lmcache_pd.transfer import landed_board
from lmcache_pd.transfer.consumer import Consumer
from lmcache_pd.transfer.fake_channel import FakeChannel, FakeFabric
from lmcache_pd.transfer.landed_board import (
    BOARD_BYTES,
    PAYLOAD_AT,
    READ_TRIES,
    BoardReader,
    BoardWriter,
)
from lmcache_pd.transfer.landed_keys import KeysReader, KeysWriter, keys_path
from lmcache_pd.transfer.producer import Producer
from tests.helpers import consumer_fields, make_chunks, producer_config, spec_for, wait_for


@pytest.fixture
def board(tmp_path: Path) -> Iterator[BoardWriter]:
    writer = BoardWriter(tmp_path / "board")
    yield writer
    writer.close()


def test_a_post_reads_back_whole_and_in_order(board: BoardWriter) -> None:
    reader = BoardReader(board.path)
    assert reader.read() == {}  # made empty
    board.post({"b": 2, "a": 1})
    assert list(reader.read().items()) == [("b", 2), ("a", 1)]
    board.post({"c": 4})  # a shorter post after a longer one: the old tail is not read
    assert reader.read() == {"c": 4}
    assert landed_board.read(board.path) == {"c": 4}  # the one-shot read, for tests and tools
    reader.close()


def test_the_board_is_one_fixed_size_file_made_whole(tmp_path: Path) -> None:
    path = tmp_path / "board"
    writer = BoardWriter(path)
    assert path.stat().st_size == BOARD_BYTES
    assert BOARD_BYTES % mmap.PAGESIZE == 0
    assert [p.name for p in tmp_path.iterdir()] == ["board"]  # no scratch file left
    writer.close()


def test_a_full_board_of_the_longest_request_ids_fits_untruncated(board: BoardWriter) -> None:
    """Sized from the protocol: MAX_BOARD_ENTRIES requests, each id of MAX_REQ_ID_CHARS
    characters of 4 UTF-8 bytes each."""
    longest = "\U0001f600" * (MAX_REQ_ID_CHARS - 8)
    landed = {f"{index:08d}{longest}": MAX_CHUNKS_PER_REQUEST for index in range(MAX_BOARD_ENTRIES)}
    board.post(landed)
    assert board.truncated_posts == 0
    assert landed_board.read(board.path) == landed


def test_a_post_too_large_keeps_the_leading_entries_that_fit(tmp_path: Path) -> None:
    writer = BoardWriter(tmp_path / "small", size=PAYLOAD_AT + 64)
    landed = {f"request-{index}": index for index in range(20)}  # ~12 bytes an entry
    writer.post(landed)
    kept = landed_board.read(writer.path)
    assert 0 < len(kept) < len(landed)
    assert list(kept.items()) == list(landed.items())[: len(kept)]  # held longest first
    assert writer.truncated_posts == 1
    writer.post({"x": 1})  # fits again
    assert landed_board.read(writer.path) == {"x": 1}
    writer.close()


def test_a_reader_that_finds_a_post_under_way_reads_nothing_after_its_tries(
    board: BoardWriter, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A writer stopped mid-post (odd generation) is not waited for: the load is then
    asynchronous. The reader tries READ_TRIES times, then gives up."""
    board.post({"r": 3})
    with open(board.path, "r+b") as file, mmap.mmap(file.fileno(), 0) as raw:
        generation = int.from_bytes(raw[:8], "little")
        raw[:8] = (generation + 1).to_bytes(8, "little")  # as a writer between its two stores
        tries = []
        header = landed_board._HEADER
        monkeypatch.setattr(
            landed_board,
            "_HEADER",
            type(
                "Counting",
                (),
                {"unpack_from": lambda _, *a: tries.append(1) or header.unpack_from(*a)},
            )(),
        )
        assert BoardReader(board.path).read() == {}
        assert len(tries) == READ_TRIES
        monkeypatch.undo()
        raw[:8] = generation.to_bytes(8, "little")  # the post completed
        assert BoardReader(board.path).read() == {"r": 3}


def test_a_torn_payload_whose_generation_looks_whole_reads_nothing(board: BoardWriter) -> None:
    """On weakly ordered memory a reader could see an even generation and a half-written
    payload: the CRC catches it."""
    board.post({"request": 5})
    with open(board.path, "r+b") as file, mmap.mmap(file.fileno(), 0) as raw:
        raw[PAYLOAD_AT + 2] ^= 0xFF
    assert landed_board.read(board.path) == {}


def test_a_missing_board_reads_nothing_until_it_is_made(tmp_path: Path) -> None:
    path = tmp_path / "later"
    reader = BoardReader(path)
    assert reader.read() == {}
    path.write_bytes(b"")  # a file too short to be a board
    assert reader.read() == {}
    writer = BoardWriter(path)
    writer.post({"r": 1})
    assert reader.read() == {"r": 1}  # mapped once it exists
    writer.close()
    reader.close()


def test_closing_removes_the_board_and_a_reader_that_mapped_it_reads_nothing(
    tmp_path: Path,
) -> None:
    path = tmp_path / "board"
    first = BoardWriter(path)
    first.post({"r": 2})
    reader = BoardReader(path)
    assert reader.read() == {"r": 2}
    first.close()
    first.close()  # idempotent
    first.post({"late": 1})  # after close: nothing, no error
    assert not path.exists()
    assert reader.read() == {}
    second = BoardWriter(path)  # a consumer started again at the same path
    second.post({"s": 1})
    assert reader.read() == {"s": 1}
    second.close()


# ---- the landed keys board ----


def test_the_keys_board_reads_each_post_once_and_nothing_once_closed(tmp_path: Path) -> None:
    writer = KeysWriter(tmp_path / "keys", max_keys=4)
    reader = KeysReader(tmp_path / "keys")
    assert reader.changed() == set()  # made empty
    assert reader.changed() is None  # nothing posted since
    keys = [bytes([i]) * 16 for i in range(6)]
    writer.post(keys)
    assert reader.changed() == set(keys[:4])  # never more than the buffer's pages
    writer.post(keys[:1])
    assert reader.changed() == {keys[0]}
    writer.close()
    assert reader.changed() == set()  # its consumer is gone: nothing held
    assert reader.changed() is None  # no board any more
    reader.close()


# ---- the serving loop posts without a file system call ----

# Audit events of the file system (open, os.rename/os.replace, os.remove, ...) raised on the
# consumer's service thread while ``_WATCHING`` holds a list (audit hooks cannot be removed:
# one is added for the session, idle unless a test watches).
_WATCHING: list[list[str]] = []


def _audit(event: str, _args: tuple) -> None:
    if (
        _WATCHING
        and (event == "open" or event.startswith(("os.", "shutil.", "mmap.")))
        and threading.current_thread().name == "lmcache-pd-consumer"
    ):
        _WATCHING[0].append(event)


sys.addaudithook(_audit)


def test_the_serving_loop_posts_landings_without_touching_the_file_system(
    tmp_path: Path, keyer: ChunkKeyer
) -> None:
    """The stall this board was made for: the service loop inside ``os.replace`` for seconds.
    Chunks land and are posted; the loop's thread makes no file system call meanwhile."""
    fabric = FakeFabric()
    path = tmp_path / "landed"
    config = load_config(None, environ={}, **consumer_fields(num_pages=8))
    events: list[str] = []
    _WATCHING.append(events)
    try:
        with Consumer(
            config, keyer, channel=FakeChannel(fabric, "consumer"), board=path
        ) as consumer:
            reader = BoardReader(path)
            chunks = make_chunks(keyer.chunk_keys(list(range(600))), seed=1)
            with Producer(
                producer_config(num_pages=8), channel=FakeChannel(fabric, "producer")
            ) as producer:
                producer.push(spec_for(consumer.config, "r1"), chunks)
            wait_for(lambda: reader.read() == {"r1": 3}, what="the landing posted")
            reader.close()
            keys = KeysReader(keys_path(path))
            landed = {key.key for key in keyer.chunk_keys(list(range(600)))}
            wait_for(lambda: keys.changed() == landed, what="the landed keys posted")
            keys.close()
    finally:
        _WATCHING.clear()
    assert events == []
    assert not path.exists()  # closing the consumer removed its boards
    assert not keys_path(path).exists()


def test_an_instances_runtime_folder_is_in_memory_where_the_host_has_dev_shm(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the launcher puts vLLM's runtime folder, and with it the landed boards."""
    shm = Path("/dev/shm")
    expected = shm if shm.is_dir() and os.access(shm, os.W_OK) else None
    assert vllm_server.runtime_parent() == expected
    monkeypatch.setattr(vllm_server, "SHARED_MEMORY", tmp_path / "none")
    assert vllm_server.runtime_parent() is None  # the default temporary folder
