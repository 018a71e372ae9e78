"""Hostile-input suite: every door of running pools attacked in turn (malformed, oversized,
smuggled and unauthenticated input) while a steady stream of normal requests goes through the
proxy, each normal answer checked against its baseline.

The pools: ``configs/pools.yaml`` (1 prefill + 1 decode real vLLM, the tiny local model), started
by the launcher with a deployment secret (``LMCACHE_PD_SECRET`` in each instance's environment:
CURVE on every ZMQ port, MACs on NIXL notifications) and their instance key (vLLM's API key), and
the proxy (``lmcache-pd proxy``, a process of its own) with a client key, the same secret and an
admission limit of 4 requests. Before any attack, each normal prompt (short token ids served by
decode alone, long ones whose KV prefill pushes to decode, a chat, streamed and not) is answered
once through the proxy with the official ``openai`` client, greedy with logprobs: its baseline.
Then one normal request at a time goes on through the proxy while each door is attacked:

  proxy_http        the proxy as a client reaches it: no or a wrong API key (401), not JSON, deep
                    nesting, a 9 MiB body, wrong types, bad content parts (400/413),
                    ``vllm_xargs``/``kv_transfer_params``/``ec_transfer_params`` (400), raw HTTP
                    (request smuggling, a TLS hello, a 64 KiB header), held half-requests, and a
                    burst of 3x the admission limit (503 with Retry-After for those past it)
  prefill_http      prefill's own port, around the proxy: without the instance key (401, on every
  decode_http       path but /health and /metrics); with it, ``kv_transfer_params`` of every type
                    and shape (the ``first_tok_to: "tcp://-:1"`` that killed prefill among them),
                    ``vllm_xargs`` smuggling, deep nesting, raw HTTP (any answer below 500)
  decode_init_zmq   the consumer's init and alloc ports and the proxy's first-token notice port,
  decode_alloc_zmq  from a process without the secret: garbage, a frame past the size limit, a
  proxy_notice_zmq  message of 200 frames, the port's own messages under guessed chunk keys and
                    request ids (AllocRequest, KVAbandoned, AllocCancel, MetadataRequest...),
                    CURVE under another deployment's secret, raw TCP, a flood of connections.
                    Right answer: never admitted (ZMQ's handshake never succeeds), no reply
  nixl              the handshake that hands out NIXL metadata, from a process without the
                    secret (it must get nothing), and bytes of no protocol into every port that
                    NIXL's transport (UCX) listens on (any answer; the instance must live on)

Per door: cases planned and tried, cases that got another answer than their door should give
(``unexpected``), calls or knocks served or admitted without the key or secret, instances that
died (``/health`` and the process; goal 0), normal answers that changed (other tokens, or
logprobs beyond ``LOGPROB_TOLERANCE``; goal 0), normal requests that failed (goal 0; one refused
with 503 and Retry-After is sent again after it, counted as ``deferred``), each process group's
resident memory growth, the counters that moved (``lmcache_pd_*`` of each process) and log lines
with errors. Each ZMQ and NIXL door has a positive control: the same knock made with the secret
must be seen (a reply, or metadata), or the door's "not admitted" proves nothing. The answer
check has its negative control too: every baseline compared with another prompt's must read as
changed. An instance that died is started again before the next door.

Reproduce (``benchmarks/results/abuse.json``)::

    .venv/bin/python -m benchmarks.abuse             # every case of every door (~6.5 min here)
    .venv/bin/python -m benchmarks.abuse --short     # a few cases per door (~2.5-4 min)
"""
