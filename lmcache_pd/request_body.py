"""What no request body of ours may hold, checked at both HTTP doors: the proxy's (every client's
body) and the instances' guard (``deploy/instance_guard.py``: a caller with the instance key, or
one on the instance's network where it runs without one).

Nesting deeper than any OpenAI request is (``MAX_JSON_DEPTH``) is refused: vLLM hands a request's
``kv_transfer_params`` (typed "any JSON") to its engine as is, and the engine dies pickling a step
that holds one nested some 500 levels deep (``RecursionError`` in its worker broadcast, then
``EngineDeadError``; found by ``benchmarks/abuse``). ``vllm_xargs`` carrying
``kv_transfer_params`` is refused too: the proxy never sends it that way, and vLLM's API server
answers 500 for a value that is not an object (its output processor calls ``.get`` on it).
"""

from __future__ import annotations

import msgspec

# Levels of arrays and objects a body may nest (a chat's image part is 6 deep).
MAX_JSON_DEPTH = 32
# The most an instance reads of one request body: twice the most the proxy takes from a client
# (``max_body_bytes`` is bounded by half of it), which its transfer parameters add little to.
MAX_BODY_BYTES = 64 << 20


def nests_deeper(value: object, levels: int) -> bool:
    """Whether ``value`` holds arrays or objects more than ``levels`` deep (no recursion: the
    walk goes level by level)."""
    level = [value] if isinstance(value, list | dict) else []
    for _ in range(levels):
        inner = []
        for container in level:
            items = container.values() if isinstance(container, dict) else container
            inner += [item for item in items if isinstance(item, list | dict)]
        if not inner:
            return False
        level = inner
    return bool(level)


def refusal(raw: bytes) -> str | None:
    """Why the JSON body ``raw`` must not reach vLLM, or None. A body that is not JSON is left
    to vLLM, which answers it with its own 400."""
    try:
        body = msgspec.json.decode(raw)
    except RecursionError:  # msgspec's own limit, far deeper than MAX_JSON_DEPTH
        return f"the body is nested deeper than {MAX_JSON_DEPTH} levels"
    except (msgspec.DecodeError, UnicodeDecodeError):
        return None
    if nests_deeper(body, MAX_JSON_DEPTH):
        return f"the body is nested deeper than {MAX_JSON_DEPTH} levels"
    xargs = body.get("vllm_xargs") if isinstance(body, dict) else None
    if isinstance(xargs, dict) and "kv_transfer_params" in xargs:
        return "vllm_xargs may not carry kv_transfer_params"
    return None
