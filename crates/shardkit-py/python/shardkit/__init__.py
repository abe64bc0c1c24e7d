"""shardkit: exact, crash-safe, fast access to the on-disk caches ML training reads.

Formats: ``shardkit.saev`` (the saev Sharded Activation File Protocol),
``shardkit.flat_tokens`` (MatX seqax's token datasets in zarr), ``shardkit.eagle3``
(NeMo Automodel's EAGLE-3 offline cache) and ``shardkit.sdnb`` (Deeplearning4j SameDiff
SDNB/SDZ containers). Arrays are numpy arrays over memory owned by the Rust core (no copies);
``shardkit.torch`` adapts loaders to PyTorch.
"""

from ._shardkit import IncompleteDatasetError, __version__
from . import eagle3, flat_tokens, saev, sdnb

__all__ = ["saev", "flat_tokens", "eagle3", "sdnb", "IncompleteDatasetError", "__version__"]
