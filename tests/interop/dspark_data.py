"""Deterministic DSpark test data (not NeMo's code): a manifest as NeMo's build_cache_manifest
returns it, the samples of a run (a dict of arrays stacked on dim 0, hidden states float32 as a
target's forward gives them before compute_batch_cache casts them) and the target weights.
Shared by the interop tests, the package tests and their child processes."""

from __future__ import annotations

from typing import Any, Dict, Tuple

import numpy as np

import dspark_ref as ref

VOCAB = 50
#: The chat template whose hash the default manifest records.
TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }}{% endfor %}"


def manifest(n: int, s: int, *, seq: int = 4, hidden: int = 3, layers=(1, 3), dtype: str = "bf16",
             **over: Any) -> Dict[str, Any]:
    """A manifest for ``n`` samples in shards of ``s`` (a non-ASCII model name, to cover
    json's escaping); ``over`` replaces keys (e.g. ``shuffle_seed``, ``train_split``)."""
    m = ref.build_cache_manifest(
        target_model="org/Modèl-1B", target_model_type="qwen3", vocab_size=VOCAB, hidden_size=hidden,
        num_hidden_layers=6, seq_length=seq, dtype=dtype, num_samples=n, shard_size=s,
        target_layer_ids=list(layers), train_data_path="data/chat.jsonl", train_split=None,
        shuffle_seed=42, mask_reasoning_content=False, chat_template_sha256=ref.chat_template_sha256(TEMPLATE),
    )
    m.update(over)
    return m


def samples(m: Dict[str, Any], seed: int = 0) -> Dict[str, np.ndarray]:
    """``m["num_samples"]`` valid samples: ids below the vocabulary, a 0/1 loss mask, hidden
    states float32 of a few magnitudes (so bf16/fp16 rounding matters)."""
    rng = np.random.default_rng(seed)
    n, S = int(m["num_samples"]), int(m["seq_length"])
    scale = np.array([1e-3, 1.0, 37.0])[rng.integers(0, 3, (n, S, 1))]
    return {
        "input_ids": rng.integers(0, int(m["target_vocab_size"]), (n, S)).astype(np.int64),
        "loss_mask": rng.integers(0, 2, (n, S)).astype(np.int64),
        "target_hidden_states": (rng.standard_normal((n, S, int(m["target_hidden_dim"]))) * scale).astype(np.float32),
        "target_last_hidden_states": (rng.standard_normal((n, S, int(m["target_last_hidden_dim"]))) * scale).astype(np.float32),
    }


def cast(m: Dict[str, Any], x: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
    """``x`` as the cache stores it (compute_batch_cache)."""
    return ref.compute_batch_cache(x, m["dtype"])


def item(x: Dict[str, np.ndarray], i: int) -> Dict[str, np.ndarray]:
    """Sample ``i`` of ``x`` (no batch dimension)."""
    return {k: x[k][i] for k in ref.CACHE_KEYS}


def rows(x: Dict[str, np.ndarray], a: int, b: int) -> Dict[str, np.ndarray]:
    """Samples ``a`` to ``b`` of ``x`` stacked."""
    return {k: x[k][a:b] for k in ref.CACHE_KEYS}


def weights(m: Dict[str, Any], seed: int = 0) -> Tuple[np.ndarray, np.ndarray]:
    """(embed_tokens, lm_head), float32 ``[vocab, hidden]``."""
    rng = np.random.default_rng(1000 + seed)
    shape = (int(m["target_vocab_size"]), int(m["hidden_size"]))
    return rng.standard_normal(shape).astype(np.float32), rng.standard_normal(shape).astype(np.float32) / 3
