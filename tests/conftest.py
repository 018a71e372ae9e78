"""Fixtures shared by the tests: a chunk keyer, the tiny model and the reference vLLM; and the
hooks that hold each test to its lane (tests/lanes.py), share the suite between `make test`'s
two workers (tests/workers.py) and stop the reference vLLM once its last user is done."""

import os
import platform
from collections.abc import Iterator
from pathlib import Path

import pytest
from xdist.remote import Producer

from lmcache_pd.deploy import launcher
from lmcache_pd.harness.model_maker import ensure_model
from lmcache_pd.keys import ChunkKeyer
from tests.helpers import make_keyer
from tests.lanes import in_fast_lane, processes_refused
from tests.vllm_support import MODEL_DIR, PlainVLLM
from tests.workers import ModulesThenVLLM, order_for_workers

# The openai client reads platform.platform() on its first request, and that runs `uname -p`
# once per process: run here, at collection, not first inside a fast-lane test (which may start
# no process) when a file is run alone.
platform.platform()

PLAIN_VLLM = pytest.StashKey[PlainVLLM]()
PLAIN_VLLM_WANTED = pytest.StashKey[bool]()
LAST_PLAIN_VLLM_USER = pytest.StashKey[bool]()


@pytest.fixture
def keyer() -> ChunkKeyer:
    return make_keyer()


@pytest.fixture(scope="session")
def model() -> Path:
    """The tiny Llama every vLLM test serves, built once (and kept between runs)."""
    return ensure_model(MODEL_DIR)


@pytest.fixture(scope="session")
def plain_vllm(
    model: Path, tmp_path_factory: pytest.TempPathFactory, pytestconfig: pytest.Config
) -> Iterator[PlainVLLM]:
    """The reference vLLM (core 0, the shared server arguments), one for every module that
    compares with it: started by the first test that needs it, stopped after the last one."""
    plain = PlainVLLM(model, tmp_path_factory.mktemp("plain-vllm") / "plain.log")
    pytestconfig.stash[PLAIN_VLLM] = plain
    try:
        yield plain
    finally:
        plain.stop()


def pytest_configure() -> None:
    """Each of `make test`'s workers picks ports (``launcher.unused_port``) from its own share of
    the range: a port is picked free and bound only when its instance is up, up to ~90 s later,
    and a TP-2 decode's init port was taken in between once (2026-12-02; by whom is not known,
    the other worker's picks the likely taker)."""
    worker, workers = (
        os.environ.get("PYTEST_XDIST_WORKER"),
        os.environ.get("PYTEST_XDIST_WORKER_COUNT"),
    )
    if worker is None or workers is None:
        return
    share = (launcher.ephemeral_port_start() - launcher.PORT_FLOOR) // int(workers)
    launcher.PORT_FLOOR += share * int(worker.removeprefix("gw"))
    launcher.PORT_CEILING = launcher.PORT_FLOOR + share - 1


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    order_for_workers(items)


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook
def pytest_xdist_make_scheduler(config: pytest.Config, log: Producer) -> ModulesThenVLLM:
    return ModulesThenVLLM(config, log)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Which test is the reference vLLM's last user, once -k and -m have deselected."""
    items = session.items
    users = [item for item in items if "plain_vllm" in getattr(item, "fixturenames", ())]
    if users:
        users[-1].stash[LAST_PLAIN_VLLM_USER] = True
        users[-1].config.stash[PLAIN_VLLM_WANTED] = True


@pytest.fixture(autouse=True)
def _reference_starts_with_the_first_vllm_test(request: pytest.FixtureRequest) -> None:
    """The reference vLLM starts in the setup of the session's first test that starts vLLM (after
    that test's module fixtures), not of its first user: a vLLM start is mostly one process
    importing at a time, so beside others it costs little wall time, alone ~35 s. It then waits
    idle (no CPU) until used."""
    config = request.config
    if (
        config.stash.get(PLAIN_VLLM_WANTED, False)
        and PLAIN_VLLM not in config.stash
        and request.node.get_closest_marker("vllm") is not None
    ):
        request.getfixturevalue("plain_vllm")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Iterator[None]:
    """The reference vLLM stops as soon as no test left needs it, not at the session's end:
    the tests after it get its core and memory back."""
    result = yield
    if item.stash.get(LAST_PLAIN_VLLM_USER, False) and PLAIN_VLLM in item.config.stash:
        item.config.stash[PLAIN_VLLM].stop()
    return result


def _in_its_lane(item: pytest.Item) -> Iterator[None]:
    """One phase of a test; in the fast lane, with every way to start a process refused."""
    if not in_fast_lane(item):
        return (yield)
    with processes_refused(item.nodeid) as refusals:
        result = yield
    if refusals:  # refused in a thread, or caught by the code under test
        pytest.fail(refusals[0], pytrace=False)
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    # Setup too: a module's fixtures are set up within its first test's setup.
    return (yield from _in_its_lane(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    return (yield from _in_its_lane(item))
