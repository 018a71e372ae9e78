"""Proxy overhead: the same streamed completions through the routing proxy and without it.

Why: the proxy sits on every request's path (prefill's answer, then every decode token), so what
it adds should be small next to what a model costs; the goal is under 1 ms per request at p50.

Three OS processes on free ports: a stand-in prefill and a stand-in decode server
(``lmcache_pd/harness/standin.py``, answering at once unless ``--first-delay-ms``/
``--token-delay-ms``), and
the proxy in front of them (``lmcache-pd proxy`` on a YAML written to a temp folder). A load
generator in this process runs N concurrent streams for each N of ``--concurrency``, each stream a
sequence of streamed ``/v1/completions`` requests (short prompt, ``--output-tokens`` tokens), in
two modes:

- ``proxy``: through the proxy;
- ``direct``: the client does what the proxy does: a non-streaming call to prefill for one token
  (same ``kv_transfer_params`` shape), then a streaming call to decode on the prompt's token ids
  plus that token. Only the proxy's hop differs.

Per mode and N: requests/s, time to first token (TTFT), end-to-end latency (e2e) and the gaps
between consecutive tokens (ITL) at p50/p99, and CPU milliseconds per request of each process.
The modes alternate run by run (their order swapped every run), since this machine's speed
drifts ~2x between runs; "added" is the median over runs of proxy minus direct, paired run by
run. With zero delays decode's tokens come back to back, so the ITL p50 is the cost of passing
one token along; its p99 is the first gap of each answer (decode's request set-up). Clients and
servers share this machine's cores: at high N the proxy's CPU use shows up as latency.

Reproduce (medians of 5 runs; tables on stdout, JSON in benchmarks/results/proxy.json)::

    .venv/bin/python -m benchmarks.proxy
    .venv/bin/python -m benchmarks.proxy --concurrency 1,4 --runs 3 --run-seconds 1 \\
        --token-delay-ms 1 --output /tmp/proxy.json
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import aiohttp
import httpx
import msgspec
import numpy as np
import typer
import yaml
from rich.console import Console
from rich.table import Table

from benchmarks.common import LOG_FORMAT, free_ports, write_json
from benchmarks.environment import run_environment
from lmcache_pd.protocol import DisaggSpec, KVTransferParams
from lmcache_pd.proxy.client_request import ClientRequest, Endpoint

logger = logging.getLogger(__name__)

DEFAULT_OUTPUT = Path(__file__).resolve().parent / "results" / "proxy.json"
DEFAULT_CONCURRENCY = "1,16,128"
MODEL = "standin"
MODES = ("proxy", "direct")
PROCESSES = ("proxy", "prefill", "decode", "client")
LATENCIES = ("ttft", "e2e", "itl")
GOAL_ADDED_E2E_P50_MS = 1.0
START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0
HEALTH_POLL_S = 0.05
REQUEST_TIMEOUT_S = 30.0  # a whole request, connect to [DONE]
# Receiver of the DisaggSpec: stand-ins never push KV, so any port does.
RECEIVER = ("127.0.0.1", 1, 2)
QUIET = ("--log-level", "warning")  # the proxy logs nothing per request above debug anyway
CLOCK_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


# ---- the servers, each its own OS process ----


class _Forgetful(list[Any]):
    """A stand-in records every request for tests; here that would only grow without end."""

    def append(self, item: Any) -> None:
        pass


def serve_standin(port: int, first_delay_s: float, token_delay_s: float) -> None:
    """Run one stand-in vLLM on ``port`` until SIGTERM (the entry point of its child process)."""
    from aiohttp import web

    from lmcache_pd.harness.standin import Standin, StandinState

    state = StandinState(first_delay_s=first_delay_s, token_delay_s=token_delay_s)
    state.received = _Forgetful()
    try:
        import uvloop
    except ImportError:
        loop = None
    else:
        loop = uvloop.new_event_loop()  # as the proxy runs (vLLM brings uvloop)
    web.run_app(
        Standin(state).app(),
        host="127.0.0.1",
        port=port,
        access_log=None,
        print=None,
        backlog=1024,
        shutdown_timeout=1.0,
        loop=loop,
    )


class _Child:
    """One child OS process, its output in a log file; stopped on exit (SIGTERM, then SIGKILL)."""

    def __init__(self, name: str, argv: list[str], log_path: Path) -> None:
        self.name, self.argv, self.log_path = name, argv, log_path
        self._process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> _Child:
        with self.log_path.open("wb") as log:
            self._process = subprocess.Popen(
                self.argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
            )
        return self

    def __exit__(self, *exc: object) -> None:
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            logger.warning("%s ignored SIGTERM for %.0f s; killing it", self.name, STOP_TIMEOUT_S)
            process.kill()
            process.wait(STOP_TIMEOUT_S)

    def wait_healthy(self, url: str, deadline: float) -> None:
        """Poll ``url`` until it answers 200; fail at ``deadline`` or if the process exits."""
        assert self._process is not None
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self._process.returncode}): {self.log()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url, timeout=1.0).status_code == 200:
                    return
            time.sleep(HEALTH_POLL_S)
        raise TimeoutError(f"{self.name} not healthy after {START_TIMEOUT_S} s: {self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-2000:]

    def cpu_s(self) -> float:
        """User plus system CPU seconds used so far (Linux /proc)."""
        assert self._process is not None
        stat = Path(f"/proc/{self._process.pid}/stat").read_text()
        fields = stat.rsplit(")", 1)[1].split()  # the name in parentheses may hold spaces
        return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS_PER_S


@dataclass(frozen=True, slots=True)
class Servers:
    """The running stand-ins and proxy: their base URLs and a CPU clock per process."""

    proxy_url: str
    prefill_url: str
    decode_url: str
    children: dict[str, _Child]

    def cpu_s(self) -> dict[str, float]:
        return {name: child.cpu_s() for name, child in self.children.items()} | {
            "client": time.process_time()
        }


@contextlib.contextmanager
def start_servers(workdir: Path, first_delay_s: float, token_delay_s: float) -> Iterator[Servers]:
    """Start prefill and decode stand-ins and the proxy in front of them, wait until all three
    are healthy, and stop them all on leaving, also on failure."""
    ports = dict(zip(("proxy", "prefill", "decode"), free_ports(3), strict=True))
    urls = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
    host, init_port, alloc_port = RECEIVER
    config = {
        "model": MODEL,
        "port": ports["proxy"],
        "prefill": [{"url": urls["prefill"]}],
        "decode": [
            {
                "url": urls["decode"],
                "receiver_host": host,
                "init_port": init_port,
                "alloc_port": alloc_port,
            }
        ],
    }
    config_path = workdir / "proxy.yaml"
    config_path.write_text(yaml.safe_dump(config))
    standin = "from benchmarks.proxy import serve_standin; serve_standin({}, {}, {})"
    argvs = {
        "prefill": [sys.executable, "-c", standin.format(ports["prefill"], first_delay_s, 0.0)],
        "decode": [sys.executable, "-c", standin.format(ports["decode"], 0.0, token_delay_s)],
        "proxy": [sys.executable, "-m", "lmcache_pd.cli", "proxy", str(config_path), *QUIET],
    }
    deadline = time.monotonic() + START_TIMEOUT_S
    with contextlib.ExitStack() as stack:
        children = {
            name: stack.enter_context(_Child(name, argv, workdir / f"{name}.log"))
            for name, argv in argvs.items()
        }
        try:
            for name in ("prefill", "decode", "proxy"):  # the proxy checks the others at start
                children[name].wait_healthy(f"{urls[name]}/health", deadline)
            yield Servers(urls["proxy"], urls["prefill"], urls["decode"], children)
        except Exception:
            for child in children.values():  # their logs go with the temp folder
                logger.error("%s's log ends:\n%s", child.name, child.log())
            raise


# ---- the load generator ----


class _Choice(msgspec.Struct):
    text: str = ""


class _Event(msgspec.Struct):
    choices: list[_Choice] = []
    error: dict[str, Any] | None = None  # the proxy's event when decode failed mid-stream


_decode_event = msgspec.json.Decoder(_Event).decode


@dataclass(frozen=True, slots=True)
class Sample:
    """One request as its client saw it, in seconds from sending it."""

    ttft_s: float
    e2e_s: float
    gaps_s: list[float]


async def _read_tokens(
    response: aiohttp.ClientResponse, arrivals: list[float], skip: int = 0
) -> float:
    """Append each streamed token's arrival time, but for the first ``skip`` tokens; return when
    ``[DONE]`` came. Reads on to the body's end, as HTTP clients do: a body left unread closes
    the connection instead of returning it to the pool."""
    if response.status != 200:
        raise RuntimeError(f"{response.url} answered {response.status}: {await response.read()!r}")
    done = None
    async for line in response.content:
        if done is not None or not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            done = time.perf_counter()
            continue
        event = _decode_event(data)
        if event.error is not None:
            raise RuntimeError(f"{response.url} streamed an error: {event.error}")
        if any(choice.text for choice in event.choices):
            if skip:
                skip -= 1
                continue
            arrivals.append(time.perf_counter())
    if done is None:
        raise RuntimeError(f"{response.url}: stream ended without [DONE]")
    return done


class LoadGenerator:
    """Makes one streamed completion at a time, through the proxy or directly (see module doc)."""

    def __init__(
        self, session: aiohttp.ClientSession, servers: Servers, output_tokens: int
    ) -> None:
        self._session, self._servers, self._output_tokens = session, servers, output_tokens

    def _body(self, stream: int) -> dict[str, Any]:
        prompt = f"benchmark stream {stream}: tell me a story"
        return {
            "model": MODEL,
            "prompt": prompt,
            "max_tokens": self._output_tokens,
            "temperature": 0.0,
            "stream": True,
        }

    def request_maker(self, mode: str, stream: int) -> Callable[[], Awaitable[Sample]]:
        """The coroutine function one stream of ``mode`` calls for each of its requests."""
        body = self._body(stream)
        if mode == "proxy":
            encoded = msgspec.json.encode(body)
            return lambda: self._proxied(encoded)
        client = ClientRequest.parse(Endpoint.COMPLETIONS, body)
        return lambda: self._direct(client)

    def _sample(self, started: float, arrivals: list[float], done: float) -> Sample:
        if len(arrivals) != self._output_tokens:
            raise RuntimeError(f"{len(arrivals)} tokens streamed, {self._output_tokens} asked")
        gaps = [later - earlier for earlier, later in itertools.pairwise(arrivals)]
        return Sample(arrivals[0] - started, done - started, gaps)

    async def _proxied(self, body: bytes) -> Sample:
        arrivals: list[float] = []
        started = time.perf_counter()
        async with self._session.post(
            f"{self._servers.proxy_url}{Endpoint.COMPLETIONS.value}",
            data=body,
            headers={"Content-Type": "application/json"},
        ) as response:
            done = await _read_tokens(response, arrivals)
        return self._sample(started, arrivals, done)

    async def _direct(self, client: ClientRequest) -> Sample:
        """Prefill for the first token, then decode's stream past it, as the proxy would."""
        req_id = f"bench-{uuid.uuid4().hex}"
        spec = DisaggSpec(req_id, *RECEIVER)
        headers = {"Content-Type": "application/json", "X-Request-Id": req_id}
        prefill = client.prefill_body(KVTransferParams(ret_first_tok=True, disagg_spec=spec))
        arrivals: list[float] = []
        started = time.perf_counter()
        async with self._session.post(
            f"{self._servers.prefill_url}{Endpoint.COMPLETIONS.value}",
            data=msgspec.json.encode(prefill),
            headers=headers,
        ) as response:
            raw = await response.read()
        if response.status != 200:
            raise RuntimeError(f"prefill answered {response.status}: {raw[:300]!r}")
        answer = msgspec.json.decode(raw)
        arrivals.append(time.perf_counter())
        first = answer["kv_transfer_params"]["first_tok"]
        decode = client.decode_body(KVTransferParams(disagg_spec=spec, first_tok=first))
        async with self._session.post(
            f"{self._servers.decode_url}{Endpoint.COMPLETIONS.value}",
            data=msgspec.json.encode(decode),
            headers=headers,
        ) as response:
            done = await _read_tokens(response, arrivals, skip=1)  # the client has the first
        return self._sample(started, arrivals, done)


