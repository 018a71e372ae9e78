"""The transfer core: NIXL and the ranks that use it, knowing nothing of vLLM.

A producer (``producer.py``, driven per consumer by ``sender.py``) shakes hands with a consumer
(``handshake.py``, over the socket helpers of ``sockets.py``), then keeps it as one
``PeerState`` (``peer_state.py``): asks it for room on its alloc port, or takes pages it reserved
ahead (``reservations.py``), and writes chunks with one NIXL WRITE (``channel.py``, the one owner
of NIXL). The consumer (``consumer.py``) answers handshakes (``init_port.py``) and allocations
(``alloc_port.py``), hands out pages of its registered buffer (``allocator.py``), keeps what
landed (``chunk_store.py``), counts (``consumer_stats.py``), and on decode runs in a process of
its own beside vLLM's worker (``consumer_service.py``), which reads landed chunks out of the
buffer both map (``receive_buffer.py``).
"""
