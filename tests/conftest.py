"""Fixtures shared by the tests."""

import pytest

from lmcache_pd.keys import ChunkKeyer
from tests.helpers import CHUNK_SIZE


@pytest.fixture
def keyer() -> ChunkKeyer:
    return ChunkKeyer(
        model_name="demo", world_size=1, worker_id=0, kv_dtype="float32", chunk_size=CHUNK_SIZE
    )
