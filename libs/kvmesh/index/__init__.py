"""Prefix index: which worker holds which KV block (pure; see :mod:`kvmesh.index.prefix_index`).

``PrefixIndex`` is the C-core implementation (:class:`NativePrefixIndex`, :mod:`kvmesh.index.native_index`)
when the extension ``kvmesh.index._native`` is built (``pip install -e .`` compiles it), else the numpy
reference (:class:`NumpyPrefixIndex`). Both have the same API, semantics and snapshot format; ``NATIVE``
says which one ``PrefixIndex`` is.
"""

from typing import TYPE_CHECKING

from kvmesh.index.prefix_index import NumpyPrefixIndex

if TYPE_CHECKING:
    from kvmesh.index.native_index import NativePrefixIndex

    PrefixIndex = NativePrefixIndex
    NATIVE: bool
else:
    try:
        from kvmesh.index.native_index import NativePrefixIndex
    except ImportError:  # extension not built: the numpy reference
        NativePrefixIndex = None
    PrefixIndex = NativePrefixIndex or NumpyPrefixIndex
    NATIVE = NativePrefixIndex is not None

__all__ = ["NATIVE", "NativePrefixIndex", "NumpyPrefixIndex", "PrefixIndex"]
