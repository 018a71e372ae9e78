"""The docs stay true to the tree: every library module is in the architecture's module map, and
every repository path the docs name exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ARCHITECTURE = ROOT / "docs" / "architecture.md"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LIBRARY_FOLDERS = ("lmcache_pd", "kernels", "proxy")
# A path in backquotes that starts at one of the repository's top folders.
CITED_PATH = re.compile(
    r"`((?:lmcache_pd|kernels|proxy|benchmarks|tests|configs|docs|requirements)/[\w/.\-]*)`"
)


def library_modules() -> list[str]:
    return sorted(
        path.relative_to(ROOT).as_posix()
        for folder in LIBRARY_FOLDERS
        for path in (ROOT / folder).rglob("*.py")
        if path.relative_to(ROOT).as_posix() != "lmcache_pd/__init__.py"
    )


def modules_missing_from(text: str, modules: list[str]) -> list[str]:
    return [module for module in modules if f"`{module}`" not in text]


def test_every_library_module_is_in_the_architectures_module_map() -> None:
    missing = modules_missing_from(ARCHITECTURE.read_text(), library_modules())
    assert not missing, f"docs/architecture.md's module map lacks {missing}"


def test_a_module_left_out_of_the_map_is_named() -> None:
    """Negative control: the same check on the map without one module names that module."""
    text = ARCHITECTURE.read_text().replace("`lmcache_pd/transfer/channel.py`", "")
    assert modules_missing_from(text, library_modules()) == ["lmcache_pd/transfer/channel.py"]


@pytest.mark.parametrize("doc", DOCS, ids=lambda path: path.relative_to(ROOT).as_posix())
def test_every_path_the_docs_name_exists(doc: Path) -> None:
    cited = {match.group(1).rstrip("/") for match in CITED_PATH.finditer(doc.read_text())}
    missing = sorted(path for path in cited if not (ROOT / path).exists())
    assert not missing, f"{doc.relative_to(ROOT)} names paths that do not exist: {missing}"
