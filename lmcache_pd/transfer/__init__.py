"""The transfer core: NIXL and the ranks that use it, knowing nothing of vLLM.

Producer side: a sender thread per consumer rank (``sender.py``, ``peer_sender.py``) drives a
``Producer`` (``producer.py``) that shakes hands once (``handshake.py``), keeps the consumer as a
``PeerState`` (``peer_state.py``, with its ``reservations.py``), asks for room over ZMQ
(``sockets.py``) and writes chunks from its staging buffer (``staging.py``) in one NIXL WRITE
(``channel.py``, the one owner of NIXL). Consumer side: a ``Consumer`` (``consumer.py``) answers
its init and alloc ports (``init_port.py``, ``alloc_port.py``), hands out pages of its registered
buffer (``allocator.py``), keeps what landed (``chunk_store.py`` and its parts), and on decode
runs in a process of its own beside vLLM's worker (``consumer_service.py``), posting what landed
on its board (``landed_board.py``). docs/architecture.md has the whole module map.
"""
