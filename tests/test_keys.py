"""Chunk keys: chained, deterministic across processes, partial last chunk, strict masks, salted
per tenant."""

import subprocess
import sys
from functools import partial

import numpy as np
import pytest

from tests.helpers import make_keyer

# Tiny chunks, and two ranks (so that a worker id can be out of range); a test changes the rest.
keyer = partial(make_keyer, model_name="m", world_size=2, chunk_size=4)


def test_chunks_cover_the_tokens_with_a_partial_last_chunk() -> None:
    keys = keyer().chunk_keys(list(range(10)))
    assert [(k.start, k.end) for k in keys] == [(0, 4), (4, 8), (8, 10)]
    assert len({k.key for k in keys}) == 3


def test_a_key_depends_on_every_token_before_it() -> None:
    base = keyer().chunk_keys(list(range(12)))
    changed = keyer().chunk_keys([99, *range(1, 12)])
    assert all(a.key != b.key for a, b in zip(base, changed, strict=True))
    later = keyer().chunk_keys([*range(8), 99, 9, 10, 11])
    assert [a.key == b.key for a, b in zip(base, later, strict=True)] == [True, True, False]


def test_shared_prefix_shares_keys_and_partial_chunk_differs_from_full() -> None:
    long = keyer().chunk_keys(list(range(8)))
    short = keyer().chunk_keys(list(range(6)))
    assert long[0].key == short[0].key
    assert long[1].key != short[1].key


@pytest.mark.parametrize(
    "change",
    [{"model_name": "other"}, {"world_size": 4}, {"worker_id": 1}, {"kv_dtype": "bfloat16"}],
)
def test_key_includes_model_world_worker_and_dtype(change: dict) -> None:
    tokens = list(range(8))
    assert keyer().chunk_keys(tokens)[0].key != keyer(**change).chunk_keys(tokens)[0].key


@pytest.mark.processes
def test_keys_are_identical_in_another_process_with_another_hash_seed() -> None:
    script = (
        "from lmcache_pd.keys import ChunkKeyer;"
        "k = ChunkKeyer(model_name='m', world_size=2, worker_id=0, kv_dtype='float32',"
        " chunk_size=4);"
        "print(','.join(c.key.hex() for c in k.chunk_keys(list(range(10)))))"
    )
    outputs = {
        subprocess.run(
            [sys.executable, "-c", script],
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONHASHSEED": seed},
        ).stdout.strip()
        for seed in ("1", "2")
    }
    here = ",".join(c.key.hex() for c in keyer().chunk_keys(list(range(10))))
    assert outputs == {here}


def test_tensor_like_inputs_give_the_same_keys_as_lists() -> None:
    tokens = list(range(10))
    assert keyer().chunk_keys(np.array(tokens, dtype=np.int32)) == keyer().chunk_keys(tokens)


def test_mask_skips_a_whole_chunk_prefix() -> None:
    tokens = list(range(10))
    masked = keyer().chunk_keys(tokens, mask=[False] * 4 + [True] * 6)
    assert masked == keyer().chunk_keys(tokens)[1:]


@pytest.mark.parametrize(
    "mask",
    [
        [False] * 3 + [True] * 7,  # not a multiple of chunk_size
        [True, False] + [True] * 8,  # not a prefix of Falses
        [False] * 4 + [True, False] + [True] * 4,
        [True] * 9,  # wrong length
    ],
)
def test_bad_masks_are_refused(mask: list[bool]) -> None:
    with pytest.raises(ValueError):
        keyer().chunk_keys(list(range(10)), mask=mask)


def test_bad_shapes_are_refused() -> None:
    with pytest.raises(ValueError):
        keyer().chunk_keys(np.zeros((2, 2), dtype=np.int64))
    with pytest.raises(ValueError):
        keyer().chunk_keys(np.array([1.5, 2.5]))
    with pytest.raises(ValueError):
        keyer(chunk_size=0)
    with pytest.raises(ValueError):
        keyer(worker_id=2)


# Keys of range(10) under keyer(), as every release before cache salts computed them: a change
# would make mixed versions of prefill and decode miss each other's chunks.
UNSALTED_KEYS = [
    "ab71755da17c1c49ad3ed181c58c5dfc",
    "ccca4f72f14053be5c359f52978b6695",
    "83eb072d70172dae02a8e4747a89212d",
]


@pytest.mark.parametrize("salt", [None, ""])
def test_no_salt_keeps_the_keys_of_an_unsalted_request(salt: str | None) -> None:
    keys = keyer().chunk_keys(list(range(10)), salt=salt)
    assert [k.key.hex() for k in keys] == UNSALTED_KEYS


def test_a_cache_salt_changes_every_key_of_the_request() -> None:
    """Requests of different salts (tenants) share no chunk, not even the first; the same salt
    shares them all (the control)."""
    tokens = list(range(10))
    unsalted = keyer().chunk_keys(tokens)
    tenant_a, tenant_b = keyer().chunk_keys(tokens, salt="a"), keyer().chunk_keys(tokens, salt="b")
    assert [(k.start, k.end) for k in tenant_a] == [(k.start, k.end) for k in unsalted]
    every = [k.key for k in unsalted + tenant_a + tenant_b]
    assert len(set(every)) == len(every)
    assert keyer().chunk_keys(tokens, salt="a") == tenant_a


