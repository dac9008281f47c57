"""Package discovery for the two source roots: `libs/kvmesh` → `kvmesh`, `services` → `kvmesh.services`.

Everything else lives in pyproject.toml; this file exists only because setuptools' declarative
`packages.find` cannot prefix a second root, and to declare the optional C extensions `kvmesh.index._native`,
`kvmesh.kvplane.kvsync._crc` and `kvmesh.bench._link`.
"""

from setuptools import Extension, find_packages, setup

packages = find_packages("libs", include=["kvmesh", "kvmesh.*"])
packages += ["kvmesh.services"] + [f"kvmesh.services.{p}" for p in find_packages("services")]
# Compiled core of the prefix index and block hasher; optional: kvmesh falls back to its numpy reference.
native = Extension("kvmesh.index._native", ["libs/kvmesh/index/_native.c"], extra_compile_args=["-O3"], optional=True)
# Interleaved hardware CRC32C and a checked copy for kv-sync; optional: kv-sync falls back to `crc32c`.
crc = Extension(
    "kvmesh.kvplane.kvsync._crc", ["libs/kvmesh/kvplane/kvsync/_crc.c"], extra_compile_args=["-O3"], optional=True
)
# The delay proxy's relay engine (epoll + timerfd, no GIL); optional: the proxy falls back to its threaded engine.
link = Extension("kvmesh.bench._link", ["libs/kvmesh/bench/_link.c"], extra_compile_args=["-O3"], optional=True)
setup(packages=packages, ext_modules=[native, crc, link])
