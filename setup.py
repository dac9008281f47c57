"""Package discovery for the two source roots: `libs/kvmesh` → `kvmesh`, `services` → `kvmesh.services`.

Everything else lives in pyproject.toml; this file exists only because setuptools' declarative
`packages.find` cannot prefix a second root.
"""

from setuptools import find_packages, setup

packages = find_packages("libs", include=["kvmesh", "kvmesh.*"])
packages += ["kvmesh.services"] + [f"kvmesh.services.{p}" for p in find_packages("services")]
setup(packages=packages)
