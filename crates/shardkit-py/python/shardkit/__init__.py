"""shardkit: exact, crash-safe, fast access to the on-disk caches ML training reads.

Formats: ``shardkit.saev`` (the saev Sharded Activation File Protocol) and
``shardkit.flat_tokens`` (MatX seqax's token datasets in zarr). Arrays are numpy arrays over
memory owned by the Rust core (no copies); ``shardkit.torch`` adapts loaders to PyTorch.
"""

from ._shardkit import IncompleteDatasetError, __version__
from . import flat_tokens, saev

__all__ = ["saev", "flat_tokens", "IncompleteDatasetError", "__version__"]
