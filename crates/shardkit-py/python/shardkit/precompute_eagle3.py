"""Produce an EAGLE-3 offline cache from a causal LM: NeMo Automodel's ``precompute_eagle3``, on
every GPU of a job and never blocked by the disk.

For each sample (a chat conversation through the tokenizer's chat template, or pre-tokenized
``input_ids`` + ``loss_mask``), the frozen target runs without gradients; forward hooks on the
three ``aux_layer_ids`` layers copy their outputs, cast to the cache dtype, into a device
staging tensor, and the draft-vocabulary target distribution, the masks and the shifted ids are
computed on the model's device, exactly as NeMo's ``_compute_batch_cache`` does. The batch then
travels to the disk through the producers' pipeline (pinned host copy on a side CUDA stream,
writer thread, ``buffers`` batches in flight: backpressure) into an
:class:`shardkit.eagle3.PartWriter`, so every rank of a job writes its shard-aligned part of
one cache, a killed job resumes with any world size, and the result is byte-identical to one
process's (and to NeMo's, for the same model, inputs and batches).

    from shardkit.precompute_eagle3 import precompute

    status = precompute(model, tokenizer, conversations, "cache", seq_length=2048,
                        draft_vocab_size=8192, batch_size=4, shard_size=256,
                        target_model="meta-llama/Llama-3.1-8B-Instruct", input_data="sharegpt.jsonl")

or ``python -m shardkit.precompute_eagle3 --model LOCAL_PATH --data FILE.jsonl --out DIR`` (under
``torchrun`` for several GPUs). See docs/precompute_eagle3.md.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union, cast

import numpy as np
import torch

from . import _args, eagle3, provenance
from . import _shardkit as _core
from ._pipeline import Pipeline, Slot
from ._progress import Progress
from .errors import InvalidArgumentError, InvalidArgumentTypeError

PathLike = Union[str, "os.PathLike[str]"]

__all__ = [
    "precompute",
    "retained_mass",
    "tokenize",
    "draft_vocab",
    "default_aux_layer_ids",
    "load_data",
    "main",
]

#: The cache dtypes NeMo's ``--dtype`` takes.
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

# A top-k cache's per-shard notes (shardkit.notes/topk-retained-SHARD.json): the share of the
# draft distribution the stored top k kept, at the supervised positions.
RETAINED_NOTE = "topk-retained-"


# The draft vocabulary a run used (shardkit.notes/draft-vocab.json), for a restart to reuse.
DRAFT_VOCAB_NOTE = "draft-vocab.json"


def _ids_digest(ids: Sequence[int]) -> str:
    return hashlib.sha256(json.dumps(list(ids)).encode()).hexdigest()


def _recorded_draft_vocab(out: str, record: Dict[str, Any], size: Optional[int], vocab: int) -> Optional[List[int]]:
    """The draft vocabulary an earlier run over the same model, tokenizer and samples recorded
    at ``out`` (its note, checked against the provenance record's digest), or None."""
    prior = provenance.read(out)
    if prior is None or any(prior.get(k) != v for k, v in record.items()):
        return None
    want = prior.get("draft_vocab")
    expected = vocab if size is None else min(size, vocab)
    if not isinstance(want, dict) or want.get("size") != expected:
        return None
    notes = dict(_core.notes_list(out, DRAFT_VOCAB_NOTE))
    ids = json.loads(notes[DRAFT_VOCAB_NOTE]) if DRAFT_VOCAB_NOTE in notes else None
    if not isinstance(ids, list) or _ids_digest(ids) != want.get("sha256"):
        return None
    return [int(t) for t in ids]


def retained_mass(path: PathLike) -> Dict[str, Any]:
    """What a top-k cache's shards kept of the draft distribution, from the notes
    :func:`precompute` writes beside each shard (before the shard is durable): ``{"shards":
    [{"shard", "topk", "positions", "mean", "min", "p01", "p10", "p50", "kl_mean"}],
    "positions", "mean", "min", "kl_mean"}`` over the supervised positions (loss mask 1);
    ``kl_mean`` is the mean KL divergence of the stored (renormalised) distribution from the
    full one, ``-log(retained mass)``. Empty for a lossless cache."""
    shards = [json.loads(b) for _, b in _core.notes_list(_args.path("path", path), RETAINED_NOTE)]
    n = sum(int(x["positions"]) for x in shards)
    out: Dict[str, Any] = {"shards": shards, "positions": n}
    if n:
        out["mean"] = sum(x["mean"] * x["positions"] for x in shards if x["positions"]) / n
        out["min"] = min(x["min"] for x in shards if x["positions"])
        out["kl_mean"] = sum(x["kl_mean"] * x["positions"] for x in shards if x["positions"]) / n
    return out

# A chat template that marks assistant text with {% generation %} lets the tokenizer return the
# assistant mask itself (NeMo's test, kept as it is).
_GENERATION = re.compile(r"\{%-?\s+generation\s+-?%\}")

# NeMo's chat roles, and the ShareGPT `from` names its loader maps onto them.
_ROLES = ("system", "user", "assistant", "tool")
_SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant",
                   "assistant": "assistant", "chatgpt": "assistant", "model": "assistant", "bot": "assistant"}

# -- the model's side ------------------------------------------------------------------------