async def _one_run(
    generator: LoadGenerator, servers: Servers, mode: str, concurrency: int, seconds: float
) -> dict[str, Any]:
    """``concurrency`` streams sending requests back to back for ``seconds``; its figures."""
    ends = time.perf_counter() + seconds

    async def attempt(make: Callable[[], Awaitable[Sample]]) -> Sample | str:
        try:
            return await make()
        except (RuntimeError, aiohttp.ClientError, TimeoutError) as exc:
            return f"{type(exc).__name__}: {exc}"

    async def stream(index: int) -> list[Sample | str]:
        make = generator.request_maker(mode, index)
        outcomes = [await attempt(make)]  # at least one, however short the run
        while time.perf_counter() < ends:
            outcomes.append(await attempt(make))
        return outcomes

    cpu_before = servers.cpu_s()
    started = time.perf_counter()
    streams = asyncio.gather(*(stream(index) for index in range(concurrency)))
    results = await asyncio.wait_for(streams, seconds + REQUEST_TIMEOUT_S)
    elapsed = time.perf_counter() - started
    cpu = {name: used - cpu_before[name] for name, used in servers.cpu_s().items()}
    outcomes = [outcome for outcomes in results for outcome in outcomes]
    samples = [outcome for outcome in outcomes if isinstance(outcome, Sample)]
    errors = [outcome for outcome in outcomes if isinstance(outcome, str)]
    if not samples:
        raise RuntimeError(f"{mode}, {concurrency} streams: every request failed: {errors[0]}")
    first_error = errors[0] if errors else None
    if first_error is not None:
        logger.warning(
            "%s, %d streams: %d failed, first: %s", mode, concurrency, len(errors), first_error
        )
    return _summary(samples, elapsed, cpu) | {"errors": len(errors), "first_error": first_error}


