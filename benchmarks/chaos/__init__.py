"""Chaos suite: faults injected into running prefill/decode pools while a steady stream of
requests goes through the proxy, and every answer checked against one plain vLLM.

Before the pools start, one plain vLLM (same model and flags) answers every prompt: greedy,
temperature 0, ``logprobs: 1``, a few output tokens. Then the pools of each pools file start with
the proxy in front, and per fault a stream of requests (token-id prompts of 1 to 3000 tokens, a
quarter sharing a 1024-token prefix, half streamed; one every ``--gap-s``) runs through the proxy
while one fault is injected, the instance restarted or resumed, and the stream goes on:

  sigkill_decode    SIGKILL of decode's process group, then a restart on the same ports
  sigkill_prefill   SIGKILL of prefill-0's process group, then a restart
  sigstop_decode    SIGSTOP of decode's process group for 10 s, then SIGCONT
  buffer_full       every free page of decode's receive buffer taken by AllocRequests that are
                    never written (a producer that died right after allocating); the fault ends
                    when the consumer's lease (``alloc_lease_s``) gives them back
  client_disconnect streamed clients that close their connection right after the first token
  malformed_spec    malformed ``disagg_spec``s sent straight to prefill's HTTP port: it must
                    answer (an error or a plain answer) and keep serving
  preemption        decode restarted with 40 KV blocks (``--num-gpu-blocks-override`` in its
                    per-instance ``vllm_args``), then 8 concurrent 1150-token, 160-token-answer
                    requests; preemptions are read from ``vllm:num_preemptions_total`` (vLLM
                    0.32's log line never shows them: its logger zeroes the count before printing)
                    and requests loaded twice are found in decode's log

Per request: whether its answer equals the reference (same tokens, logprobs within
``LOGPROB_TOLERANCE``; a streamed answer is gathered token by token from its chunks), or got a
clear error (an HTTP error or an error event), and its latency. A request is *cut* by the fault
when it was in flight at a kill or SIGSTOP, or sent before the proxy saw the instance up again
(or is a disconnecting client): errors are acceptable only there. A wrong answer never is.

Per fault and pools layout (``benchmarks/results/chaos.json``, ``chaos.md``): requests, wrong
outputs, errors, ``max_latency_s`` (requests not cut), ``deadline_s`` (the configured deadline that
should bound them, per fault below), ``recovered_s`` (from the restart being healthy, or the
fault's end, until a request sent after it succeeds with none failing later), ``pages_leaked``
(decode's ``lmcache_pd_consumer_used_pages`` 5 s after the stream stops, reported afresh after one
plain request), threads that died (counters and "Exception in thread" in the logs), the longest
stall of the consumer's service loop (its watchdog lines), and the counters that show what
happened (decode's prompt tokens loaded / computed / cached, load timeouts, abandoned loads,
push failures, preemptions). All counters go through ``read_counters``. Between faults, an
instance whose thread died is restarted, and decode after ``preemption``, so that each fault is
measured on its own.

Deadlines, from the configs in force:
  sigkill_*, client_disconnect, malformed_spec: the proxy's ``connect_s``: a dead instance refuses
      connections at once, and nothing else about these faults needs a wait;
  sigstop_decode: the stop (10 s) plus the proxy's ``connect_s``;
  buffer_full: the producer's ``alloc_timeout_s``: the consumer refused the allocation itself, so
      the prompt should be recomputed by then rather than awaited;
  preemption: the consumer's ``load_timeout_s``, the one KV wait a request may pay.

Goals: wrong_outputs 0 and pages_leaked 0 everywhere, max_latency_s <= deadline_s + 1,
recovered_s <= 10.

Reproduce the full run (1P1D and 2P1D, every fault; ~25 min here)::

    .venv/bin/python -m benchmarks.chaos
    .venv/bin/python -m benchmarks.chaos --short   # 1P1D, three faults, ~3-4.5 min
"""