def test_a_salted_mask_skips_the_same_chunks() -> None:
    tokens = list(range(10))
    masked = keyer().chunk_keys(tokens, mask=[False] * 4 + [True] * 6, salt="a")
    assert masked == keyer().chunk_keys(tokens, salt="a")[1:]


def test_any_string_is_a_usable_salt() -> None:
    """A client's JSON can carry a lone surrogate; keying must not fail on it."""
    keys = keyer().chunk_keys(list(range(4)), salt="\ud800")
    assert keys[0].key != keyer().chunk_keys(list(range(4)), salt="\ud801")[0].key


def test_a_lora_adapter_changes_every_key_and_no_salt_stands_in_for_it() -> None:
    """An adapter's KV is not the base model's, nor another adapter's: every key differs, the
    first too; a salt and an adapter of the same name, or a salt spelled like one, never make
    the same keys (each is mixed in under its own personalisation)."""
    tokens = list(range(10))
    base = keyer().chunk_keys(tokens)
    tuned = keyer().chunk_keys(tokens, lora="tuned")
    other = keyer().chunk_keys(tokens, lora="other")
    as_salt = keyer().chunk_keys(tokens, salt="tuned")
    salted_tuned = keyer().chunk_keys(tokens, salt="a", lora="tuned")
    every = [k.key for keys in (base, tuned, other, as_salt, salted_tuned) for k in keys]
    assert len(set(every)) == len(every)
    assert keyer().chunk_keys(tokens, lora="tuned") == tuned  # the control: the same adapter
    assert [k.key.hex() for k in keyer().chunk_keys(tokens, lora=None)] == UNSALTED_KEYS


def test_lmcache_tags_change_every_key_and_the_same_tags_share_them() -> None:
    """Requests of different LMCache tags (``lmcache.tag.<name>``) share no chunk, not even the
    first; the same tags, in any order, make the same keys (the control); no salt or adapter,
    and no other split of the same characters into names and values, stands in for a tag."""
    tokens = list(range(10))
    tenant_a = keyer().chunk_keys(tokens, tags=[("tenant", "a")])
    others = [
        keyer().chunk_keys(tokens),
        keyer().chunk_keys(tokens, tags=[("tenant", "b")]),
        keyer().chunk_keys(tokens, tags=[("tenan", "ta")]),
        keyer().chunk_keys(tokens, tags=[("tenant", "a"), ("user", "x")]),
        keyer().chunk_keys(tokens, salt="a"),
        keyer().chunk_keys(tokens, lora="a"),
        keyer().chunk_keys(tokens, salt="a", tags=[("tenant", "a")]),
    ]
    every = [k.key for keys in [tenant_a, *others] for k in keys]
    assert len(set(every)) == len(every)
    assert keyer().chunk_keys(tokens, tags=(("tenant", "a"),)) == tenant_a
    two = [("user", "x"), ("tenant", "a")]
    assert keyer().chunk_keys(tokens, tags=two) == others[3]  # order does not matter
    assert [k.key.hex() for k in keyer().chunk_keys(tokens, tags=())] == UNSALTED_KEYS
    # Any string encodes, a lone surrogate from a client's JSON included.
    assert keyer().chunk_keys(tokens, tags=[("t", "\ud800")]) != tenant_a


def test_another_image_changes_every_key_from_its_chunk_on_and_none_before() -> None:
    """Two prompts of the same tokens (an image's placeholders are the same for every image)
    and different images share the chunks before the image and none from the image's chunk on;
    the same image in the same place makes the same keys (the control)."""
    tokens = list(range(14))  # chunks 0-4, 4-8, 8-12, 12-14; the image fills 5-7
    red = keyer().chunk_keys(tokens, mm=((5, 3, "red"),))
    blue = keyer().chunk_keys(tokens, mm=((5, 3, "blue"),))
    text = keyer().chunk_keys(tokens)
    assert [a.key == b.key for a, b in zip(red, blue, strict=True)] == [True, False, False, False]
    assert [a.key == b.key for a, b in zip(red, text, strict=True)] == [True, False, False, False]
    assert keyer().chunk_keys(tokens, mm=((5, 3, "red"),)) == red
    assert [k.key.hex() for k in keyer().chunk_keys(tokens[:10], mm=())] == UNSALTED_KEYS


@pytest.mark.parametrize(
    "other",
    [((7, 4, "red"),), ((6, 3, "red"),), ((6, 4, "red"), (10, 1, "red")), ((6, 4, "r"),)],
    ids=["moved", "shorter", "another_item", "another_identifier"],
)
def test_an_image_counts_by_its_place_its_length_and_its_hash(other: tuple) -> None:
    """An image that spans two chunks is part of both keys, by its offset from each chunk's
    start (negative in the second), its length and its identifier: any of them changed changes
    the second chunk's key; the chunk before the image keeps its key."""
    tokens = list(range(12))  # chunks 0-4, 4-8, 8-12; the image fills 6-9
    red = keyer().chunk_keys(tokens, mm=((6, 4, "red"),))
    changed = keyer().chunk_keys(tokens, mm=other)
    assert red[0].key == changed[0].key
    assert red[2].key != changed[2].key
    # the control: a chunk's key names its own items, not those of the chunks after it
    assert (red[1].key == changed[1].key) == (other[0] == (6, 4, "red"))
