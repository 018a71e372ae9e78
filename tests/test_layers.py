"""The layers' import rules (STYLE.md rule 16, issue 30), read from the source with ``ast``.

Every import counts, wherever it is written: at module level, inside a function (a lazy import
still loads its module when it runs) and under ``if TYPE_CHECKING:`` (a type-only import still
ties the two files together for a reader and for the type checker). The folders are the layers:
``contracts`` (the modules at the top of ``lmcache_pd/``), ``cli``, ``transfer``, ``connector``,
``deploy``, ``harness``, ``kernels`` and ``proxy``. Each rule's checker takes the root of a tree,
so the negative controls run the same checker on a copy with one violating import planted.
"""

from __future__ import annotations

import ast
import functools
import shutil
from collections import defaultdict, deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# the importable name of each library root -> its folder in the checkout (as in setup.py)
ROOTS = {"lmcache_pd": "lmcache_pd", "lmcache_pd.kernels": "kernels", "lmcache_pd.proxy": "proxy"}
# what a module at the top of lmcache_pd/ (or lmcache_pd/__init__.py) belongs to
CONTRACTS = "contracts"
FOLDERS = (CONTRACTS, "cli", "transfer", "connector", "deploy", "harness", "kernels", "proxy")


@dataclass(frozen=True)
class Import:
    """One imported name, where it was written; ``target`` is absolute (relative ones resolved)."""

    importer: str
    file: str
    line: int
    target: str

    @property
    def top(self) -> str:
        return self.target.split(".")[0]

    def __str__(self) -> str:
        return f"{self.file}:{self.line} imports {self.target}"


@dataclass(frozen=True)
class Library:
    """The library's modules (name -> file relative to the tree) and every import they make."""

    files: dict[str, str]
    packages: frozenset[str]
    # C extensions, named after their source (kernels/_cpu_block_copy.c): modules with no imports
    compiled: frozenset[str]
    imports: tuple[Import, ...]
    shadowed: tuple[str, ...]

    def known(self, target: str) -> str | None:
        """The module of ours that importing ``target`` runs last: its longest known prefix."""
        parts = target.split(".")
        for end in range(len(parts), 0, -1):
            name = ".".join(parts[:end])
            if name in self.files or name in self.compiled:
                return name
        return None

    def folder(self, module: str) -> str | None:
        """The layer ``module`` is in, or None when it is not ours."""
        parts = module.split(".")
        if parts[0] != "lmcache_pd":
            return None
        if len(parts) > 1 and f"lmcache_pd.{parts[1]}" in self.packages:
            return parts[1]
        return CONTRACTS

    def edges(self) -> Iterator[tuple[Import, str]]:
        """Each import between two modules of ours, with the module it runs.

        An edge goes to the module an import names, not to the packages Python runs on the way
        there: otherwise every ``__init__`` that re-exports a submodule would read as a cycle.
        """
        for imp in self.imports:
            module = self.known(imp.target)
            if module is not None:
                yield imp, module

    def imports_by_module(self) -> dict[str, list[Import]]:
        by_module: dict[str, list[Import]] = defaultdict(list)
        for imp in self.imports:
            by_module[imp.importer].append(imp)
        return by_module


