"""What only tests, benchmarks and the demos use: child processes driven over JSON lines, network
namespaces, the tiny model, a misbehaving vLLM stand-in, an app on a thread.

It ships in the wheel because ``lmcache-pd demo``, ``transfer-demo`` and ``make-model`` use it;
nothing else in the library imports it.
"""
