"""Which UCX transports a producer tries for a consumer: local ones on its own network stack,
remote ones (TCP) elsewhere, TCP as the fallback, and with pages in GPU memory every choice able
to move CUDA memory (``cuda_copy``)."""

from __future__ import annotations

from lmcache_pd import transport


def test_a_peer_on_another_stack_gets_the_remote_transports_then_tcp() -> None:
    local = transport.choose("a", "a", local_tls=None, remote_tls="tcp", fallback=True)
    assert (local.attempts, local.same_stack) == ((None, "tcp"), True)
    remote = transport.choose("a", "b", local_tls=None, remote_tls="tcp", fallback=True)
    assert (remote.attempts, remote.same_stack) == (("tcp",), False)


def test_gpu_pages_get_cuda_copy_in_every_transport_list_that_lacks_it() -> None:
    """Plain TCP cannot move CUDA memory: without cuda_copy the self-test of a VRAM buffer
    fails across hosts and every request is recomputed."""
    remote = transport.choose(
        "a", "b", local_tls=None, remote_tls="tcp", fallback=True, device_memory=True
    )
    assert remote.attempts == ("tcp,cuda_copy",)
    local = transport.choose(
        "a", "a", local_tls="cma,cuda_ipc", remote_tls="tcp", fallback=True, device_memory=True
    )
    assert local.attempts == ("cma,cuda_ipc", "tcp,cuda_copy")  # names a CUDA one already
    chosen_by_ucx = transport.choose(
        "a", "a", local_tls=None, remote_tls="all", fallback=False, device_memory=True
    )
    assert chosen_by_ucx.attempts == (None,)