def module_name(root: str, relative: Path) -> str:
    parts = list(relative.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([root, *parts])


def absolute_base(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The package a ``from ... import`` reads from, with its dots resolved against ``module``."""
    if node.level == 0:
        return node.module or ""
    package = module.split(".") if is_package else module.split(".")[:-1]
    base = package[: len(package) - node.level + 1]
    return ".".join([*base, node.module] if node.module else base)


@functools.cache
def imports_in(
    source: str, module: str, is_package: bool, file: str, known: frozenset[str]
) -> tuple[Import, ...]:
    """Every import in one file: module level, in functions and under ``if TYPE_CHECKING:``.

    Cached: the negative controls read the same unchanged files once per planted import."""
    found = []
    for node in ast.walk(ast.parse(source, filename=file)):
        if isinstance(node, ast.Import):
            found += [Import(module, file, node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = absolute_base(node, module, is_package)
            for alias in node.names:
                # `from pkg import name`: a submodule when pkg.name is one of ours, else pkg itself
                sub = f"{base}.{alias.name}"
                found.append(Import(module, file, node.lineno, sub if sub in known else base))
    return tuple(dict.fromkeys(found))  # `from pkg import a, b` is one import of pkg


def read_library(tree: Path) -> Library:
    """Parse every ``.py`` under the library's roots in ``tree``."""
    sources: dict[str, Path] = {}
    shadowed = []
    for root, folder in ROOTS.items():
        for path in sorted((tree / folder).rglob("*.py")):
            name = module_name(root, path.relative_to(tree / folder))
            if name in sources:  # x.py beside the package x/: Python imports the package
                package_first = sorted([sources[name], path], key=lambda p: p.name != "__init__.py")
                sources[name] = package_first[0]
                shadowed.append(package_first[1].relative_to(tree).as_posix())
            else:
                sources[name] = path
    packages = frozenset(name for name, path in sources.items() if path.name == "__init__.py")
    compiled = frozenset(
        module_name(root, path.relative_to(tree / folder))
        for root, folder in ROOTS.items()
        for path in (tree / folder).rglob("*.c")
    )
    files = {name: path.relative_to(tree).as_posix() for name, path in sources.items()}
    known = frozenset(sources) | compiled
    imports: list[Import] = []
    for name, path in sources.items():
        imports += imports_in(path.read_text(), name, name in packages, files[name], known)
    return Library(files, packages, compiled, tuple(imports), tuple(sorted(shadowed)))


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's components of more than one node or with a self-loop: the cycles."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or node in graph.get(node, ()):
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def cycle_messages(links: dict[tuple[str, str], list[Import]]) -> list[str]:
    """One message per cycle, listing every import that joins two of its members; the links
    with fewest imports first, since the one that points the wrong way is usually alone."""
    graph: dict[str, set[str]] = defaultdict(set)
    for source, target in links:
        graph[source].add(target)
    messages = []
    for component in strongly_connected(graph):
        inside = [
            (f"{source} -> {target}", imps)
            for (source, target), imps in links.items()
            if source in component and target in component
        ]
        joins = [
            f"{link}: " + "; ".join(map(str, imps))
            for link, imps in sorted(inside, key=lambda pair: (len(pair[1]), pair[0]))
        ]
        messages.append(f"cycle between {', '.join(component)}\n  " + "\n  ".join(joins))
    return messages


def file_cycles(lib: Library) -> list[str]:
    links: dict[tuple[str, str], list[Import]] = defaultdict(list)
    for imp, module in lib.edges():
        links[(imp.importer, module)].append(imp)
    return cycle_messages(links)


def folder_cycles(lib: Library) -> list[str]:
    links: dict[tuple[str, str], list[Import]] = defaultdict(list)
    for imp, module in lib.edges():
        source, target = lib.folder(imp.importer), lib.folder(module)
        if source != target:
            links[(source, target)].append(imp)
    return cycle_messages(links)


def outside(lib: Library, folder: str, allowed: Iterable[str]) -> list[str]:
    """Imports from ``folder`` into any folder of ours but ``allowed``."""
    allowed = set(allowed)
    return [
        f"{imp} ({folder} may import only {', '.join(sorted(allowed))})"
        for imp in lib.imports
        if lib.folder(imp.importer) == folder
        and lib.folder(imp.target) is not None
        and lib.folder(imp.target) not in allowed
    ]


def contracts_reach_up(lib: Library) -> list[str]:
    return outside(lib, CONTRACTS, [CONTRACTS])


def kernels_reach_up(lib: Library) -> list[str]:
    return outside(lib, "kernels", [CONTRACTS, "kernels"])


def deploy_reaches_out(lib: Library) -> list[str]:
    return outside(lib, "deploy", [CONTRACTS, "proxy", "deploy"])


def transfer_reaches_up(lib: Library) -> list[str]:
    forbidden = {"connector", "proxy", "deploy", "harness", "cli"}
    return [
        f"{imp} (the transfer core never imports {', '.join(sorted(forbidden))} or vllm)"
        for imp in lib.imports
        if lib.folder(imp.importer) == "transfer"
        and (lib.folder(imp.target) in forbidden or imp.top == "vllm")
    ]


def proxy_loads_heavy(lib: Library) -> list[str]:
    """What the proxy loads, through any chain of our modules, from transfer, kernels, torch or
    NIXL. Importing a module runs its packages' ``__init__`` first, so those are walked too."""
    by_module = lib.imports_by_module()
    via: dict[str, str] = {}  # module -> how the proxy gets to it
    queue: deque[str] = deque()

    def reach(module: str, how: str) -> None:
        parts = module.split(".")
        for end in range(1, len(parts) + 1):
            name = ".".join(parts[:end])
            if name in lib.files and name not in via:
                via[name] = how if end == len(parts) else f"{how or module} -> runs {name}"
                queue.append(name)

    for module in lib.files:
        if lib.folder(module) == "proxy":
            reach(module, "")
    found = []
    while queue:
        module = queue.popleft()
        for imp in by_module[module]:
            chain = f"{via[module]} -> {imp}" if via[module] else str(imp)
            if lib.folder(imp.target) in {"transfer", "kernels"} or imp.top in {"torch", "nixl"}:
                found.append(f"the proxy loads: {chain}")
            elif (target := lib.known(imp.target)) is not None:
                reach(target, chain)
    return found


def benchmarks_or_tests_imported(lib: Library) -> list[str]:
    return [
        f"{imp} (the library never imports benchmarks or tests)"
        for imp in lib.imports
        if imp.top in {"benchmarks", "tests"}
    ]


def vllm_outside_connector(lib: Library) -> list[str]:
    return [
        f"{imp} (vllm only in lmcache_pd/connector/)"
        for imp in lib.imports
        if imp.top == "vllm" and lib.folder(imp.importer) != "connector"
    ]


def nixl_outside_channel(lib: Library) -> list[str]:
    return [
        f"{imp} (nixl only in lmcache_pd/transfer/channel.py)"
        for imp in lib.imports
        if imp.top == "nixl" and imp.importer != "lmcache_pd.transfer.channel"
    ]


def shadowed_files(lib: Library) -> list[str]:
    return [f"{file}: a package of the same name takes its import" for file in lib.shadowed]


def unknown_folders(lib: Library) -> list[str]:
    return [
        f"{lib.files[module]}: folder {lib.folder(module)!r} is none of {', '.join(FOLDERS)}"
        for module in lib.files
        if lib.folder(module) not in FOLDERS
    ]


@pytest.fixture(scope="module")
def library() -> Library:
    return read_library(REPO)


def assert_none(violations: list[str]) -> None:
    assert not violations, "\n".join(violations)


def test_the_checker_reads_every_layer_and_the_imports_inside_functions(library: Library) -> None:
    assert {library.folder(m) for m in library.files} == set(FOLDERS)
    lazy = [i for i in library.imports if i.importer == "lmcache_pd.transfer.channel"]
    assert any(i.top == "nixl" for i in lazy)  # channel.py imports NIXL inside functions


def test_every_library_file_is_the_module_its_path_names(library: Library) -> None:
    assert_none(shadowed_files(library))


def test_every_library_module_sits_in_a_known_layer(library: Library) -> None:
    assert_none(unknown_folders(library))


def test_no_import_cycle_between_files(library: Library) -> None:
    assert_none(file_cycles(library))


def test_no_import_cycle_between_folders(library: Library) -> None:
    assert_none(folder_cycles(library))


def test_contracts_import_only_contracts(library: Library) -> None:
    assert_none(contracts_reach_up(library))


def test_kernels_import_only_contracts_and_kernels(library: Library) -> None:
    assert_none(kernels_reach_up(library))


def test_transfer_core_never_imports_connector_proxy_deploy_harness_cli_or_vllm(
    library: Library,
) -> None:
    assert_none(transfer_reaches_up(library))


def test_proxy_never_loads_transfer_kernels_torch_or_nixl_even_through_our_modules(
    library: Library,
) -> None:
    assert_none(proxy_loads_heavy(library))


def test_deploy_imports_only_contracts_proxy_and_deploy(library: Library) -> None:
    assert_none(deploy_reaches_out(library))


def test_library_never_imports_benchmarks_or_tests(library: Library) -> None:
    assert_none(benchmarks_or_tests_imported(library))


def test_vllm_is_imported_only_in_the_connector(library: Library) -> None:
    assert_none(vllm_outside_connector(library))


def test_nixl_is_imported_only_in_the_channel(library: Library) -> None:
    assert_none(nixl_outside_channel(library))


Checker = Callable[[Library], list[str]]
# where a planted import goes: the lines that open its block
SCOPES = {
    "module": (),
    "function": ("def planted() -> None:",),
    "type_checking": ("if TYPE_CHECKING:",),
}


@dataclass(frozen=True)
class Plant:
    """One violating import to plant, and what the one new violation must say."""

    checker: Checker
    file: str
    statement: str
    says: str
    scope: str = "module"  # a key of SCOPES

    def __str__(self) -> str:
        return f"{self.checker.__name__}-{self.file}-{self.scope}-{self.statement}"

    def into(self, file: Path) -> int:
        """Append the import after everything (so no line above moves); returns its line."""
        lines = file.read_text().splitlines()
        opener = SCOPES[self.scope]
        indent = "    " if opener else ""
        file.write_text("\n".join([*lines, "", *opener, f"{indent}{self.statement}", ""]))
        return len(lines) + 2 + len(opener)


PLANTS = [
    Plant(
        file_cycles,
        "lmcache_pd/errors.py",
        "from lmcache_pd import protocol",
        "imports lmcache_pd.protocol",
    ),
    Plant(
        file_cycles,
        "lmcache_pd/errors.py",
        "from . import protocol",
        "imports lmcache_pd.protocol",
        scope="type_checking",
    ),
    Plant(
        folder_cycles,
        "lmcache_pd/keys.py",
        "from lmcache_pd.transfer import allocator",
        "imports lmcache_pd.transfer.allocator",
        scope="function",
    ),
    Plant(
        contracts_reach_up,
        "lmcache_pd/protocol.py",
        "from lmcache_pd.proxy import routing",
        "imports lmcache_pd.proxy.routing",
    ),
    Plant(
        kernels_reach_up,
        "kernels/cpu_blocks.py",
        "from lmcache_pd.transfer import allocator",
        "imports lmcache_pd.transfer.allocator",
    ),
    Plant(
        transfer_reaches_up,
        "lmcache_pd/transfer/allocator.py",
        "from lmcache_pd.connector import facade",
        "imports lmcache_pd.connector.facade",
    ),
    Plant(
        transfer_reaches_up,
        "lmcache_pd/transfer/allocator.py",
        "from vllm.config import VllmConfig",
        "imports vllm.config",
        scope="function",
    ),
    Plant(proxy_loads_heavy, "proxy/routing.py", "import torch", "imports torch"),
    # through a contract the proxy imports (errors.py), not in proxy/ itself
    Plant(
        proxy_loads_heavy, "lmcache_pd/errors.py", "import nixl", "imports nixl", scope="function"
    ),
    # through the package every proxy module runs first
    Plant(proxy_loads_heavy, "lmcache_pd/__init__.py", "import torch", "imports torch"),
    Plant(
        proxy_loads_heavy,
        "proxy/routing.py",
        "from ..kernels import cpu_blocks",
        "imports lmcache_pd.kernels.cpu_blocks",
    ),
    Plant(
        deploy_reaches_out,
        "lmcache_pd/deploy/pools.py",
        "from lmcache_pd.transfer import producer",
        "imports lmcache_pd.transfer.producer",
    ),
    Plant(
        benchmarks_or_tests_imported,
        "lmcache_pd/cli/tools.py",
        "from benchmarks import transfer",
        "imports benchmarks",
    ),
    Plant(
        benchmarks_or_tests_imported,
        "proxy/app.py",
        "import tests.helpers",
        "imports tests.helpers",
        scope="function",
    ),
    Plant(
        vllm_outside_connector, "lmcache_pd/deploy/vllm_server.py", "import vllm", "imports vllm"
    ),
    Plant(
        nixl_outside_channel,
        "lmcache_pd/transfer/fake_channel.py",
        "from nixl._api import nixl_agent",
        "imports nixl._api",
        scope="type_checking",
    ),
]


def copy_library(tree: Path) -> None:
    for folder in ROOTS.values():
        shutil.copytree(
            REPO / folder, tree / folder, ignore=shutil.ignore_patterns("__pycache__", "*.so")
        )


@pytest.mark.parametrize("planted", PLANTS, ids=str)
def test_a_planted_import_is_reported_with_its_file_line_and_module(
    tmp_path: Path, planted: Plant
) -> None:
    copy_library(tmp_path)
    before = set(planted.checker(read_library(tmp_path)))
    line = planted.into(tmp_path / planted.file)
    new = set(planted.checker(read_library(tmp_path))) - before
    assert len(new) == 1, new
    assert f"{planted.file}:{line} {planted.says}" in new.pop()


def test_a_file_beside_a_package_of_its_name_is_reported(tmp_path: Path) -> None:
    copy_library(tmp_path)
    before = shadowed_files(read_library(tmp_path))
    (tmp_path / "lmcache_pd/deploy.py").write_text('"""Hidden by the deploy package."""\n')
    new = set(shadowed_files(read_library(tmp_path))) - set(before)
    assert new == {"lmcache_pd/deploy.py: a package of the same name takes its import"}
