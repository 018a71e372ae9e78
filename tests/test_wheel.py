"""The wheel built from the tree holds every library module, its compiled copy kernel and the
``lmcache-pd`` command, and nothing of ``benchmarks/`` or ``tests/``.

An editable install hides a package the build leaves out (issue 30: the wheel once had no
``connector/``, so vLLM could not load the connector from a plain ``pip install``). The build runs
on a copy of the checkout, offline, with the setuptools already in the venv, so it neither reads
nor leaves a ``build/`` folder or egg-info in the working tree.
"""

from __future__ import annotations

import configparser
import fnmatch
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.processes

REPO = Path(__file__).resolve().parent.parent
# the folder of each library root in the checkout -> where its files sit in the wheel
ROOTS = {"lmcache_pd": "lmcache_pd", "kernels": "lmcache_pd/kernels", "proxy": "lmcache_pd/proxy"}
COMPILED = "lmcache_pd/kernels/_cpu_block_copy*.so"
NOT_SHIPPED = ("benchmarks", "tests")
ENTRY_POINT = ("lmcache-pd", "lmcache_pd.cli:app")
BUILD_TIMEOUT_S = 300
# build with the setuptools in this venv, never fetching anything
OFFLINE = ("--no-build-isolation", "--no-index")


def library_modules(tree: Path) -> set[str]:
    """Every ``.py`` under the library's folders, named as it lands in the wheel."""
    return {
        f"{inside}/{path.relative_to(tree / folder).as_posix()}"
        for folder, inside in ROOTS.items()
        for path in (tree / folder).rglob("*.py")
        if "__pycache__" not in path.parts
    }


def wheel_problems(modules: set[str], listing: Iterable[str]) -> list[str]:
    """What a wheel's file list gets wrong: a library module or the compiled kernel missing, a
    file of benchmarks/ or tests/ (or any Python file that is no library module) present."""
    names = set(listing)
    problems = [f"{module} is missing" for module in sorted(modules - names)]
    if not fnmatch.filter(names, COMPILED):
        problems.append(f"{COMPILED} is missing")
    problems += [
        f"{name} should not be in the wheel"
        for name in sorted(names)
        if name.split("/")[0] in NOT_SHIPPED or (name.endswith(".py") and name not in modules)
    ]
    return problems


def console_scripts(wheel: zipfile.ZipFile) -> dict[str, str]:
    (entry_points,) = fnmatch.filter(wheel.namelist(), "*.dist-info/entry_points.txt")
    parser = configparser.ConfigParser()
    parser.read_string(wheel.read(entry_points).decode())
    return dict(parser["console_scripts"]) if parser.has_section("console_scripts") else {}


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The checkout without what a build or a run leaves in it (built .so included, so the
    build must compile the kernel itself)."""
    tree = tmp_path_factory.mktemp("source") / "lmcache-pd"
    ignored = (".git", ".venv", "build", "*.egg-info", "__pycache__", ".*cache", ".hypothesis")
    shutil.copytree(REPO, tree, ignore=shutil.ignore_patterns(*ignored, "*.so"))
    return tree


@pytest.fixture(scope="module")
def wheel(source: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[zipfile.ZipFile]:
    out = tmp_path_factory.mktemp("wheel")
    pip_wheel = [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", *OFFLINE]
    subprocess.run(
        [*pip_wheel, "--wheel-dir", str(out), str(source)],
        check=True,
        timeout=BUILD_TIMEOUT_S,
    )
    (built,) = out.glob("lmcache_pd-*.whl")
    with zipfile.ZipFile(built) as opened:
        yield opened


def test_the_wheel_holds_every_library_module_and_the_compiled_kernel_and_no_benchmarks_or_tests(
    source: Path, wheel: zipfile.ZipFile
) -> None:
    problems = wheel_problems(library_modules(source), wheel.namelist())
    assert not problems, "\n".join(problems)


def test_the_wheel_declares_the_lmcache_pd_command(wheel: zipfile.ZipFile) -> None:
    name, target = ENTRY_POINT
    assert console_scripts(wheel).get(name) == target


def test_a_module_left_out_of_the_wheel_is_named(source: Path) -> None:
    modules = library_modules(source)
    listing = modules | {"lmcache_pd/kernels/_cpu_block_copy.cpython-311-x86_64-linux-gnu.so"}
    assert wheel_problems(modules, listing) == []
    left_out = "lmcache_pd/connector/facade.py"
    assert wheel_problems(modules, listing - {left_out}) == [f"{left_out} is missing"]
    assert wheel_problems(modules, modules) == [f"{COMPILED} is missing"]


def test_a_benchmark_or_test_in_the_wheel_is_named(source: Path) -> None:
    modules = library_modules(source)
    listing = modules | {"lmcache_pd/kernels/_cpu_block_copy.abi3.so", "benchmarks/chaos.py"}
    assert wheel_problems(modules, listing) == ["benchmarks/chaos.py should not be in the wheel"]


def test_a_wheel_without_the_command_is_caught(tmp_path: Path) -> None:
    with zipfile.ZipFile(tmp_path / "x.whl", "w") as built:
        built.writestr("x-0.dist-info/entry_points.txt", "[console_scripts]\nother = x:app\n")
    with zipfile.ZipFile(tmp_path / "x.whl") as built:
        assert ENTRY_POINT[0] not in console_scripts(built)
