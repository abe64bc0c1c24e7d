"""A restatement of NVIDIA NeMo Automodel's DSpark offline-cache writer and reader, in numpy and
safetensors (no torch, no NeMo), for interop tests against ``shardkit.dspark``.

The format, as NeMo writes it (``format_version`` 1):

- ``manifest.json``: ``json.dump({"format_version": 1, **manifest}, indent=2, sort_keys=True)``
  (ASCII-escaped, no trailing newline), written through ``manifest.json.tmp`` + ``os.replace``.
  Producers write it with ``"complete": false`` before the first shard and with
  ``"complete": true`` after the last; manifests of older NeMo have no ``complete`` key.
- ``shard-NNNNNN.safetensors``: exactly the four ``CACHE_KEYS``, samples stacked on dim 0;
  sample ``i`` is row ``i % shard_size`` of shard ``i // shard_size``; no metadata.
- ``target_weights.safetensors``: ``embed_tokens.weight`` and ``lm_head.weight`` ``[V, H]`` in
  the cache dtype.

Restated from (public sources, read through the reference index; NeMo's code is not copied,
its behaviour is):

- ``nemo_automodel/components/datasets/llm/dspark_cache.py``: the newest stored version (index
  id 55661028738, the one with ``manifest_mismatch_fields`` and the ``complete`` marker; the
  index records no commit for it; an older version at commit
  1a228364ae19f5e016f8174a50e5e97d74840a54 predates the marker).
- ``nemo_automodel/components/datasets/llm/offline_cache.py`` (index id 55920239968, with
  ``partition_cache_shards`` and ``write_cache_shards_distributed``; no commit recorded).
- ``nemo_automodel/recipes/llm/precompute_dspark_dist.py`` at commit
  61bd01a850c4076d0d24ed9e243600a0ed2151fb.

NeMo writes shards with ``safetensors.torch.save_file``; this module uses
``safetensors.numpy.save_file``. Both hand the same dtype, shape and bytes to the same Rust
serializer, so the files are identical (as the EAGLE-3 interop tests rely on too). Casting to
the cache dtype: torch's float32 -> bfloat16/float16 rounds to nearest even, as numpy and
ml_dtypes do; callers give float32 (or narrower) data so that no double rounding can differ.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import ml_dtypes
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

FORMAT_VERSION = 1
CACHE_NAME = "DSpark"
PRODUCER = "precompute_dspark"
MANIFEST = "manifest.json"
TARGET_WEIGHTS = "target_weights.safetensors"
CACHE_KEYS = ("input_ids", "loss_mask", "target_hidden_states", "target_last_hidden_states")
WEIGHT_KEYS = ("embed_tokens.weight", "lm_head.weight")
DTYPES = {"bf16": ml_dtypes.bfloat16, "fp16": np.float16, "fp32": np.float32}
SHARD_RE = re.compile(r"^shard-(\d{6})\.safetensors$")
_EXEMPT = ("format_version", "complete")

Arrays = Dict[str, np.ndarray]


# ---------------------------------------------------------------------------------------------
# Paths and atomic writes (offline_cache.py)


def shard_path(cache_dir: str, k: int) -> str:
    """``offline_cache.shard_path``."""
    return os.path.join(cache_dir, f"shard-{k:06d}.safetensors")


def manifest_path(cache_dir: str) -> str:
    """``offline_cache.manifest_path``."""
    return os.path.join(cache_dir, MANIFEST)


def atomic_write(path: str, write_fn) -> str:
    """``offline_cache.atomic_write``: write ``path + ".tmp"``, then ``os.replace`` it over
    ``path`` (no fsync)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = path + ".tmp"
    write_fn(tmp)
    os.replace(tmp, path)
    return path


def existing_shard_indices(cache_dir: str) -> set:
    """``offline_cache.existing_shard_indices``: indices of the files named exactly
    ``shard-NNNNNN.safetensors`` (six digits); an absent directory has none."""
    if not os.path.isdir(cache_dir):
        return set()
    return {int(m.group(1)) for m in map(SHARD_RE.match, os.listdir(cache_dir)) if m is not None}


# ---------------------------------------------------------------------------------------------
# The manifest (offline_cache.py, dspark_cache.py)


def manifest_text(manifest: Mapping[str, Any]) -> str:
    """The bytes ``write_manifest`` writes (as text): ``format_version`` 1 first in the dict,
    then the manifest (a ``format_version`` inside it wins, as in NeMo's ``{**manifest}``),
    sorted, indented by 2, ASCII-escaped, no trailing newline."""
    return json.dumps({"format_version": FORMAT_VERSION, **manifest}, indent=2, sort_keys=True)