def _summary(samples: list[Sample], elapsed_s: float, cpu_s: dict[str, float]) -> dict[str, Any]:
    """One run's figures: rate, latency percentiles in ms, CPU ms per request per process."""
    values = {
        "ttft": [sample.ttft_s for sample in samples],
        "e2e": [sample.e2e_s for sample in samples],
        "itl": [gap for sample in samples for gap in sample.gaps_s],
    }
    summary: dict[str, Any] = {"requests": len(samples), "seconds": elapsed_s}
    summary["requests_per_s"] = len(samples) / elapsed_s
    for name, seconds in values.items():
        p50, p99 = np.percentile(seconds, [50, 99]) * 1e3
        summary[f"{name}_p50_ms"], summary[f"{name}_p99_ms"] = float(p50), float(p99)
    summary["cpu_ms_per_request"] = {
        name: 1e3 * used / len(samples) for name, used in cpu_s.items()
    }
    return summary


FIGURES = ("requests_per_s", *(f"{n}_{q}_ms" for n in LATENCIES for q in ("p50", "p99")))


def _record(concurrency: int, mode: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over runs of every figure of one (concurrency, mode)."""
    record: dict[str, Any] = {"concurrency": concurrency, "mode": mode}
    record |= {name: statistics.median(run[name] for run in runs) for name in FIGURES}
    record["requests_per_run"] = statistics.median(run["requests"] for run in runs)
    record["errors"] = sum(run["errors"] for run in runs)  # failed requests, left out above
    record["cpu_ms_per_request"] = {
        name: statistics.median(run["cpu_ms_per_request"][name] for run in runs)
        for name in PROCESSES
    }
    record["runs"] = runs
    return record


def _added(
    concurrency: int, proxied: list[dict[str, Any]], direct: list[dict[str, Any]]
) -> dict[str, Any]:
    """What the proxy adds at one concurrency: medians over runs of proxy minus direct, paired."""
    added: dict[str, Any] = {"concurrency": concurrency}
    for name in FIGURES[1:]:
        pairs = zip(proxied, direct, strict=True)
        added[name] = statistics.median(p[name] - d[name] for p, d in pairs)
    added["proxy_cpu_ms_per_request"] = statistics.median(
        run["cpu_ms_per_request"]["proxy"] for run in proxied
    )
    added["meets_goal"] = added["e2e_p50_ms"] < GOAL_ADDED_E2E_P50_MS
    return added


async def _measure(
    servers: Servers,
    concurrency: Sequence[int],
    runs: int,
    run_s: float,
    warmup_s: float,
    output_tokens: int,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Every concurrency, both modes alternating run by run: (records, added latencies)."""
    connector = aiohttp.TCPConnector(limit=0)  # the default of 100 would cap concurrency
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    records, added = [], []
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        generator = LoadGenerator(session, servers, output_tokens)
        for count in concurrency:
            for mode in MODES:  # opens the connections and warms both paths; not counted
                await _one_run(generator, servers, mode, count, warmup_s)
            samples: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
            for run in range(runs):
                for mode in MODES if run % 2 == 0 else MODES[::-1]:
                    samples[mode].append(await _one_run(generator, servers, mode, count, run_s))
            records += [_record(count, mode, samples[mode]) for mode in MODES]
            added.append(_added(count, samples["proxy"], samples["direct"]))
            logger.info(
                "%d streams: proxy adds %.3f ms e2e p50 (%.3f ms TTFT p50), %.0f vs %.0f req/s",
                count,
                added[-1]["e2e_p50_ms"],
                added[-1]["ttft_p50_ms"],
                records[-2]["requests_per_s"],
                records[-1]["requests_per_s"],
            )
    return records, added


def _run_loop(main: Coroutine[Any, Any, Any]) -> Any:
    """Run ``main`` on uvloop when installed (the proxy uses it too), else asyncio's loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


def run_benchmark(
    concurrency: Sequence[int] = (1, 16, 128),
    runs: int = 5,
    run_s: float = 3.0,
    *,
    warmup_s: float = 1.0,
    output_tokens: int = 16,
    first_delay_s: float = 0.0,
    token_delay_s: float = 0.0,
    workdir: Path,
    command: str | None = None,
) -> dict[str, Any]:
    """Start the servers in ``workdir``, measure, stop them; return the JSON document."""
    if output_tokens < 2:
        raise ValueError("output_tokens must be at least 2: one from prefill, the rest decode")
    with start_servers(workdir, first_delay_s, token_delay_s) as servers:
        records, added = _run_loop(
            _measure(servers, concurrency, runs, run_s, warmup_s, output_tokens)
        )
    environment = run_environment(("aiohttp", "msgspec", "lmcache-pd"), command)
    return {
        **environment,
        "settings": {
            "concurrency": list(concurrency),
            "runs": runs,
            "run_s": run_s,
            "warmup_s": warmup_s,
            "output_tokens": output_tokens,
            "first_delay_s": first_delay_s,
            "token_delay_s": token_delay_s,
            "event_loop": "uvloop" if "uvloop" in sys.modules else "asyncio",
            "goal": f"proxy adds under {GOAL_ADDED_E2E_P50_MS} ms per request (e2e p50)",
        },
        "records": records,
        "added": added,
    }


def print_tables(document: dict[str, Any], console: Console | None = None) -> None:
    """Both modes' medians, then what the proxy adds and whether that meets the goal."""
    if console is None:
        console = Console()
        if not console.is_terminal:  # a log or a pipe: rich's 80 columns would cut the figures
            console = Console(width=132)
    settings = document["settings"]
    table = Table(
        title=f"Streamed completions, {settings['output_tokens']} tokens, through the proxy "
        f"and direct (medians of {settings['runs']} runs of {settings['run_s']} s)",
        caption="latencies in ms; CPU: ms per request in that process; errors: failed requests "
        "in all runs, left out of the figures",
    )
    columns = ("streams", "mode", "req/s", "TTFT p50", "TTFT p99", "e2e p50", "e2e p99")
    for column in (*columns, "ITL p50", "ITL p99", "proxy CPU", "client CPU", "errors"):
        table.add_column(column, justify="left" if column == "mode" else "right")
    for record in document["records"]:
        cpu = record["cpu_ms_per_request"]
        table.add_row(
            str(record["concurrency"]),
            record["mode"],
            f"{record['requests_per_s']:.0f}",
            *(f"{record[name]:.3f}" for name in FIGURES[1:]),
            f"{cpu['proxy']:.3f}",
            f"{cpu['client']:.3f}",
            str(record["errors"]),
        )
    console.print(table)
    added = Table(
        title="Added by the proxy, ms (proxy minus direct, paired by run, median over runs)",
        caption=settings["goal"],
    )
    for column in ("streams", "TTFT p50", "TTFT p99", "e2e p50", "e2e p99", "ITL p50"):
        added.add_column(column, justify="right")
    for column in ("ITL p99", "proxy CPU/req", "goal met"):
        added.add_column(column, justify="right")
    for row in document["added"]:
        added.add_row(
            str(row["concurrency"]),
            *(f"{row[name]:+.3f}" for name in FIGURES[1:]),
            f"{row['proxy_cpu_ms_per_request']:.3f}",
            "[green]yes[/green]" if row["meets_goal"] else "[red]no[/red]",
        )
    console.print(added)


app = typer.Typer(add_completion=False, help=__doc__.splitlines()[0])


@app.command()
def main(
    concurrency: Annotated[
        str, typer.Option(help="concurrent streams, comma-separated")
    ] = DEFAULT_CONCURRENCY,
    runs: Annotated[int, typer.Option(min=1, help="timed runs per mode (medians)")] = 5,
    run_seconds: Annotated[float, typer.Option(min=0.01, help="length of each run")] = 3.0,
    warmup_seconds: Annotated[float, typer.Option(min=0.0, help="untimed run per mode")] = 1.0,
    output_tokens: Annotated[int, typer.Option(min=2, help="tokens per answer")] = 16,
    first_delay_ms: Annotated[float, typer.Option(min=0.0, help="prefill's delay")] = 0.0,
    token_delay_ms: Annotated[float, typer.Option(min=0.0, help="decode's per token")] = 0.0,
    output: Annotated[Path, typer.Option(help="where the JSON goes")] = DEFAULT_OUTPUT,
) -> None:
    """Run the benchmark, print the tables and write the JSON."""
    import tempfile

    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per health poll otherwise
    counts = [int(item) for item in concurrency.split(",") if item.strip()]
    if not counts or min(counts) < 1:
        raise typer.BadParameter(f"no positive stream counts in {concurrency!r}")
    with tempfile.TemporaryDirectory(prefix="lmcache-pd-proxy-bench-") as workdir:
        document = run_benchmark(
            counts,
            runs,
            run_seconds,
            warmup_s=warmup_seconds,
            output_tokens=output_tokens,
            first_delay_s=first_delay_ms / 1e3,
            token_delay_s=token_delay_ms / 1e3,
            workdir=Path(workdir),
        )
    print_tables(document)
    write_json(output, document)
    logger.info("wrote %s", output)


if __name__ == "__main__":
    app()
