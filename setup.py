"""Where lmcache-pd's packages are, and its one compiled part; the rest is in pyproject.toml.

The design card's folders ``kernels/`` and ``proxy/`` install as ``lmcache_pd.kernels`` and
``lmcache_pd.proxy`` beside ``lmcache_pd/``: those three roots are named here, every package
below them is found (``tests/test_wheel.py`` checks the built wheel holds every module).
``benchmarks/`` and ``tests/`` are not in the wheel. kernels/_cpu_block_copy.c (with
kernels/xxh3.h) is plain C against Python's headers, built by the install with the machine's C
compiler (``pip install -e .`` puts it beside its source). Both live here, not in
pyproject.toml, because setuptools cannot map found packages to other folders there and still
calls ``[tool.setuptools.ext-modules]`` experimental.
"""

from setuptools import Extension, find_packages, setup

# the importable name of each root -> the folder it is in
ROOTS = {"lmcache_pd": "lmcache_pd", "lmcache_pd.kernels": "kernels", "lmcache_pd.proxy": "proxy"}


def package_folders() -> dict[str, str]:
    """Every package under the roots, with its folder."""
    folders = {}
    for name, folder in ROOTS.items():
        folders[name] = folder
        for sub in find_packages(folder):
            folders[f"{name}.{sub}"] = f"{folder}/{sub.replace('.', '/')}"
    return folders


setup(
    packages=list(package_folders()),
    package_dir=package_folders(),
    ext_modules=[
        Extension(
            "lmcache_pd.kernels._cpu_block_copy",
            sources=["kernels/_cpu_block_copy.c"],
            depends=["kernels/xxh3.h"],
        )
    ],
)