def write_manifest(cache_dir: str, manifest: Mapping[str, Any]) -> str:
    """``dspark_cache.write_manifest`` (``offline_cache.write_manifest`` with version 1)."""

    def write(tmp: str) -> None:
        with open(tmp, "w") as f:
            f.write(manifest_text(manifest))

    return atomic_write(manifest_path(cache_dir), write)


def ensure_manifest_complete(manifest: Mapping[str, Any], cache_dir: str) -> None:
    """``dspark_cache.ensure_manifest_complete``: anything but ``complete`` absent or exactly
    ``True`` is refused (``false``, but also ``1`` or ``"true"``)."""
    if manifest.get("complete", True) is not True:
        raise ValueError(
            f"DSpark cache at {cache_dir} is marked incomplete (its precompute was interrupted or is "
            "still running). Re-run the precompute with the same configuration to finish it, or delete "
            "the directory and regenerate."
        )


def read_manifest(cache_dir: str, allow_incomplete: bool = False) -> Dict[str, Any]:
    """``dspark_cache.read_manifest`` over ``offline_cache.read_manifest``: the manifest must
    exist and have ``format_version`` 1; unless ``allow_incomplete`` (the producers' own check),
    it must not be marked incomplete."""
    path = manifest_path(cache_dir)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{CACHE_NAME} cache manifest not found at {path}. Was the cache fully written?")
    with open(path) as f:
        manifest = json.load(f)
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise ValueError(
            f"{CACHE_NAME} cache at {cache_dir} has format_version={version}, expected {FORMAT_VERSION}. "
            f"Regenerate the cache with the current {PRODUCER}."
        )
    if not allow_incomplete:
        ensure_manifest_complete(manifest, cache_dir)
    return manifest


def manifest_mismatch_fields(recorded: Mapping[str, Any], manifest: Mapping[str, Any]) -> List[str]:
    """``dspark_cache.manifest_mismatch_fields``: the sorted keys (of either dict) whose values
    differ (a key absent on one side compares as None), ``format_version`` and ``complete``
    excepted. Values compare with Python's ``!=`` (so 1 == 1.0 == True)."""
    return sorted(k for k in set(recorded) | set(manifest)
                  if k not in _EXEMPT and recorded.get(k) != manifest.get(k))


def chat_template_sha256(template: Optional[str]) -> str:
    """``dspark_cache.tokenizer_chat_template_sha256`` of a tokenizer whose ``chat_template``
    is ``template`` (None or empty hashes the empty string)."""
    return hashlib.sha256((template or "").encode("utf-8")).hexdigest()


def build_cache_manifest(
    *,
    target_model: str,
    target_model_type: str,
    vocab_size: int,
    hidden_size: int,
    num_hidden_layers: int,
    seq_length: int,
    dtype: str,
    num_samples: int,
    shard_size: int,
    target_layer_ids: Sequence[int],
    train_data_path: str,
    train_split: Optional[str],
    shuffle_seed: int,
    mask_reasoning_content: bool,
    chat_template_sha256: str,
) -> Dict[str, Any]:
    """``dspark_cache.build_cache_manifest``, taking the three fields NeMo reads from the
    target's text config (``vocab_size``, ``hidden_size``, ``num_hidden_layers``) as ints:
    ``target_hidden_dim`` is ``hidden_size * len(target_layer_ids)``,
    ``target_last_hidden_dim`` is ``hidden_size``."""
    hidden_size = int(hidden_size)
    return {
        "target_model": target_model,
        "target_model_type": target_model_type,
        "target_vocab_size": int(vocab_size),
        "hidden_size": hidden_size,
        "num_hidden_layers": int(num_hidden_layers),
        "seq_length": seq_length,
        "dtype": dtype,
        "num_samples": num_samples,
        "shard_size": shard_size,
        "target_hidden_dim": hidden_size * len(target_layer_ids),
        "target_last_hidden_dim": hidden_size,
        "target_layer_ids": list(target_layer_ids),
        "train_data_path": str(train_data_path),
        "train_split": train_split,
        "shuffle_seed": int(shuffle_seed),
        "mask_reasoning_content": bool(mask_reasoning_content),
        "chat_template_sha256": chat_template_sha256,
    }


# ---------------------------------------------------------------------------------------------
# Shards and target weights (dspark_cache.py, offline_cache.write_tensor_shard)


