"""Fleet benchmark (issue 57, "What must be shown"): instances die, drain, restart and roll
under a steady load through a real ``lmcache-pd serve``, and no client should see it.

``serve`` runs as a child process on one host (engine ``local``), so that what is measured is
what a user gets: the proxy's mid-stream migration and prefill retries, each instance's drain on
SIGTERM, the supervisor that starts a dead instance again and ``lmcache-pd restart``'s roll.
Before it starts, one plain vLLM (same model and flags) answers every prompt (greedy,
``ignore_eos``, ``logprobs: 1``): the reference.

The load: streamed completions of 300-1200-token prompts (over ``min_disagg_tokens``, so every
one is disaggregated) with ``--answer-tokens`` (64) tokens each, a new one every ``--gap-s`` and
at most ``--concurrency`` in flight. One phase per event, each with prompts of its own, the
first a control (the same load, no event):

  sigkill_decode_mid_stream          decode-0's process group SIGKILLed once a stream is 4
                                     chunks into its answer (a node lost)
  sigkill_prefill_mid_push           prefill-0's group SIGKILLed while a request is at prefill
  sigterm_decode, sigterm_prefill    the instance's API server SIGTERMed (what a pod's end, an
                                     operator or a scale-down sends): it drains
  sigkill_decode_before_first_token  decode-0 SIGKILLed while a request waits for its first
                                     token
  rolling_restart                    ``lmcache-pd restart`` of every instance, one at a time

After a kill or a drain, serve's supervisor starts the instance again; the phase goes on until
it serves (its /health 200, then the proxy lists it up) and ``tail`` more requests were sent.

Per event (``benchmarks/results/fleet.json``, ``fleet.md``): requests sent, failed (an HTTP
error or an error event), wrong (tokens other than the reference's, or logprobs beyond
``LOGPROB_TOLERANCE``), pages left on decode (``lmcache_pd_consumer_used_pages`` summed over
decode instances, 5 s after the load stopped and after one plain request to each), the streams
the proxy sent elsewhere (its log lines) and the p50/p99 of each one's longest pause between
chunks against the run's ITL p99 and the control's, the proxy's migrations by cause, refusals
by reason and prefill retries, and the seconds from the event until the instance answers its
/health with 200 again and until the proxy lists it up.

Goals: failed 0, wrong 0, pages left 0 for every event.

``--engine ray`` runs the same load and judging through the Ray engine's deployment
(``engine: ray``: the pools as actors, ``ray_serve.py``) on a one-node Ray cluster the benchmark
starts and stops itself, 1P2D, with the Ray events of ``ray_events.py``: a decode actor
SIGKILLed mid-stream, and ``lmcache-pd scale decode 1`` while the leaving decode streams
(``benchmarks/results/fleet-ray.json``, ``fleet-ray.md``).

Reproduce::

    .venv/bin/python -m benchmarks.fleet                      # 2P2D, every event (~25 min)
    .venv/bin/python -m benchmarks.fleet --short              # 1P2D, two events (~4 min)
    .venv/bin/python -m benchmarks.fleet --engine ray         # 1P2D on Ray, two events (~6 min)
"""
