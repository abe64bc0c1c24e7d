"""Where a produced dataset came from: the provenance sidecar ``shardkit.provenance.json``.

saev names a dataset by a hash of its metadata (which holds only the checkpoint's *name*) and
NeMo records only the model id, so a changed model or tokenizer silently extends an old cache.
shardkit's producers record, beside the dataset (a file the references' readers never open),
digests of what decides its bytes: the model's parameters, its tokenizer or image processor, the
input order, and the producer's own settings. The first process of a write records it; every
other rank and every restart must bring the same record, or is refused with an error naming
what changed. ``shardkit saev inspect`` / ``eagle3 inspect`` (and ``inspect()``) show it.

    from shardkit import provenance
    provenance.read("acts/85a07cb5")   # {"model": {"sha256": ..., "parameters": ...}, ...} or None
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Dict, Optional, Union

from . import _args
from . import _shardkit as _core
from .errors import InvalidArgumentError

PathLike = Union[str, "os.PathLike[str]"]

__all__ = ["FILE", "record", "read", "model_digest", "processor_digest", "inputs_digest"]

FILE = "shardkit.provenance.json"


def record(path: PathLike, provenance: Dict[str, Any]) -> None:
    """Records ``provenance`` (a dict of dicts) for the dataset at ``path`` (a directory or an
    ``s3://`` URL), or checks it against the one recorded there: AlreadyExistsError naming
    the differing keys (``model.sha256``) when they differ; nothing is written then."""
    if not isinstance(provenance, dict):
        raise _args.InvalidArgumentTypeError(
            f"provenance must be a dict, got {type(provenance).__name__}")
    _core.provenance_record(_args.path("path", path), json.dumps(provenance, sort_keys=True))


def read(path: PathLike) -> Optional[Dict[str, Any]]:
    """The provenance recorded for the dataset at ``path``, or None."""
    text = _core.provenance_read(_args.path("path", path))
    return None if text is None else dict(json.loads(text))


def model_digest(model: Any) -> Dict[str, Any]:
    """``{"sha256", "tensors", "parameters", "dtypes"}`` of a ``torch.nn.Module``'s state: every
    parameter and buffer (name, dtype, shape and bytes, in ``state_dict`` order). Reads every
    byte once (through the host: a few seconds per GB)."""
    import torch

    if not isinstance(model, torch.nn.Module):
        raise _args.InvalidArgumentTypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    h = hashlib.sha256()
    count, dtypes = 0, set()
    state = model.state_dict(keep_vars=False)
    for name, t in state.items():
        if not isinstance(t, torch.Tensor):
            continue
        t = t.detach()
        h.update(json.dumps([name, str(t.dtype), list(t.shape)]).encode())
        if t.numel():
            h.update(t.reshape(-1).contiguous().view(torch.uint8).cpu().numpy().data)  # no host copy
        count += t.numel()
        dtypes.add(str(t.dtype).removeprefix("torch."))
    return {"sha256": h.hexdigest(), "tensors": len(state), "parameters": count, "dtypes": sorted(dtypes)}


def processor_digest(processor: Any) -> Dict[str, Any]:
    """``{"sha256", "kind"}`` of what turns inputs into model inputs: a Hugging Face tokenizer
    (its vocabulary and rules, special tokens and chat template), an image processor or feature
    extractor (its configuration), or a string naming one."""
    if isinstance(processor, str):
        kind, text = "named", processor
    elif hasattr(processor, "backend_tokenizer"):
        kind = "tokenizer"
        text = json.dumps({
            "tokenizer": processor.backend_tokenizer.to_str(),
            "special_tokens": {k: str(v) for k, v in sorted(processor.special_tokens_map.items())},
            "chat_template": getattr(processor, "chat_template", None),
        }, sort_keys=True)
    elif hasattr(processor, "to_json_string"):
        kind, text = type(processor).__name__, processor.to_json_string()
    else:
        raise InvalidArgumentError(
            f"processor: cannot digest a {type(processor).__name__}; give a Hugging Face tokenizer, "
            "an image processor, or a string naming it")
    return {"sha256": hashlib.sha256(text.encode()).hexdigest(), "kind": kind}


def inputs_digest(inputs: Any) -> Dict[str, Any]:
    """``{"sha256", "count"?}`` of the input order: anything JSON can write (the list of image
    paths, sample ids, or a string naming the dataset, its split and its order)."""
    def plain(o: Any) -> Any:  # arrays and tensors as their values
        if hasattr(o, "tolist"):
            return o.tolist()
        raise TypeError(f"{type(o).__name__} is not JSON-writable")

    h = hashlib.sha256()
    try:
        for chunk in json.JSONEncoder(sort_keys=True, default=plain).iterencode(inputs):
            h.update(chunk.encode())
    except (TypeError, ValueError) as e:
        raise InvalidArgumentError(
            f"inputs: give what identifies the inputs in order as JSON-writable values "
            f"(paths, ids, a name, arrays): {e}") from None
    out: Dict[str, Any] = {"sha256": h.hexdigest()}
    if isinstance(inputs, (list, tuple)):
        out["count"] = len(inputs)
    return out
