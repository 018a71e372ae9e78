"""The producer's staging buffer: pages taken on vLLM's model-runner thread and given back on
sender threads."""

from __future__ import annotations

import threading

import pytest

from lmcache_pd.errors import AllocationError
from lmcache_pd.transfer.staging import Staging


def test_pages_taken_and_given_back_from_many_threads_are_never_shared() -> None:
    staging = Staging(num_pages=16, page_bytes=64)
    owners: dict[int, int] = {}
    clashes: list[int] = []
    guard = threading.Lock()  # guards the test's own bookkeeping, not the staging

    def churn(worker: int) -> None:
        for _ in range(2000):
            try:
                with staging.pages(3) as pages:
                    addresses = [page.data_ptr() for page in pages]
                    with guard:
                        clashes.extend(a for a in addresses if a in owners)
                        owners.update(dict.fromkeys(addresses, worker))
                    with guard:
                        for address in addresses:
                            del owners[address]
            except AllocationError:
                continue  # full for now: others hold the pages

    threads = [threading.Thread(target=churn, args=(worker,)) for worker in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert clashes == []
    assert staging.free_pages == 16


def test_a_request_larger_than_the_staging_buffer_names_the_setting() -> None:
    staging = Staging(num_pages=2, page_bytes=64)
    with pytest.raises(AllocationError, match="buffer_size_bytes"), staging.pages(3):
        pass
    with staging.pages(2) as pages:  # control
        assert [page.numel() for page in pages] == [64, 64]
