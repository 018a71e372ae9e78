"""The transfer core: NIXL and the ranks that use it, knowing nothing of vLLM.

A producer (``producer.py``, driven per consumer by ``sender.py``) shakes hands with a consumer
(``handshake.py``, over the socket helpers of ``sockets.py``), asks it for room (the alloc port)
and writes chunks with one NIXL WRITE (``channel.py``, the one owner of NIXL); the consumer
(``consumer.py``) hands out pages of its registered buffer (``allocator.py``), keeps what landed
(``chunk_store.py``), and on decode runs in a process of its own beside vLLM's worker
(``consumer_service.py``).
"""