def compute_batch_cache(batch: Mapping[str, Any], dtype: str) -> Arrays:
    """``dspark_cache.compute_batch_cache``: ids and mask to int64, both hidden states to the
    cache dtype (``"bf16"``, ``"fp16"`` or ``"fp32"``)."""
    dt = DTYPES[dtype]
    return {
        "input_ids": np.asarray(batch["input_ids"]).astype(np.int64),
        "loss_mask": np.asarray(batch["loss_mask"]).astype(np.int64),
        "target_hidden_states": np.asarray(batch["target_hidden_states"]).astype(dt),
        "target_last_hidden_states": np.asarray(batch["target_last_hidden_states"]).astype(dt),
    }


def write_shard(cache_dir: str, k: int, samples: Mapping[str, np.ndarray]) -> str:
    """``dspark_cache.write_shard`` (``offline_cache.write_tensor_shard``): exactly the
    ``CACHE_KEYS`` (a missing one is refused, extra keys are dropped), made contiguous, saved
    without metadata through ``shard-k.safetensors.tmp``."""
    missing = [key for key in CACHE_KEYS if key not in samples]
    if missing:
        raise ValueError(f"write_shard is missing required {CACHE_NAME} cache fields: {missing}")
    tensors = {key: np.ascontiguousarray(samples[key]) for key in CACHE_KEYS}
    return atomic_write(shard_path(cache_dir, k), lambda tmp: save_file(tensors, tmp))


def write_target_weights(cache_dir: str, embed_tokens: np.ndarray, lm_head: np.ndarray, dtype: str) -> str:
    """``dspark_cache.write_target_weights``, given the two ``.weight`` arrays (``[V, H]``):
    both cast to the cache dtype, saved through ``target_weights.safetensors.tmp``."""
    dt = DTYPES[dtype]
    tensors = {
        "embed_tokens.weight": np.ascontiguousarray(np.asarray(embed_tokens).astype(dt)),
        "lm_head.weight": np.ascontiguousarray(np.asarray(lm_head).astype(dt)),
    }
    return atomic_write(os.path.join(cache_dir, TARGET_WEIGHTS), lambda tmp: save_file(tensors, tmp))


def read_target_weights(cache_dir: str) -> Tuple[np.ndarray, np.ndarray]:
    """``dspark_cache.read_target_weight_modules``: (embed_tokens.weight, lm_head.weight);
    a missing file is a FileNotFoundError naming it."""
    path = os.path.join(cache_dir, TARGET_WEIGHTS)
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"{path} not found. The DSpark offline cache must include target embed_tokens and lm_head "
            "weights so training can skip loading the target model."
        )
    with safe_open(path, framework="np") as f:
        return f.get_tensor("embed_tokens.weight"), f.get_tensor("lm_head.weight")


# ---------------------------------------------------------------------------------------------
# The reader (offline_cache.CachedTensorDataset, dspark_cache.CachedDSparkDataset)


def validate_contiguous_shards(cache_dir: str, num_samples: int, shard_size: int) -> List[int]:
    """``offline_cache.validate_contiguous_shards``: the shard indices must be exactly
    ``0 .. ceil(num_samples / shard_size) - 1``."""
    indices = sorted(existing_shard_indices(cache_dir))
    expected = (num_samples + shard_size - 1) // shard_size
    if indices != list(range(expected)):
        raise ValueError(
            f"{CACHE_NAME} cache at {cache_dir} declares {num_samples} samples "
            f"({expected} shards) but found shard indices {indices}."
        )
    return indices


class CachedDSparkDataset:
    """``dspark_cache.CachedDSparkDataset``: construction reads the manifest (format_version 1),
    checks the shard set, then refuses an incomplete manifest, in that order, with NeMo's
    messages. Item ``i`` (negative counts from the end) is row ``i % shard_size`` of shard
    ``i // shard_size``, a dict of the four ``CACHE_KEYS`` (numpy arrays; bf16 as
    ml_dtypes.bfloat16). Shards open lazily and stay open."""

    def __init__(self, cache_dir: str) -> None:
        self.cache_dir = str(cache_dir)
        # CachedTensorDataset reads the manifest without the completeness check...
        self.manifest = read_manifest(self.cache_dir, allow_incomplete=True)
        self.shard_size = int(self.manifest["shard_size"])
        self.num_samples = int(self.manifest["num_samples"])
        self._shards = validate_contiguous_shards(self.cache_dir, self.num_samples, self.shard_size)
        self._handles: Dict[int, Any] = {}
        # ... and CachedDSparkDataset adds it after the base constructor.
        ensure_manifest_complete(self.manifest, self.cache_dir)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> Arrays:
        if index < 0:
            index += self.num_samples
        if not 0 <= index < self.num_samples:
            raise IndexError(index)
        k, row = divmod(index, self.shard_size)
        h = self._handles.get(k)
        if h is None:
            h = safe_open(shard_path(self.cache_dir, k), framework="np")
            self._handles[k] = h
        return {key: h.get_slice(key)[row] for key in CACHE_KEYS}


