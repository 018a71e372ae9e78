"""The systems the serving benchmark compares, each a context manager with a base ``url``:

- ``lmcache-pd``: 1 prefill + 1 decode vLLM with our connector (the pool launcher), behind our
  proxy in its own process, every process tracing its per-request phases;
- ``lmcache-pd-nocache``: the same with the consumer's cache of landed chunks off;
- ``lmcache-pd-noauth``: the same with no deployment secret (the KV channel unauthenticated);
- ``lmcache-pd-anycore``: the same with our threads on any core (the others keep them on
  decode's, off prefill's);
- ``lmcache-pd-processes-anywhere``: the same with each instance's API server and engine core
  on any core (the others keep every process of an instance on its core, ``process_cpus``);
- ``colocated``: one plain vLLM instance doing prefill and decode;
- ``prefill-cores``: one plain vLLM instance on exactly the prefill instance's cores: what a
  request costs on the hardware lmcache-pd's prompt runs on, so that lmcache-pd's TTFT over its
  TTFT is the cost of disaggregation alone (the colocated instance has both cores, each PD
  instance one);
- ``prefill-cores-processes-anywhere``: the same with its API server and engine core on any
  core (the other one idle), as ``prefill-cores`` was until 2026-11-25;
- ``nixl``: vLLM's own NixlConnector, 1 prefill + 1 decode, behind the small router of
  ``nixl_baseline.py`` that follows vLLM's documented protocol.

All run the same model with the same flags (fp32, eager, the same vLLM arguments, stats on); the
PD pairs get one core per instance (``PREFILL_CPUS``, ``DECODE_CPUS``), every process of an
instance on it as in configs/pools.yaml (``process_cpus``), and the colocated instance the same
two cores. Each names its
``decode_url``: the instance whose ``vllm:prompt_tokens_by_source_total`` says where decode's
prompt tokens came from (loaded, its own prefix cache, computed).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any, ClassVar

from lmcache_pd.deploy.launcher import PoolLauncher, unused_port
from lmcache_pd.deploy.pools import InstanceSpec, PoolsConfig, ProxySpec
from lmcache_pd.deploy.vllm_server import VLLMServer, wait_until_healthy
from lmcache_pd.trace import read_trace

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
PROXY_START_TIMEOUT_S = 30.0
SYSTEMS = (
    "lmcache-pd",
    "lmcache-pd-nocache",
    "lmcache-pd-noauth",
    "lmcache-pd-async-loads",
    "lmcache-pd-answer-only",
    "lmcache-pd-anycore",
    "lmcache-pd-processes-anywhere",
    "colocated",
    "prefill-cores",
    "prefill-cores-processes-anywhere",
    "nixl",
)
# What ``python -m benchmarks.serving`` compares unless told otherwise.
DEFAULT_SYSTEMS = ("lmcache-pd", "colocated", "prefill-cores", "nixl")
PREFILL_CPUS, DECODE_CPUS = "0", "1"


class LmcachePD:
    """Our 1P1D pools and proxy, as ``lmcache-pd serve`` would run them, with tracing on."""

    name = "lmcache-pd"
    consumer_env: ClassVar[dict[str, str]] = {}
    # Where our own threads (senders, the consumer's service) run: as configs/pools.yaml, on
    # decode's core, so that a push does not take prefill's core from the next prefill (None:
    # wherever the kernel puts them).
    our_cpus: ClassVar[str | None] = DECODE_CPUS
    # Every process of an instance on its core, as configs/pools.yaml: vLLM's engine core spins
    # between steps, and left anywhere decode's takes prefill's core from its next prompt.
    processes_on_own_cpus: ClassVar[bool] = True
    # The proxy on decode's core too, as configs/pools.yaml: on prefill's, or anywhere, it
    # takes time from the prompt whose first token it waits for.
    proxy_cpus: ClassVar[str | None] = DECODE_CPUS
    # Decode asked on prefill's first-token notice (``first_token.py``), not on its answer only.
    first_token_notices: ClassVar[bool] = True
    # The KV channel authenticated by a deployment secret (``lmcache_pd/auth.py``), as `serve`.
    kv_secret: ClassVar[bool] = True

    def __init__(self, model: Path, workdir: Path, vllm_args: list[str]) -> None:
        self.workdir = workdir
        port = unused_port(set())
        self.url = f"http://127.0.0.1:{port}"
        pools = PoolsConfig(
            model=str(model),
            prefill=[
                InstanceSpec(
                    config=str(CONFIGS / "producer.yaml"),
                    cpus=PREFILL_CPUS,
                    thread_cpus=self.our_cpus,
                    process_cpus=PREFILL_CPUS if self.processes_on_own_cpus else None,
                )
            ],
            decode=[
                InstanceSpec(
                    config=str(CONFIGS / "consumer.yaml"),
                    cpus=DECODE_CPUS,
                    thread_cpus=self.our_cpus,
                    process_cpus=DECODE_CPUS if self.processes_on_own_cpus else None,
                    env=self.consumer_env,
                )
            ],
            proxy=ProxySpec(
                port=port, cpus=self.proxy_cpus, first_token_notices=self.first_token_notices
            ),
            vllm_args=vllm_args,
            trace=True,
        )
        self._launcher = PoolLauncher(pools, workdir, kv_secret=self.kv_secret)
        self._proxy: subprocess.Popen | None = None

    @property
    def decode_url(self) -> str:
        return self._launcher.servers["decode-0"].url

    def __enter__(self) -> LmcachePD:
        self._launcher.start()
        try:
            self._proxy = subprocess.Popen(
                [sys.executable, "-m", "lmcache_pd.cli", "proxy", str(self.workdir / "proxy.yaml")],
                stdout=(self.workdir / "proxy.log").open("w"),
                stderr=subprocess.STDOUT,
            )
            wait_until_healthy(self.url, self._proxy, PROXY_START_TIMEOUT_S)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if self._proxy is not None:
            self._proxy.terminate()
            self._proxy.wait(30)
        self._launcher.stop()

    def breakdown(self) -> dict[str, dict[str, Any]]:
        """Per request (keyed by the proxy's response id): where its time went."""
        pushes: dict[str, list[dict]] = {}
        for record in read_trace(self.workdir / "prefill-0.trace.jsonl"):
            pushes.setdefault(record["req_id"], []).append(record)
        loads = {r["req_id"]: r for r in read_trace(self.workdir / "decode-0.trace.jsonl")}
        phases = {}
        for record in read_trace(self.workdir / "proxy.trace.jsonl"):
            req_id, prefilled = record["req_id"], record.get("prefilled")
            own_pushes, load = pushes.get(req_id, []), loads.get(req_id)
            if prefilled is None or load is None or not own_pushes:
                continue
            push_start = min(p["start"] for p in own_pushes)
            push_end = max(p["end"] for p in own_pushes)
            phases[f"cmpl-{req_id}"] = first_gap_stages(record, load) | {
                "prefill_ms": (prefilled - record["arrived"]) * 1e3,
                "kv_bytes": sum(p.get("bytes", 0) for p in own_pushes),
                "chunks_skipped": sum(p.get("skipped", 0) for p in own_pushes),
                "transfer_ms": (push_end - push_start) * 1e3,
                "exposed_transfer_ms": (load["done_at"] - prefilled) * 1e3,
                "loaded": load["outcome"] == "loaded",
                "arrived": record["arrived"],
                "prefilled": prefilled,
                "push_start": push_start,
                "push_end": push_end,
                "decode_sent": record.get("decode_sent"),
                "kv_loaded": load["done_at"],
                "done": record["done"],
            }
        return phases


def first_gap_stages(proxy: dict[str, Any], load: dict[str, Any]) -> dict[str, float]:
    """Where the first-to-second-token gap goes, in ms: how long before the client's first token
    decode was asked (``first_token.py``'s head start), from then until decode's step begins
    (its API server and the step it waits behind), the load in that step, and from the load to
    decode's first token at the proxy (the rest of the step, vLLM's output path, the relay)."""
    sent, first = proxy.get("decode_sent"), proxy.get("first_sent")
    token = proxy.get("decode_first")
    if sent is None or first is None or token is None:
        return {}
    return {
        "decode_head_start_ms": (first - sent) * 1e3,
        "decode_asked_to_step_ms": (load["queued_at"] - sent) * 1e3,
        "load_ms": (load["done_at"] - load["queued_at"]) * 1e3,
        "load_to_decode_token_ms": (token - load["done_at"]) * 1e3,
        "gap_at_proxy_ms": (token - first) * 1e3,
    }


class LmcachePDNoCache(LmcachePD):
    """lmcache-pd with the consumer's cache of landed chunks off (``cache_share: 0``): the same
    run's control for what keeping chunks for reuse buys or costs."""

    name = "lmcache-pd-nocache"
    consumer_env: ClassVar[dict[str, str]] = {"LMCACHE_PD_CACHE_SHARE": "0"}


class LmcachePDNoAuth(LmcachePD):
    """lmcache-pd with no deployment secret (every ZMQ socket plain, notifications unsealed):
    the same run's control for what authenticating the KV channel costs."""

    name = "lmcache-pd-noauth"
    kv_secret: ClassVar[bool] = False


class LmcachePDAsyncLoads(LmcachePD):
    """lmcache-pd with every load asynchronous (``sync_loads: false``): the same run's control
    for what loading landed KV before the request's first step buys or costs."""

    name = "lmcache-pd-async-loads"
    consumer_env: ClassVar[dict[str, str]] = {"LMCACHE_PD_SYNC_LOADS": "false"}


class LmcachePDAnswerOnly(LmcachePD):
    """lmcache-pd with decode asked on prefill's HTTP answer only (no first-token notices): the
    same run's control for what asking decode on the engine's notice buys or costs."""

    name = "lmcache-pd-answer-only"
    first_token_notices: ClassVar[bool] = False


class LmcachePDAnyCore(LmcachePD):
    """lmcache-pd with our threads where the kernel puts them: the same run's control for what
    keeping them off prefill's core buys or costs."""

    name = "lmcache-pd-anycore"
    our_cpus: ClassVar[str | None] = None


class LmcachePDProcessesAnywhere(LmcachePD):
    """lmcache-pd with each instance's API server and engine core where the kernel puts them:
    the same run's control for what ``process_cpus`` buys or costs."""

    name = "lmcache-pd-processes-anywhere"
    processes_on_own_cpus: ClassVar[bool] = False


class Colocated:
    """One plain vLLM instance, on the cores the PD pairs use between them."""

    name = "colocated"
    cpus = "0-1"  # PREFILL_CPUS and DECODE_CPUS
    processes_on_own_cpus: ClassVar[bool] = True  # as LmcachePD's

    def __init__(self, model: Path, workdir: Path, vllm_args: list[str]):
        self._server = VLLMServer(
            model,
            unused_port(set()),
            workdir / f"{self.name}.log",
            cpu=self.cpus,
            process_cpus=self.cpus if self.processes_on_own_cpus else None,
            extra_args=vllm_args,
            log_stats=True,
            wait=False,
        )
        self.url = self.decode_url = self._server.url

    def __enter__(self) -> Colocated:
        self._server.wait_until_healthy()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.stop()

    def breakdown(self) -> dict[str, dict[str, Any]]:
        return {}


class PrefillCores(Colocated):
    """One plain vLLM instance on the prefill instance's cores only, every process of it as
    lmcache-pd's prefill instance (its engine core and API server too: left anywhere they run
    on the idle other core): lmcache-pd's TTFT over its TTFT is what disaggregation costs,
    apart from lmcache-pd having two cores to its one."""

    name = "prefill-cores"
    cpus = PREFILL_CPUS


class PrefillCoresProcessesAnywhere(PrefillCores):
    """``prefill-cores`` with its API server and engine core on any core: on this 2-core host
    they then run on the idle one, so its prompts have a core to themselves that lmcache-pd's
    prefill instance does not."""

    name = "prefill-cores-processes-anywhere"
    processes_on_own_cpus: ClassVar[bool] = False


class NixlPD:
    """vLLM's NixlConnector 1P1D behind its protocol's router."""

    name = "nixl"

    def __init__(self, model: Path, workdir: Path, vllm_args: list[str]) -> None:
        from benchmarks.nixl_baseline import NixlBaseline

        self._baseline = NixlBaseline(
            model, workdir, extra_args=vllm_args, log_stats=True, whole_instance_on_its_cpu=True
        )
        self.url = self.decode_url = ""

    def __enter__(self) -> NixlPD:
        self._baseline.__enter__()
        self.url = self._baseline.url
        assert self._baseline.decode is not None
        self.decode_url = self._baseline.decode.url
        self._baseline.warm_up()  # the one-off first P->D handshake, not measured
        return self

    def __exit__(self, *exc: object) -> None:
        self._baseline.__exit__(*exc)

    def breakdown(self) -> dict[str, dict[str, Any]]:
        return {}


def make_system(name: str, model: Path, workdir: Path, vllm_args: list[str]):
    """The system called ``name`` (one of ``SYSTEMS``), not yet started."""
    workdir.mkdir(parents=True, exist_ok=True)
    kinds = {
        "lmcache-pd": LmcachePD,
        "lmcache-pd-nocache": LmcachePDNoCache,
        "lmcache-pd-noauth": LmcachePDNoAuth,
        "lmcache-pd-async-loads": LmcachePDAsyncLoads,
        "lmcache-pd-answer-only": LmcachePDAnswerOnly,
        "lmcache-pd-anycore": LmcachePDAnyCore,
        "lmcache-pd-processes-anywhere": LmcachePDProcessesAnywhere,
        "colocated": Colocated,
        "prefill-cores": PrefillCores,
        "prefill-cores-processes-anywhere": PrefillCoresProcessesAnywhere,
        "nixl": NixlPD,
    }
    if name not in kinds:
        raise ValueError(f"unknown system {name!r} (known: {', '.join(SYSTEMS)})")
    return kinds[name](model, workdir, vllm_args)