def _layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder layers the aux ids index, where NeMo looks for them (``model.model.layers``:
    Llama, Qwen, Mistral, Gemma, Phi; ``model.layers``; ``model.transformer.h``: GPT-2)."""
    for owner, name in (("model", "layers"), (None, "layers"), ("transformer", "h")):
        m: Any = getattr(model, owner, None) if owner else model
        layers = getattr(m, name, None) if m is not None else None
        if isinstance(layers, torch.nn.ModuleList):
            return layers
    raise InvalidArgumentError(
        f"{type(model).__name__}: no decoder layers at model.layers, layers or transformer.h "
        "(the places NeMo's EAGLE-3 target wrapper looks)")


def _num_layers(model: torch.nn.Module) -> int:
    n = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    return int(n) if isinstance(n, int) else len(_layers(model))


def default_aux_layer_ids(num_layers: int) -> List[int]:
    """NeMo's low/mid/high recipe ``[1, L//2 - 1, L - 4]``; an error for a model too shallow
    for three distinct layers (give ``aux_layer_ids`` then)."""
    ids = [1, num_layers // 2 - 1, num_layers - 4]
    if any(i < 0 or i >= num_layers for i in ids) or len(set(ids)) != 3:
        raise InvalidArgumentError(
            f"a target of {num_layers} layers is too shallow for the default EAGLE-3 aux layers {ids}; "
            "give aux_layer_ids (3 distinct layers in 0..num_layers-1)")
    return ids


def _aux_ids(ids: Optional[Sequence[int]], num_layers: int) -> List[int]:
    if ids is None:
        return default_aux_layer_ids(num_layers)
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
        raise InvalidArgumentTypeError(f"aux_layer_ids must be a list of 3 layer indices, got {ids!r}")
    out = [_args.integer("aux_layer_ids", i) for i in ids]
    if len(out) != 3:
        raise InvalidArgumentError(
            f"aux_layer_ids must name exactly 3 layers (the draft's fc takes 3 hidden states), got {out}")
    if len(set(out)) != 3:
        raise InvalidArgumentError(f"aux_layer_ids must be distinct, got {out}")
    for i in out:
        if not 0 <= i < num_layers:
            raise InvalidArgumentError(
                f"aux layer {i} is not a layer of the target ({num_layers} layers: 0..{num_layers - 1})")
    return out


# -- samples -> token rows (NeMo's ChatDataset with unshifted=True, padding="max_length") ------


def _pad_id(tokenizer: Any) -> int:
    """The pad id NeMo's ChatDataset packs with: the tokenizer's pad id, set to the eos id when
    it has none (the tokenizer is changed, as NeMo changes it, so it can pad), and the eos id
    when the pad id is 0 (``_add_pad_token(...) or eos_token_id``, kept as NeMo has it)."""
    pad = getattr(tokenizer, "pad_token_id", None)
    if pad is None:
        tokenizer.pad_token_id = tokenizer.eos_token_id
    if getattr(tokenizer, "pad_token", None) is None and getattr(tokenizer, "eos_token", None) is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return int(pad or getattr(tokenizer, "eos_token_id", 0) or 0)


def _messages(sample: Any, where: str) -> Tuple[List[Dict[str, Any]], Optional[List[Any]]]:
    """A conversation's messages, normalised as NeMo's loader does (content parts joined,
    None as "", ShareGPT ``conversations`` mapped onto roles), and its ``tools``."""
    if isinstance(sample, Mapping):
        msgs = sample.get("messages")
        if msgs is None and sample.get("conversations") is not None:
            conv = sample["conversations"]
            if not isinstance(conv, list):
                raise InvalidArgumentError(f"{where}: `conversations` must be a list of turns")
            msgs = []
            for t in conv:
                role = _SHAREGPT_ROLES.get(str(t.get("from", t.get("role")))) if isinstance(t, Mapping) else None
                if role is None:
                    raise InvalidArgumentError(
                        f"{where}: a `conversations` turn {t!r} has no role NeMo maps ({sorted(_SHAREGPT_ROLES)})")
                msgs.append({"role": role, "content": t.get("value", t.get("content", ""))})
        tools = sample.get("tools")
    else:
        msgs, tools = sample, None
    if not isinstance(msgs, list):
        raise InvalidArgumentError(
            f"{where}: a sample is a list of chat messages, a dict with `messages` (OpenAI) or "
            "`conversations` (ShareGPT), or a dict with `input_ids` and `loss_mask`")
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as e:
            raise InvalidArgumentError(f"{where}: `tools` is a string but not JSON: {e}") from None
    if tools is not None and not isinstance(tools, list):
        raise InvalidArgumentError(f"{where}: `tools` must be a list, got {type(tools).__name__}")
    out = []
    for m in msgs:
        if not isinstance(m, Mapping) or m.get("role") not in _ROLES:
            raise InvalidArgumentError(
                f"{where}: message {m!r} has no role among {', '.join(_ROLES)}")
        m2 = dict(m)
        c = m.get("content")
        m2["content"] = (" ".join(p["text"] for p in c if isinstance(p, Mapping) and "text" in p)
                         if isinstance(c, list) else "" if c is None else str(c))
        calls = m.get("tool_calls")
        if m["role"] == "assistant" and isinstance(calls, list):
            m2["tool_calls"] = [_tool_call(tc, i) for i, tc in enumerate(calls)]
        out.append(m2)
    return out, (tools or None)


def _tool_call(tc: Any, i: int) -> Dict[str, Any]:
    """A tool call as NeMo renders it: an id and a type by default, arguments as JSON text."""
    if not isinstance(tc, Mapping) or not isinstance(tc.get("function"), Mapping):
        raise InvalidArgumentError(f"tool_calls[{i}] must be a dict with a `function` dict")
    fn = dict(tc["function"])
    if not isinstance(fn.get("arguments"), str):
        fn["arguments"] = json.dumps(fn.get("arguments"))
    return {**tc, "id": tc.get("id") or f"call_{i}", "type": tc.get("type") or "function", "function": fn}


def _render(tokenizer: Any, messages: List[Dict[str, Any]], tools: Any, seq_length: int) -> List[int]:
    """``messages`` tokenized through the chat template, truncated, unpadded."""
    enc = tokenizer.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=True,
                                        return_assistant_tokens_mask=False, padding=False, truncation=True,
                                        max_length=seq_length)
    return list(enc.get("input_ids", []))


def _assistant_mask(tokenizer: Any, messages: List[Dict[str, Any]], tools: Any, seq_length: int,
                    full: List[int], n: int) -> List[int]:
    """NeMo's fallback assistant mask for a template without {% generation %}: each assistant
    turn spans from the length of the rendered conversation before it to the length with it
    (each prefix render must be a prefix of the whole render, but for a trailing eos)."""
    mask = [0] * n
    lengths = {len(messages): len(full)}
    eos = getattr(tokenizer, "eos_token_id", None)

    def length(k: int) -> int:
        if k not in lengths:
            ids = _render(tokenizer, messages[:k], tools, seq_length)
            ok = len(ids) <= len(full) and (
                ids == full[:len(ids)]
                or (len(ids) > 1 and eos is not None and ids[-1] == eos and ids[:-1] == full[:len(ids) - 1]))
            if not ok:
                raise InvalidArgumentError(
                    f"the chat template renders the first {k} message(s) as something that is not a prefix "
                    "of the whole conversation, so the assistant tokens cannot be found; wrap assistant "
                    "turns in {% generation %}...{% endgeneration %} in the template")
            lengths[k] = len(ids)
        return lengths[k]

    found = False
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        found = True
        for p in range(min(length(i), n), min(length(i + 1), n)):
            mask[p] = 1
    if not found:
        raise InvalidArgumentError("a conversation without an assistant message has nothing to supervise")
    return mask


def tokenize(sample: Any, tokenizer: Any, seq_length: int) -> Dict[str, List[int]]:
    """One sample as the cache stores it before the shift: ``input_ids``, ``loss_mask`` and
    ``attention_mask``, each ``seq_length`` long, as NeMo's ChatDataset (``unshifted=True``,
    ``padding="max_length"``, ``truncation=True``) makes them.

    - A conversation (a list of messages, or a dict with ``messages`` / ShareGPT
      ``conversations`` and optional ``tools``) goes through the tokenizer's chat template,
      truncated to ``seq_length`` and padded to it. The loss mask covers the assistant tokens:
      from the tokenizer when the template marks them with ``{% generation %}``, otherwise
      from the renders of the conversation's prefixes. Padding is never supervised; the
      attention mask covers the tokens before the trailing pad run (and the first pad when the
      pad id is the eos id: that one is a real eos).
    - A pre-tokenized sample, a dict with ``input_ids`` and ``loss_mask`` (and optionally
      ``attention_mask``, else 1 over the given tokens), is truncated to ``seq_length`` and
      padded with the pad id (0 without a tokenizer), masks with 0.
    """
    if isinstance(sample, Mapping) and "input_ids" in sample:
        return _pretokenized(sample, tokenizer, seq_length)
    if tokenizer is None:
        raise InvalidArgumentError("a chat sample needs the tokenizer (tokenizer=None takes pre-tokenized samples only)")
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("default", next(iter(template.values()), None))
    if not isinstance(template, str) or not callable(getattr(tokenizer, "apply_chat_template", None)):
        raise InvalidArgumentError(
            f"{type(tokenizer).__name__} has no chat template; chat samples need one (set tokenizer.chat_template)")
    messages, tools = _messages(sample, "sample")
    pad = _pad_id(tokenizer)
    generation = _GENERATION.search(template) is not None
    enc = tokenizer.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=True,
                                        return_assistant_tokens_mask=generation, padding="max_length",
                                        truncation=True, max_length=seq_length)
    ids = [int(t) for t in enc["input_ids"]]
    attn = enc.get("attention_mask")
    if generation:
        mask = [int(x) for x in enc["assistant_masks"]]
    else:
        full = [t for t, k in zip(ids, attn) if k] if attn is not None else _render(tokenizer, messages, tools, seq_length)
        mask = _assistant_mask(tokenizer, messages, tools, seq_length, full, len(ids))
        if getattr(tokenizer, "padding_side", "right") == "left" and attn is not None:
            # The spans were found in unpadded renders; left padding moves the tokens right.
            pads = len(mask) - sum(attn)
            if pads > 0:
                mask = [0] * pads + mask[:len(mask) - pads]
    if attn is not None:
        mask = [m if a else 0 for m, a in zip(mask, attn)]
    loss = [int(bool(m)) for m in mask]
    end = len(ids)
    while end > 0 and ids[end - 1] == pad:
        end -= 1
    eos = getattr(tokenizer, "eos_token_id", 0)
    content = min(end + 1, len(ids)) if pad == eos else end
    attention = [1] * content + [0] * (len(ids) - content)
    return _fit({"input_ids": ids, "loss_mask": loss, "attention_mask": attention}, seq_length, pad)


def _pretokenized(sample: Mapping[str, Any], tokenizer: Any, seq_length: int) -> Dict[str, List[int]]:
    if "loss_mask" not in sample:
        raise InvalidArgumentError("a pre-tokenized sample needs `loss_mask` beside `input_ids`")
    row: Dict[str, List[int]] = {}
    for k in ("input_ids", "loss_mask", "attention_mask"):
        if k in sample:
            v = sample[k]
            a = np.asarray(v.detach().cpu() if isinstance(v, torch.Tensor) else v)
            if a.ndim != 1 or (a.size and a.dtype.kind not in "iub"):
                raise InvalidArgumentError(f"a pre-tokenized sample's `{k}` must be one list of integers, got {a.dtype} {a.shape}")
            row[k] = [int(x) for x in a]
    n = len(row["input_ids"])
    if len(row["loss_mask"]) != n or len(row.get("attention_mask", row["loss_mask"])) != n:
        raise InvalidArgumentError("a pre-tokenized sample's `input_ids`, `loss_mask` (and `attention_mask`) differ in length")
    row.setdefault("attention_mask", [1] * n)
    row["loss_mask"] = [int(bool(x)) for x in row["loss_mask"]]
    return _fit(row, seq_length, _pad_id(tokenizer) if tokenizer is not None else 0)


def _fit(row: Dict[str, List[int]], seq_length: int, pad: int) -> Dict[str, List[int]]:
    """Truncated (right) and padded to ``seq_length``: ids with ``pad``, masks with 0."""
    out = {}
    for k, v in row.items():
        v = v[:seq_length]
        out[k] = v + [pad if k == "input_ids" else 0] * (seq_length - len(v))
    return out


# -- the draft vocabulary ------------------------------------------------------------------------


def _specials(tokenizer: Any) -> List[Optional[int]]:
    if tokenizer is None:
        return []
    _pad_id(tokenizer)  # NeMo's dataset has set the pad id before the vocabulary is counted
    return [getattr(tokenizer, n, None) for n in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")]


def draft_vocab(samples: Sequence[Any], tokenizer: Any, *, target_vocab_size: int, draft_vocab_size: Optional[int],
                seq_length: int) -> List[int]:
    """``selected_token_ids`` as NeMo computes it: the special tokens (bos, eos, pad, unk, for
    those that exist, once each), then the supervised tokens (``input_ids`` where
    ``loss_mask``) of every sample by count, descending, ties by id, then the other ids in
    order, up to ``draft_vocab_size``; ``0..V-1`` when it is None or at least the target's
    vocabulary. Reads every sample: each rank computes the same list, no collective needed."""
    v = _args.integer("target_vocab_size", target_vocab_size, lo=1)
    if draft_vocab_size is None or draft_vocab_size >= v:
        return list(range(v))
    counts = torch.zeros(v, dtype=torch.long)
    for i in range(len(samples)):
        row = tokenize(samples[i], tokenizer, seq_length)
        ids = torch.tensor(row["input_ids"], dtype=torch.long)[torch.tensor(row["loss_mask"], dtype=torch.bool)]
        ids = ids[(ids >= 0) & (ids < v)]
        counts.scatter_add_(0, ids, torch.ones_like(ids))
    selected: List[int] = []
    seen = set()
    for t in _specials(tokenizer):
        if t is None or t < 0 or t >= v or t in seen:
            continue
        selected.append(int(t))
        seen.add(int(t))
    for t in torch.argsort(counts, descending=True, stable=True).tolist():
        if len(selected) >= draft_vocab_size:
            break
        if t not in seen and counts[t].item() != 0:
            selected.append(t)
            seen.add(t)
    for t in range(v):
        if len(selected) >= draft_vocab_size:
            break
        if t not in seen:
            selected.append(t)
            seen.add(t)
    return selected[:draft_vocab_size]


# -- the data file (NeMo's local JSON/JSONL loader) ----------------------------------------------

_SPLIT = re.compile(r"^(\w+)\[(\d*):(\d*)\]$")


def load_data(path: PathLike, *, split: Optional[str] = None, shuffle_seed: Optional[int] = 42) -> List[Any]:
    """The rows of a local ``.jsonl`` (one JSON object a line) or ``.json`` (a list, or one
    object) file in the order NeMo's producer reads them: shuffled with
    ``random.Random(shuffle_seed)`` (None: file order), then sliced by ``split``
    (``train``, ``train[a:b]``; a local file has only the train split)."""
    p = _args.path("path", path)
    with open(p, encoding="utf-8") as f:
        text = f.read()
    rows: List[Any] = []
    if p.lower().endswith((".jsonl", ".ndjson")):
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise InvalidArgumentError(f"{p}: line {n} is not JSON: {e}") from None
    else:
        obj = json.loads(text)
        rows.extend(obj if isinstance(obj, list) else [obj])
    base, sl = split, None
    m = _SPLIT.match(split) if split is not None else None
    if m:
        base = m.group(1)
        sl = slice(int(m.group(2)) if m.group(2) else None, int(m.group(3)) if m.group(3) else None)
    if base not in (None, "train"):
        raise InvalidArgumentError(f"{p}: a local file has only the 'train' split, got split={split!r}")
    if shuffle_seed is not None:
        random.Random(shuffle_seed).shuffle(rows)
    return rows[sl] if sl is not None else rows


# -- the producer ----------------------------------------------------------------------------------


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)  # bf16 bit patterns: the writer takes them
    return t.numpy()


def _progress_of(progress: Any, total: int) -> Progress:
    """The bar (samples/s, GB/s, ETA) or the callback ``progress(done, total, bytes)``, moved by
    the writer thread as batches become written."""
    return Progress(progress, unit="sample", desc="precompute_eagle3", total=total)


def precompute(
    model: torch.nn.Module,
    tokenizer: Any,
    samples: Sequence[Any],
    out: PathLike,
    *,
    seq_length: int = 2048,
    draft_vocab_size: Optional[int] = None,
    selected_token_ids: Optional[Sequence[int]] = None,
    aux_layer_ids: Optional[Sequence[int]] = None,
    dtype: str = "bf16",
    target_probs_topk: int = 0,
    format_version: int = 2,
    shard_size: int = 256,
    batch_size: int = 4,
    target_model: Optional[str] = None,
    input_data: str = "",
    split: Optional[str] = None,
    shuffle_seed: int = 42,
    rank: Optional[int] = None,
    world_size: Optional[int] = None,
    buffers: int = 4,
    progress: Any = None,
) -> Dict[str, Any]:
    """Writes this rank's part of the EAGLE-3 cache of ``model`` over ``samples`` into ``out``
    (and commits it when this rank completes the set); returns :func:`shardkit.eagle3.status`.

    - ``model``: a Hugging Face causal LM (the frozen target), on the device it runs on; it is
      run in eval mode without gradients. ``tokenizer``: its tokenizer (a chat template for chat
      samples); None for pre-tokenized samples only.
    - ``samples``: a sequence (``len`` and indexing) of conversations or pre-tokenized samples
      (see :func:`tokenize`), in cache order: sample ``i`` is cache item ``i``
      (:func:`load_data` reads a file in NeMo's order).
    - The draft vocabulary: ``selected_token_ids`` as given, or computed from ``samples`` as
      NeMo does for ``draft_vocab_size`` (:func:`draft_vocab`; None: the whole vocabulary).
    - ``aux_layer_ids``: the 3 layers whose outputs are stored (default ``[1, L//2-1, L-4]``).
    - ``dtype`` (``bf16``, ``fp16``, ``fp32``): the cache's float dtype. ``target_probs_topk``:
      0 stores the draft distribution in full; ``0 < k < Vd`` stores its top k, renormalised
      (format_version 2 only).
    - ``shard_size`` must be a multiple of ``batch_size`` (as NeMo requires): batches then never
      cross a shard and every world size runs the same batches, which is what makes the bytes
      the same (on an accelerator, with deterministic kernels).
    - ``target_model``, ``input_data``, ``split``, ``shuffle_seed``: recorded in the manifest (a
      resume with other values is refused, naming them); ``target_model`` defaults to the
      model's ``name_or_path``.
    - ``rank``/``world_size``: this process's part (default: the launcher's variables).
      ``buffers``: batches in flight between the model and the disk. ``progress``: None (a
      bar when stderr is a terminal), a bool, or ``callable(done, total, bytes)``, called on
      the writer thread as batches are written.
    """
    if not isinstance(model, torch.nn.Module):
        raise InvalidArgumentTypeError(f"model must be a torch.nn.Module (a causal LM), got {type(model).__name__}")
    if isinstance(samples, (str, bytes, Mapping)) or not isinstance(samples, Sequence):
        raise InvalidArgumentTypeError(f"samples must be a sequence of samples (a list), got {type(samples).__name__}")
    out = _args.path("out", out)
    seq_length = _args.count("seq_length", seq_length, lo=1)
    batch_size = _args.count("batch_size", batch_size, lo=1)
    shard_size = _args.count("shard_size", shard_size, lo=1)
    if shard_size % batch_size:
        raise InvalidArgumentError(
            f"shard_size ({shard_size}) must be a multiple of batch_size ({batch_size}), so that batches never "
            "cross a shard and every world size runs the same batches (NeMo requires it too)")
    if draft_vocab_size is not None:
        draft_vocab_size = _args.count("draft_vocab_size", draft_vocab_size, lo=1)
    topk = _args.count("target_probs_topk", target_probs_topk)
    dtype = _args.choice("dtype", dtype, sorted(DTYPES))
    format_version = _args.integer("format_version", format_version, lo=1, hi=2, rule="1 or 2")
    shuffle_seed = _args.integer("shuffle_seed", shuffle_seed)
    n_buffers = _args.count("buffers", buffers, lo=1)
    if format_version == 1 and topk:
        raise InvalidArgumentError("target_probs_topk needs format_version 2 (version 1 caches are lossless)")
    config = getattr(model, "config", None)
    vocab = getattr(config, "vocab_size", None)
    hidden = getattr(config, "hidden_size", None)
    if not isinstance(vocab, int) or not isinstance(hidden, int):
        raise InvalidArgumentError(f"{type(model).__name__}: its config has no vocab_size and hidden_size")
    layers = _layers(model)
    aux = _aux_ids(aux_layer_ids, _num_layers(model))
    if selected_token_ids is not None:
        sel = [_args.integer("selected_token_ids", t, lo=0, hi=vocab - 1) for t in selected_token_ids]
        if not sel or len(set(sel)) != len(sel):
            raise InvalidArgumentError("selected_token_ids must be distinct target token ids, at least one")
        if draft_vocab_size is not None and draft_vocab_size != len(sel):
            raise InvalidArgumentError(
                f"draft_vocab_size {draft_vocab_size} differs from the {len(sel)} selected_token_ids given")
    # What decides the bytes beyond the manifest: a restart from another model, tokenizer or
    # sample list is refused naming it (the manifest holds only the model's name).
    record: Dict[str, Any] = {"model": provenance.model_digest(model), "inputs": provenance.inputs_digest(samples)}
    if tokenizer is not None:
        record["processor"] = provenance.processor_digest(tokenizer)
    if selected_token_ids is None:
        # A restart from the same model, tokenizer and samples takes the draft vocabulary the
        # first run computed (kept as a note) instead of making the pass again.
        reused = _recorded_draft_vocab(out, record, draft_vocab_size, vocab)
        sel = reused if reused is not None else draft_vocab(
            samples, tokenizer, target_vocab_size=vocab, draft_vocab_size=draft_vocab_size, seq_length=seq_length)
    record["draft_vocab"] = {"sha256": _ids_digest(sel), "size": len(sel)}
    compressed = 0 < topk < len(sel)
    if target_model is None:
        target_model = str(getattr(config, "name_or_path", None) or getattr(config, "_name_or_path", "") or "")
    manifest: Dict[str, Any] = {
        "target_model": _args.string("target_model", target_model),
        "target_vocab_size": vocab,
        "draft_vocab_size": len(sel),
        "seq_length": seq_length,
        "dtype": dtype,
        "shard_size": shard_size,
        "aux_hidden_dim": hidden * len(aux),
        "aux_layer_ids": aux,
        "selected_token_ids": sel,
        "input_data": _args.string("input_data", input_data),
        "split": None if split is None else _args.string("split", split),
        "shuffle_seed": shuffle_seed,
    }
    if format_version == 2:
        manifest["target_probs_topk"] = topk
    writer = eagle3.PartWriter(out, manifest, len(samples), rank=rank, world_size=world_size,
                               format_version=format_version, target_embeddings=True, progress=False)
    try:
        provenance.record(writer.path, record)
        _core.note_put(writer.path, DRAFT_VOCAB_NOTE, json.dumps(sel).encode())
        run = _Run(model, tokenizer, samples, writer, layers, aux, sel, vocab, hidden, seq_length, DTYPES[dtype],
                   topk if compressed else 0, n_buffers, shard_size)
    except BaseException:
        writer.abort()
        raise
    try:
        if writer.rank == 0:
            # The draft seeds its embeddings from the target's; NeMo stores them beside the cache.
            emb: Any = cast(Any, model).get_input_embeddings().weight
            writer.write_target_embeddings(emb.detach().float().cpu().numpy())
        pending = writer.pending
        owed = sum(e - b for b, e in pending)
        run.progress = _progress_of(progress, owed)
        batches = [(at, min(at + batch_size, end)) for first, end in pending for at in range(first, end, batch_size)]
        # The next batch is tokenized on a thread while this one runs (chat templates are
        # Python); only that thread uses the tokenizer meanwhile (a fast tokenizer is not safe
        # to share between threads).
        with ThreadPoolExecutor(1, thread_name_prefix="shardkit-tokenize") as pool:
            ahead = pool.submit(run.rows, *batches[0]) if batches else None
            for k, (first, end) in enumerate(batches):
                assert ahead is not None
                rows = ahead.result()
                ahead = pool.submit(run.rows, *batches[k + 1]) if k + 1 < len(batches) else None
                run.batch(rows, first, end)
    except BaseException:
        run.abort()
        writer.abort()
        raise
    error = run.finish()
    if error is not None:
        writer.abort()
        raise error
    return writer.close()


class _Run:
    """One rank's production: the hooks, the pipeline and the per-batch computation."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any, samples: Sequence[Any], writer: eagle3.PartWriter,
                 layers: torch.nn.ModuleList, aux: List[int], sel: List[int], vocab: int, hidden: int,
                 seq_length: int, cache_dtype: torch.dtype, topk: int, buffers: int, shard_size: int) -> None:
        self.model, self.tokenizer, self.samples, self.writer = model.eval(), tokenizer, samples, writer
        self.aux, self.hidden, self.seq, self.cache_dtype, self.topk = aux, hidden, seq_length, cache_dtype, topk
        self.device = next(iter(model.parameters())).device
        self.sel = torch.tensor(sel, dtype=torch.long, device=self.device)
        self.sel_mask = torch.zeros(vocab, dtype=torch.bool, device=self.device)
        self.sel_mask[self.sel] = True
        self.progress = _progress_of(False, 0)
        self.shard_size = shard_size
        self.retained: Dict[int, List[np.ndarray]] = {}  # top-k: a shard's retained mass, batch by batch
        self.current: Optional[Slot] = None
        self.captured: List[bool] = []
        self.handles = [layers[i].register_forward_hook(self._hook(j)) for j, i in enumerate(aux)]
        self.pipe = Pipeline(self._write, buffers=buffers, name="shardkit-precompute-eagle3")

    def _hook(self, j: int) -> Any:
        def take(_m: Any, _inputs: Any, output: Any) -> None:
            s = self.current
            if s is None:
                return  # the model run outside a batch of ours
            h = output[0] if isinstance(output, (tuple, list)) else output
            if not isinstance(h, torch.Tensor) or h.dim() != 3 or h.shape[-1] != self.hidden:
                raise InvalidArgumentError(
                    f"decoder layer {self.aux[j]} emits {type(h).__name__} "
                    f"{tuple(h.shape) if isinstance(h, torch.Tensor) else ''}, not (batch, seq, hidden={self.hidden})")
            stage = s.tensor("aux_hidden_states", (h.shape[0], self.seq, 3 * self.hidden), self.cache_dtype, h.device)
            # NeMo concatenates the layers in aux_layer_ids order, then casts: the same values.
            stage[:, :, j * self.hidden:(j + 1) * self.hidden].copy_(h)
            self.captured[j] = True

        return take

    def _write(self, t: Dict[str, torch.Tensor], meta: Any) -> None:
        first, end = meta
        batch = {k: _to_numpy(v) for k, v in t.items()}
        retained = batch.pop("retained", None)
        if retained is not None:
            self._note_retained(first, end, retained, batch["loss_mask"])
        self.writer.add_batch(batch)
        nbytes = sum(a.nbytes for a in batch.values())
        p = self.progress
        p.advance(end - first, p.position + end - first, p.total, p.bytes + nbytes, nbytes=nbytes)

    def _note_retained(self, first: int, end: int, retained: np.ndarray, loss: np.ndarray) -> None:
        """Gathers the batch's retained top-k mass at its supervised positions; once a shard's
        last batch is in, writes the shard's note (before the batch goes to the writer, so a
        durable shard has its note)."""
        k = first // self.shard_size
        self.retained.setdefault(k, []).append(retained[loss.astype(bool)].astype(np.float64))
        shard_end = min((k + 1) * self.shard_size, len(self.samples))
        if end < shard_end:
            return
        values = np.concatenate(self.retained.pop(k))
        stats: Dict[str, Any] = {"shard": k, "topk": self.topk, "positions": int(values.size)}
        if values.size:
            q = np.quantile(values, [0.01, 0.1, 0.5])
            # KL(stored || full) of a renormalised top k is -log(retained mass) exactly (the
            # other direction is infinite: the stored distribution is 0 where the full is not).
            kl = -np.log(np.clip(values, np.finfo(np.float64).tiny, 1.0))
            stats.update(mean=float(values.mean()), min=float(values.min()), p01=float(q[0]), p10=float(q[1]),
                         p50=float(q[2]), kl_mean=float(kl.mean()))
        _core.note_put(self.writer.path, f"{RETAINED_NOTE}{k:06d}.json", json.dumps(stats, sort_keys=True).encode())

    def rows(self, first: int, end: int) -> List[Dict[str, List[int]]]:
        return [tokenize(self.samples[i], self.tokenizer, self.seq) for i in range(first, end)]

    def batch(self, rows: List[Dict[str, List[int]]], first: int, end: int) -> None:
        b = len(rows)
        s = self.pipe.take()  # waits while every slot is being written: backpressure
        self.captured = [False] * 3
        self.current = s
        try:
            self._compute(s, rows, b)
        except BaseException:
            self.current = None
            self.pipe.give_back(s)
            raise
        self.current = None
        self.pipe.submit(s, b, (first, end))

    @torch.no_grad()
    def _compute(self, s: Slot, rows: List[Dict[str, List[int]]], b: int) -> None:
        """NeMo's ``generate_batch`` + ``_compute_batch_cache`` for one batch, into the slot."""
        dev, seq = self.device, self.seq
        ids = torch.tensor([r["input_ids"] for r in rows], dtype=torch.long).to(dev)
        att = torch.tensor([r["attention_mask"] for r in rows], dtype=torch.long).to(dev)
        loss = torch.tensor([r["loss_mask"] for r in rows], dtype=torch.long).to(dev)
        out = self.model(input_ids=ids, attention_mask=att, output_hidden_states=False,
                         output_attentions=False, use_cache=False)
        if not all(self.captured):
            missing = [self.aux[j] for j, c in enumerate(self.captured) if not c]
            raise InvalidArgumentError(f"the forward did not run decoder layer(s) {missing}; nothing was written")
        logits = out.logits

        def shifted(x: torch.Tensor) -> torch.Tensor:
            # Position t holds what belongs to t + 1, the tail zero (SpecForge's target layout).
            return torch.cat((x[:, 1:], torch.zeros_like(x[:, :1])), dim=1)

        s.tensor("input_ids", (b, seq), torch.long, dev).copy_(shifted(ids))
        s.tensor("attention_mask", (b, seq), torch.long, dev).copy_(att)
        loss_shifted = shifted(loss)
        s.tensor("loss_mask", (b, seq), torch.long, dev).copy_(loss_shifted)
        # argmax and the draft columns of the shifted logits, without a shifted copy of the full
        # logits: the rows are the same, and the zero tail row's argmax is 0 and columns are 0.
        top = shifted(logits.argmax(dim=-1))
        pos = (self.sel_mask[top] & loss_shifted.bool()).unsqueeze(-1)
        s.tensor("position_mask", (b, seq, 1), torch.bool, dev).copy_(pos)
        draft = shifted(logits.index_select(-1, self.sel))
        probs = torch.softmax(draft.float(), dim=-1)
        if self.topk:
            values, indices = torch.topk(probs, self.topk, dim=-1)
            mass = values.sum(dim=-1)
            # The share of the draft distribution the top k keep (before renormalising): the
            # shard's note summarises it at the supervised positions.
            s.tensor("retained", (b, seq), torch.float32, dev).copy_(mass)
            values = values / mass.unsqueeze(-1).clamp_min(torch.finfo(probs.dtype).tiny)
            s.tensor("target_probs_values", (b, seq, self.topk), self.cache_dtype, dev).copy_(values)
            s.tensor("target_probs_indices", (b, seq, self.topk), torch.int32, dev).copy_(indices)
        else:
            s.tensor("target_probs", (b, seq, probs.shape[-1]), self.cache_dtype, dev).copy_(probs)

    def finish(self) -> Optional[BaseException]:
        error = self.pipe.drain()
        self._unhook()
        self.progress.close()
        return error

    def abort(self) -> None:
        self.pipe.abort()
        self._unhook()
        self.progress.close()

    def _unhook(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


# -- the entry point ---------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m shardkit.precompute_eagle3",
        description="Precompute an EAGLE-3 offline cache (NeMo Automodel's format) from a local causal LM, "
                    "on every rank of a torchrun job (RANK/WORLD_SIZE), resumable after a kill.")
    p.add_argument("--model", required=True, help="local directory of the target (from_pretrained; nothing downloads)")
    p.add_argument("--data", required=True, help="local .jsonl/.json of chat samples (`messages`, `conversations`) "
                                                "or pre-tokenized ones (`input_ids`, `loss_mask`)")
    p.add_argument("--out", required=True, help="the cache directory")
    p.add_argument("--seq-length", type=int, default=2048)
    p.add_argument("--draft-vocab-size", type=int, default=None, help="default: the whole target vocabulary")
    p.add_argument("--target-probs-topk", type=int, default=0, help="0: store the draft distribution in full")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--shard-size", type=int, default=256, help="a multiple of --batch-size")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--format-version", type=int, default=2, choices=[1, 2])
    p.add_argument("--aux-layer-ids", type=int, nargs="+", default=None)
    p.add_argument("--device", default=None, help="default: cuda:LOCAL_RANK when CUDA is available, else cpu")
    p.add_argument("--split", default=None, help="train or train[a:b]")
    p.add_argument("--shuffle-seed", type=int, default=42, help="the order NeMo reads the file in; -1: file order")
    p.add_argument("--target-model", default=None, help="recorded in the manifest (default: --model as given)")
    p.add_argument("--input-data", default=None, help="recorded in the manifest (default: --data as given)")
    p.add_argument("--buffers", type=int, default=4)
    p.add_argument("--no-progress", action="store_true")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m shardkit.precompute_eagle3 ...``; returns the exit status."""
    a = _parser().parse_args(argv)
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if a.device is None:
        a.device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if torch.cuda.is_available() else "cpu"
    device = torch.device(a.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    tokenizer = AutoTokenizer.from_pretrained(a.model, local_files_only=True)
    # NeMo runs the target in bf16 on CUDA and in fp32 on the CPU. (`torch_dtype` became
    # `dtype` in transformers 4.56.)
    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    key = "dtype" if (major, minor) >= (4, 56) else "torch_dtype"
    model: Any = AutoModelForCausalLM.from_pretrained(
        a.model, local_files_only=True, **{key: torch.bfloat16 if device.type == "cuda" else torch.float32})
    model = model.to(device)
    seed = None if a.shuffle_seed < 0 else a.shuffle_seed
    samples = load_data(a.data, split=a.split, shuffle_seed=seed)
    st = precompute(model, tokenizer, samples, a.out, seq_length=a.seq_length, draft_vocab_size=a.draft_vocab_size,
                    aux_layer_ids=a.aux_layer_ids, dtype=a.dtype, target_probs_topk=a.target_probs_topk,
                    format_version=a.format_version, shard_size=a.shard_size, batch_size=a.batch_size,
                    target_model=a.target_model if a.target_model is not None else a.model,
                    input_data=a.input_data if a.input_data is not None else a.data, split=a.split,
                    shuffle_seed=a.shuffle_seed, buffers=a.buffers, progress=False if a.no_progress else None)
    print(json.dumps(st), flush=True)
    return 0


_args.guard_module(globals(), [n for n in __all__ if n != "main"])

if __name__ == "__main__":
    sys.exit(main())