def collate(items: Sequence[Mapping[str, np.ndarray]]) -> Arrays:
    """``dspark_cache._collate_cached``: each of the ``CACHE_KEYS`` stacked on a new dim 0."""
    return {key: np.stack([it[key] for it in items]) for key in CACHE_KEYS}


# ---------------------------------------------------------------------------------------------
# The distributed producer (offline_cache.py, precompute_dspark_dist.py)


def partition_cache_shards(num_samples: int, shard_size: int, world_size: int, rank: int) -> Tuple[int, int, int]:
    """``offline_cache.partition_cache_shards``: (start_shard_index, start_sample,
    num_local_samples) of ``rank``'s contiguous block of whole shards; the first
    ``total_shards % world_size`` ranks get one shard more; a rank past the shards gets 0
    samples (and a start past the end)."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} must be in [0, {world_size}).")
    total = (num_samples + shard_size - 1) // shard_size
    base, extra = divmod(total, world_size)
    count = base + (1 if rank < extra else 0)
    start = rank * base + min(rank, extra)
    end_sample = min((start + count) * shard_size, num_samples)
    return start, start * shard_size, max(0, end_sample - start * shard_size)


class Interrupted(Exception):
    """Raised inside the simulated producer where the job is killed (caught by
    ``precompute_distributed``); ``args[0]`` is the list of shard indices the rank wrote."""


class ShardAccumulator:
    """``offline_cache._ShardAccumulator``: buffers computed batches and writes each full
    ``shard_size`` as the next shard index (from ``start_shard_index``); ``finalize`` writes
    the partial rest. ``budget`` (not NeMo's) is how many shards may still be written before
    the simulated kill: writing one more raises Interrupted instead (after leaving a torn
    ``.tmp`` when ``torn``)."""

    def __init__(self, cache_dir: str, shard_size: int, start_shard_index: int,
                 budget: Optional[int] = None, torn: bool = False) -> None:
        self.cache_dir, self.shard_size, self.next_index = cache_dir, shard_size, start_shard_index
        self.chunks: List[Arrays] = []
        self.buffered = 0
        self.budget, self.torn = budget, torn
        self.written: List[int] = []

    def _flush(self, at_most: Optional[int] = None) -> None:
        if self.buffered == 0:
            return
        n = self.buffered if at_most is None else min(self.buffered, at_most)
        merged = {k: np.concatenate([c[k] for c in self.chunks]) for k in self.chunks[0]}
        shard = {k: v[:n] for k, v in merged.items()}
        if self.budget is not None and len(self.written) >= self.budget:
            if self.torn:  # killed inside save_file: half a temporary
                tensors = {key: np.ascontiguousarray(shard[key]) for key in CACHE_KEYS}
                tmp = shard_path(self.cache_dir, self.next_index) + ".tmp"
                save_file(tensors, tmp)
                with open(tmp, "r+b") as f:
                    f.truncate(os.path.getsize(tmp) // 2)
            raise Interrupted(list(self.written))
        write_shard(self.cache_dir, self.next_index, shard)
        self.written.append(self.next_index)
        rest = self.buffered - n
        self.chunks = [{k: v[n:] for k, v in merged.items()}] if rest else []
        self.buffered = rest
        self.next_index += 1

    def add(self, batch: Arrays) -> None:
        self.chunks.append(batch)
        self.buffered += batch["input_ids"].shape[0]
        while self.buffered >= self.shard_size:
            self._flush(self.shard_size)

    def finalize(self) -> None:
        self._flush()


def write_rank_block(cache_dir: str, samples: Mapping[str, np.ndarray], dtype: str, shard_size: int,
                     world_size: int, rank: int, batch_size: int = 1, budget: Optional[int] = None,
                     torn: bool = False) -> List[int]:
    """One rank of ``offline_cache.write_cache_shards_distributed``: its block of ``samples``
    (a dict of arrays stacked on dim 0, all samples) through ``compute_batch_cache`` in batches
    of ``batch_size``, written by a ShardAccumulator from its start shard. (The padding forwards
    NeMo runs to keep collectives in step write nothing and are left out.) Returns the shard
    indices written; raises Interrupted where ``budget`` runs out."""
    n = int(samples["input_ids"].shape[0])
    start_shard, first, count = partition_cache_shards(n, shard_size, world_size, rank)
    acc = ShardAccumulator(cache_dir, shard_size, start_shard, budget, torn)
    for at in range(first, first + count, batch_size):
        end = min(at + batch_size, first + count)
        acc.add(compute_batch_cache({k: samples[k][at:end] for k in CACHE_KEYS}, dtype))
    acc.finalize()
    return acc.written


def ensure_output_dir_compatible(cache_dir: str, manifest: Mapping[str, Any]) -> None:
    """``precompute_dspark_dist._ensure_output_dir_compatible``: an existing manifest (read
    with ``allow_incomplete``, so it must be format_version 1) whose identity differs is
    refused, naming the sorted mismatched fields."""
    if not os.path.exists(manifest_path(cache_dir)):
        return
    mismatched = manifest_mismatch_fields(read_manifest(cache_dir, allow_incomplete=True), manifest)
    if mismatched:
        raise ValueError(
            f"{cache_dir} already holds a DSpark cache with a different configuration "
            f"(mismatched fields: {mismatched}). Use a fresh cache_output_dir or delete it."
        )


def precompute_distributed(
    cache_dir: Union[str, "os.PathLike[str]"],
    manifest: Mapping[str, Any],
    samples: Mapping[str, np.ndarray],
    world_size: int,
    weights: Tuple[np.ndarray, np.ndarray],
    stop_after: Union[None, int, Mapping[int, int]] = None,
    *,
    batch_size: int = 1,
    torn: bool = False,
) -> Dict[str, Any]:
    """``precompute_dspark_dist.run`` after the target's forward, simulated rank by rank.

    Rank 0: create the directory, refuse a manifest of another identity
    (``ensure_output_dir_compatible``), write the target weights (``weights`` = (embed_tokens,
    lm_head) ``[V, H]``, cast to the manifest's dtype), write the manifest with
    ``"complete": false``. Then every rank writes its ``partition_cache_shards`` block (shards
    already there are overwritten: NeMo recomputes, it does not resume). Then rank 0 writes
    the manifest with ``"complete": true``.

    ``stop_after`` kills the job: an int is how many shards *each* rank has written when it
    dies (NeMo's ranks run in lockstep, their forwards being collectives), a mapping gives it
    per rank (absent ranks finish their block). The manifest then stays ``complete: false``.
    With ``torn``, each rank killed before its next shard leaves that shard's ``.tmp`` half
    written (a kill inside ``save_file``). ``samples`` is a dict of arrays stacked on dim 0;
    its length must be ``manifest["num_samples"]``; ``batch_size`` must divide ``shard_size``
    (NeMo's rule). Returns ``{"complete": bool, "written": {rank: [shard indices]}}``.
    """
    cache_dir = os.fspath(cache_dir)
    manifest = {k: v for k, v in manifest.items() if k not in _EXEMPT}
    n, s = int(manifest["num_samples"]), int(manifest["shard_size"])
    if int(samples["input_ids"].shape[0]) != n:
        raise ValueError(f"{samples['input_ids'].shape[0]} samples given, the manifest says {n}")
    if s % batch_size:
        raise ValueError(f"shard_size ({s}) must be a multiple of micro_batch_size ({batch_size})")
    os.makedirs(cache_dir, exist_ok=True)
    ensure_output_dir_compatible(cache_dir, manifest)
    write_target_weights(cache_dir, weights[0], weights[1], manifest["dtype"])
    write_manifest(cache_dir, {**manifest, "complete": False})
    written: Dict[int, List[int]] = {}
    killed = False
    for rank in range(world_size):
        budget = stop_after.get(rank) if isinstance(stop_after, Mapping) else stop_after
        acc_written: List[int] = []
        try:
            acc_written = write_rank_block(cache_dir, samples, manifest["dtype"], s, world_size, rank,
                                           batch_size, budget, torn)
        except Interrupted as e:
            killed = True
            acc_written = e.args[0]
        written[rank] = acc_written
    if not killed:
        write_manifest(cache_dir, {**manifest, "complete": True})
    return {"complete": not killed, "written": written}
