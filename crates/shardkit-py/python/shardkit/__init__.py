"""shardkit: exact, crash-safe, fast access to the on-disk caches ML training reads.

Formats: ``shardkit.saev`` (the saev Sharded Activation File Protocol). Arrays are numpy arrays
over memory owned by the Rust core (no copies); ``shardkit.torch`` adapts loaders to PyTorch.
"""

from ._shardkit import IncompleteDatasetError, __version__
from . import saev

__all__ = ["saev", "IncompleteDatasetError", "__version__"]
