"""The one compiled part of lmcache-pd; everything else is declared in pyproject.toml.

kernels/_cpu_block_copy.c (with kernels/xxh3.h) is plain C against Python's headers, built by
the install with the machine's C compiler (`pip install -e .` puts it beside its source). It
lives here, not in pyproject.toml, because setuptools still calls
`[tool.setuptools.ext-modules]` experimental.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "lmcache_pd.kernels._cpu_block_copy",
            sources=["kernels/_cpu_block_copy.c"],
            depends=["kernels/xxh3.h"],
        )
    ]
)
