"""Record the activations of a PyTorch model into a saev dataset (the producer saev's
``RecordedTransformer`` and ``worker_fn`` are, on every GPU and never blocked by the disk).

Forward hooks on the recorded modules copy each one's output (or input), the saev tokens only
(CLS, then the content tokens: registers left out), into a float32 staging tensor on the
model's device, shaped like a saev shard's rows ``(batch, layers, tokens, d_model)``. After the
forward, one copy moves the batch to pinned host memory on a side CUDA stream, and a writer
thread hands it to a :class:`shardkit.saev.PartWriter` once the copy is done. The model's
stream never waits for the disk: it waits only when every staging slot (``buffers``, 4 by
default) is still being written, which bounds memory and makes a slow disk slow the producer
down instead of filling RAM.

Every process of a job (``torchrun``, a Slurm array, plain processes) records its part of one
dataset (rank and world size from the launcher's variables, or given): the part writer's
``pending`` ranges say which examples this rank still owes, after a kill too, and the rank that
completes the set commits the dataset, byte-identical to one process's.

    from shardkit.record import ActivationRecorder

    with ActivationRecorder(model, "acts", layers=[-2, -1], n_examples=len(images),
                            metadata={"family": "clip", "ckpt": "openai/clip-vit-b-16",
                                      "data": "imagenet-1k train", "dataset": "/data/in1k"}) as rec:
        for first, end in rec.batches(256):   # this rank's examples still owed, shard-aligned
            rec(images[first:end])            # the model's forward, recorded; returns its output
"""

from __future__ import annotations

import difflib
import importlib
import os
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from . import _args, provenance, saev
from ._pipeline import Pipeline, Slot
from ._progress import Progress
from .errors import InvalidArgumentError

PathLike = Union[str, "os.PathLike[str]"]

__all__ = ["ActivationRecorder", "TextRecorder", "find_blocks", "token_ids"]

# Where the residual blocks of the usual model classes live: Hugging Face CLIP, SigLIP, ViT,
# DINOv2 (bare or inside a task model), Llama-style and GPT-2 language models, timm, open_clip
# and TransformerLens.
_BLOCK_LISTS = (
    "vision_model.encoder.layers",
    "encoder.layers",
    "encoder.layer",
    "vit.encoder.layer",
    "dinov2.encoder.layer",
    "model.layers",
    "model.language_model.layers",
    "layers",
    "transformer.h",
    "h",
    "blocks",
    "visual.transformer.resblocks",
    "transformer.resblocks",
    "visual.trunk.blocks",
)


def shard_batches(pending: Sequence[Tuple[int, int]], per_shard: int, batch_size: int) -> List[Tuple[int, int]]:
    """The examples of the ``pending`` (first, end) ranges cut into batches of at most
    ``batch_size`` that start at each shard's first example (shards of ``per_shard``) and never
    cross a shard: the same batches for any world size and any restart point."""
    size = _args.count("batch_size", batch_size, lo=1)
    out = []
    for first, end in pending:
        at = first
        while at < end:
            stop = min(end, (at // per_shard + 1) * per_shard, at + size)
            out.append((at, stop))
            at = stop
    return out


def find_blocks(model: torch.nn.Module) -> Tuple[str, torch.nn.ModuleList]:
    """The path and the list of the residual blocks of ``model`` (the modules saev's layer
    numbers index), found at the usual places of Hugging Face, timm, open_clip and
    TransformerLens models; InvalidArgumentError naming the places looked at otherwise (give
    ``modules=`` then)."""
    for path in _BLOCK_LISTS:
        try:
            m = model.get_submodule(path)
        except AttributeError:
            continue
        if isinstance(m, torch.nn.ModuleList) and len(m) > 0:
            return path, m
    raise InvalidArgumentError(
        f"{type(model).__name__}: no list of residual blocks at any of {', '.join(_BLOCK_LISTS)}; "
        "name the modules to record with modules=[...] (module paths, or TransformerLens hook "
        "names)")


def _module(model: torch.nn.Module, name: str) -> torch.nn.Module:
    """``model``'s submodule ``name`` (a dotted path, or a TransformerLens hook name, which is
    one), or the error naming the closest names."""
    try:
        return model.get_submodule(name)
    except AttributeError:
        names = [n for n, _ in model.named_modules() if n]
        close = difflib.get_close_matches(name, names, n=5, cutoff=0.5)
        hint = f"; the closest: {', '.join(close)}" if close else ""
        raise InvalidArgumentError(
            f"{type(model).__name__} has no module {name!r}{hint}") from None


def _config_int(model: torch.nn.Module, *keys: str) -> Optional[int]:
    """The first of ``keys`` found in the model's Hugging Face config (or its vision config)."""
    config = getattr(model, "config", None)
    for c in (getattr(config, "vision_config", None), config):
        for k in keys:
            v = getattr(c, k, None) if c is not None else None
            if isinstance(v, int) and not isinstance(v, bool):
                return v
    return None


def _tokens_from_config(model: torch.nn.Module) -> Tuple[Optional[int], Optional[int], int]:
    """(content tokens, d_model, register tokens) a Hugging Face vision config implies."""
    image, patch = _config_int(model, "image_size"), _config_int(model, "patch_size")
    content = (image // patch) ** 2 if image and patch else None
    d_model = _config_int(model, "hidden_size", "d_model", "n_embd")
    registers = _config_int(model, "num_register_tokens") or 0
    return content, d_model, registers


class ActivationRecorder:
    """Records modules of ``model`` into the saev dataset under ``root`` (see the module
    documentation).

    - ``layers``: saev's layer labels (metadata ``layers``), in the order of the dataset's layer
      slots. Without ``modules``, label ``i`` records block ``i`` of the model's block list
      (:func:`find_blocks`; negative counts from the end), each block's output: the residual
      stream after it. With ``modules`` (module paths or TransformerLens hook names, one per
      label), those modules. Slot ``l`` always holds ``layers[l]``'s module, whatever order the
      blocks run in (saev's own writer fills slots in execution order).
    - ``capture``: ``"output"`` (default) or ``"input"`` (the module's first positional input).
    - Tokens: a module emits ``(batch, tokens, d_model)``. ``cls_token`` records token 0 (the
      CLS token) in slot 0; the content tokens are the ``content_tokens`` tokens after the first
      ``prefix_tokens`` (CLS and registers). By default, from a Hugging Face vision config:
      content ``(image_size / patch_size)²``, prefix ``1 + num_register_tokens``; a model without
      a CLS token (SigLIP) needs ``cls_token=False, prefix_tokens=0``.
    - ``metadata``: the rest of metadata.json (``family``, ``ckpt``, ``data``, ``dataset``,
      ``max_tokens_per_shard``, ``pixel_agg``, ...); the recorder sets ``layers``,
      ``content_tokens_per_example``, ``cls_token``, ``d_model`` (from the config, or given
      here) and ``n_examples``.
    - ``rank``/``world_size``: this process's part (default: the launcher's variables); see
      :class:`shardkit.saev.PartWriter`.
    - ``dtype``: the stored value type, ``"float32"`` (default, saev's) or ``"bfloat16"``
      (``"bf16"``) / ``"float16"`` (``"fp16"``): half the bytes, shardkit's reduced-precision
      dialect (see :class:`shardkit.saev.Writer`). Whatever the model computes in, the rows are
      staged as float32 (a bf16 model's values exactly) and rounded to nearest even by the
      writer, which records each shard's rounding error. ``max_rel_error`` bounds a row's
      relative L2 error: a batch holding a row rounded worse fails (naming the shard and the
      row) at the next ``forward`` or at ``close``, and the part is left to a restart.
    - ``buffers``: batches in flight between the model and the disk (memory: this many
      staging tensors on the device and as many pinned host buffers).
    - ``progress``: None (a bar on a terminal, with examples/s, GB/s written and the ETA), a
      bool, or a callable ``f(examples recorded, examples this run owes)``, called on the writer
      thread after each batch is written.

    Call it as the model (``rec(x)``, or ``rec.forward(x, labels=...)`` with per-patch labels
    ``(batch, content_tokens)``): the batch's examples are the next pending ones, in order;
    cut them with :meth:`batches` for a dataset byte-identical across world sizes.
    Use as a context manager: a clean exit waits for the last writes, finishes the part and
    commits when it completes the set (``close()`` returns the dataset's status); an exception
    stops the writer thread and leaves the part to a restart. Hooks are removed either way.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        root: PathLike,
        *,
        layers: Sequence[int],
        n_examples: int,
        metadata: Mapping[str, Any],
        modules: Optional[Sequence[str]] = None,
        capture: str = "output",
        cls_token: Optional[bool] = None,
        content_tokens: Optional[int] = None,
        prefix_tokens: Optional[int] = None,
        d_model: Optional[int] = None,
        rank: Optional[int] = None,
        world_size: Optional[int] = None,
        buffers: int = 4,
        processor: Any = None,
        inputs: Any = None,
        progress: Any = None,
        dtype: Any = None,
        max_rel_error: Optional[float] = None,
    ) -> None:
        if not isinstance(model, torch.nn.Module):
            raise _args.InvalidArgumentTypeError(
                f"model must be a torch.nn.Module, got {type(model).__name__}")
        if capture not in ("output", "input"):
            raise InvalidArgumentError(f"capture must be 'output' or 'input', got {capture!r}")
        labels = [int(x) for x in layers]
        if not labels:
            raise InvalidArgumentError("layers is empty: give at least one layer to record")
        if len(set(labels)) != len(labels):
            raise InvalidArgumentError(f"layers {labels} repeats a label; saev finds a layer's slot by its label")
        self._model = model
        self._recorded = self._resolve(model, labels, modules)
        cfg_content, cfg_d, registers = _tokens_from_config(model)
        md: Dict[str, Any] = dict(metadata)
        self._cls = bool(md.get("cls_token", True) if cls_token is None else cls_token)
        content = content_tokens if content_tokens is not None else md.get("content_tokens_per_example", cfg_content)
        d = d_model if d_model is not None else md.get("d_model", cfg_d)
        if content is None or d is None:
            raise InvalidArgumentError(
                f"{type(model).__name__}: cannot tell the content tokens per example and d_model from "
                "its config; give content_tokens= and d_model=")
        self._content: int = _args.count("content_tokens", content, lo=1)
        self._d: int = _args.count("d_model", d, lo=1)
        prefix = prefix_tokens if prefix_tokens is not None else (1 + registers if self._cls else 0)
        self._prefix: int = _args.count("prefix_tokens", prefix)
        self._tokens = self._content + (1 if self._cls else 0)
        md.update(layers=labels, content_tokens_per_example=self._content, cls_token=self._cls,
                  d_model=self._d, n_examples=_args.count("n_examples", n_examples))
        md.setdefault("max_tokens_per_shard", 2_400_000)
        md.setdefault("data", "")
        md.setdefault("dataset", "")
        md.setdefault("protocol", "2.1")
        self._capture = capture
        n_buffers = _args.count("buffers", buffers, lo=1)
        record = self._provenance(model, processor, inputs, labels)
        self._writer = saev.PartWriter(root, md, rank=rank, world_size=world_size, progress=False, dtype=dtype,
                                       max_rel_error=max_rel_error)
        try:
            provenance.record(self._writer.path, record)
        except BaseException:
            self._writer.abort()
            raise
        # Read once: the writer thread holds the core writer while it writes.
        self._pending = self._writer.pending
        self._next = self._pending[0][0] if self._pending else n_examples  # the next example owed
        self._rank, self._world = self._writer.rank, self._writer.world_size
        self._path = self._writer.path
        self._per_shard = int(md["max_tokens_per_shard"]) // (self._tokens * len(labels))
        self._current: Optional[Slot] = None
        self._filled: List[bool] = []
        self._closed = False
        self._aborted = False
        self._handles = [self._hook(m, slot) for slot, (_, m) in enumerate(self._recorded)]
        # Looked up at each write (not bound now), so the writer can be swapped in tests.
        owed = sum(e - f for f, e in self._pending)
        self._progress = Progress(progress, unit="ex", desc=f"recording (rank {self._rank} of {self._world})",
                                  total=owed)
        self._row_bytes = len(labels) * self._tokens * self._d * (4 if self._writer.dtype == "float32" else 2)
        self._pipe = Pipeline(self._write, buffers=n_buffers, name="shardkit-record")

    def _provenance(self, model: torch.nn.Module, processor: Any, inputs: Any, labels: List[int]) -> Dict[str, Any]:
        """What decides the dataset's bytes beyond its metadata (see shardkit.provenance)."""
        out: Dict[str, Any] = {
            "model": provenance.model_digest(model),
            "recorder": {"modules": [n for n, _ in self._recorded], "layers": labels, "capture": self._capture,
                         "prefix_tokens": self._prefix},
        }
        if processor is not None:
            out["processor"] = provenance.processor_digest(processor)
        if inputs is not None:
            out["inputs"] = provenance.inputs_digest(inputs)
        return out

    @staticmethod
    def _resolve(model: torch.nn.Module, labels: List[int],
                 modules: Optional[Sequence[str]]) -> List[Tuple[str, torch.nn.Module]]:
        if modules is not None:
            names = [str(n) for n in modules]
            if len(names) != len(labels):
                raise InvalidArgumentError(
                    f"modules names {len(names)} modules for {len(labels)} layers; give one per layer label")
            return [(n, _module(model, n)) for n in names]
        path, blocks = find_blocks(model)
        out = []
        for label in labels:
            if not -len(blocks) <= label < len(blocks):
                raise InvalidArgumentError(
                    f"layer {label} is not a block of {type(model).__name__} ({len(blocks)} blocks at {path})")
            i = label % len(blocks)
            out.append((f"{path}.{i}", blocks[i]))
        return out

    # -- the pipeline -----------------------------------------------------------------------

    def _hook(self, module: torch.nn.Module, slot: int) -> Any:
        def take(x: Any) -> None:
            s = self._current
            if s is None:
                return  # the model run outside the recorder: nothing to record
            t = x[0] if isinstance(x, (tuple, list)) else x
            if not isinstance(t, torch.Tensor) or t.dim() != 3:
                raise InvalidArgumentError(
                    f"{self._recorded[slot][0]}: its {self._capture} is not one (batch, tokens, d_model) "
                    f"tensor (got {type(t).__name__}{tuple(t.shape) if isinstance(t, torch.Tensor) else ''})")
            b, n, d = t.shape
            if d != self._d or n < self._prefix + self._content:
                raise InvalidArgumentError(
                    f"{self._recorded[slot][0]}: emits {n} tokens of {d} dimensions; the dataset records "
                    f"{self._prefix} prefix + {self._content} content tokens of d_model {self._d}")
            if s.rows == 0:
                s.rows = b
            elif b != s.rows:
                raise InvalidArgumentError(
                    f"{self._recorded[slot][0]}: batch of {b}, while other recorded modules saw {s.rows}")
            # The batch's rows as a shard stores them: (batch, layers, tokens, d_model).
            stage = s.tensor("acts", (b, len(self._recorded), self._tokens, self._d), torch.float32, t.device)
            rows = stage[:, slot]
            with torch.no_grad():
                at = 0
                if self._cls:
                    rows[:, 0].copy_(t[:, 0])
                    at = 1
                rows[:, at:].copy_(t[:, self._prefix:self._prefix + self._content])
            self._filled[slot] = True

        if self._capture == "output":
            return module.register_forward_hook(lambda _m, _args, out: take(out))
        return module.register_forward_pre_hook(lambda _m, args: take(args))

    def _write(self, t: Dict[str, torch.Tensor], labels: Any) -> None:
        """The writer thread's part: one batch to the saev writer, then the progress."""
        n = int(t["acts"].shape[0])
        self._writer.write(t["acts"].numpy(), labels)
        p = self._progress
        p.advance(n, p.position + n, p.total, nbytes=n * self._row_bytes)

    def forward(self, *args: Any, labels: Any = None, **kwargs: Any) -> Any:
        """Runs ``model(*args, **kwargs)`` without gradients, recording its batch (the next
        pending examples); ``labels`` are the batch's per-patch labels (batch, content tokens),
        for a dataset with labels.bin. Returns the model's output."""
        if self._closed:
            raise InvalidArgumentError("the recorder is closed")
        s = self._pipe.take()  # waits while every slot is being written: backpressure
        self._filled = [False] * len(self._recorded)
        self._current = s
        try:
            with torch.no_grad():
                out = self._model(*args, **kwargs)
        except BaseException:
            self._current = None
            self._pipe.give_back(s)
            raise
        self._current = None
        missing = [self._recorded[i][0] for i, f in enumerate(self._filled) if not f]
        if missing:
            self._pipe.give_back(s)
            raise InvalidArgumentError(
                f"the forward did not run the recorded module(s) {', '.join(missing)}; nothing was recorded")
        # The batch is the next pending examples: within one pending range (the writer would
        # otherwise put the rows after a gap where the caller did not mean them).
        first = self._next
        owed = [r for r in self._pending if r[0] <= first < r[1]]
        if not owed or first + s.rows > owed[0][1]:
            self._pipe.give_back(s)
            raise InvalidArgumentError(
                f"a batch of {s.rows} examples from example {first} runs past this rank's pending examples "
                f"{self._pending}; cut them with batches() (nothing was recorded)")
        lab = None
        if labels is not None:
            lab = labels.detach().cpu().numpy() if isinstance(labels, torch.Tensor) else np.asarray(labels)
        self._pipe.submit(s, s.rows, lab)
        self._next = first + s.rows
        later = [r[0] for r in self._pending if r[0] >= self._next]
        if self._next == owed[0][1] and later:
            self._next = later[0]
        return out

    __call__ = forward

    # -- the writer's face ------------------------------------------------------------------

    @property
    def pending(self) -> List[Tuple[int, int]]:
        """(first, end) example ranges this rank still owes, in the order to record them."""
        return list(self._pending)

    def batches(self, batch_size: int) -> List[Tuple[int, int]]:
        """The pending examples cut into batches of at most ``batch_size``: (first, end) ranges
        that start at each shard's first example and never cross a shard. Every run, whatever
        its world size and wherever it resumed, cuts a shard into the same batches, and a
        model's output can depend on the rest of its batch (kernels are chosen by batch size):
        recording in these batches is what makes the dataset byte-identical across world
        sizes and restarts (with deterministic kernels on an accelerator:
        ``torch.use_deterministic_algorithms(True)``)."""
        return shard_batches(self._pending, self._per_shard, batch_size)

    @property
    def path(self) -> str:
        """The dataset directory (``root/<hash>``)."""
        return self._path

    @property
    def rank(self) -> int:
        """This process's rank."""
        return self._rank

    @property
    def world_size(self) -> int:
        """How many processes record the dataset."""
        return self._world

    @property
    def dtype(self) -> str:
        """The stored value type (``"float32"``, ``"bfloat16"`` or ``"float16"``)."""
        return self._writer.dtype

    @property
    def modules(self) -> List[str]:
        """The recorded modules' names, one per layer slot."""
        return [n for n, _ in self._recorded]

    def _remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def close(self) -> Dict[str, Any]:
        """Waits for the batches in flight, finishes this rank's part (committing the dataset
        when it completes the set) and returns the dataset's status; the error of any write
        that failed in the background is raised here (or at the next ``forward``)."""
        if self._aborted:
            raise InvalidArgumentError(
                "the recorder was aborted: what is durable stays, and a restart continues the part")
        if not self._closed:
            self._closed = True
            error = self._pipe.drain()
            self._remove_hooks()
            self._progress.close()
            if error is not None:
                self._writer.abort()
                raise error
        return self._writer.close()

    def abort(self) -> None:
        """Stops without finishing: what is durable stays, and a restart continues."""
        self._aborted = True
        if not self._closed:
            self._closed = True
            self._pipe.abort()
            self._remove_hooks()
            self._progress.close()
            self._writer.abort()

    def __enter__(self) -> "ActivationRecorder":
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        if exc_type is None and not self._aborted:
            self.close()
        else:
            self.abort()

    def __repr__(self) -> str:
        return (f"ActivationRecorder({self.path!r}, modules={self.modules}, rank={self.rank}, "
                f"world_size={self.world_size})")


from ._record_text import TextRecorder, token_ids  # noqa: E402  (it builds on ActivationRecorder)

# -- python -m shardkit.record ---------------------------------------------------------------


def _images(directory: str, config: Dict[str, Any], side: int) -> Tuple[List[str], Any]:
    """The image files under ``directory`` (sorted relative paths) and a function loading
    examples ``first:end`` as float32 (n, 3, side, side): resized (shortest edge), center
    cropped and normalized as the model's preprocessor_config.json says, with Pillow."""
    try:
        Image: Any = importlib.import_module("PIL.Image")
    except ImportError:
        raise InvalidArgumentError("--images needs Pillow (pip install pillow); or give --pixels FILE.npy") from None
    exts = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".gif", ".tif", ".tiff")
    files = sorted(os.path.relpath(os.path.join(d, f), directory)
                   for d, _, fs in os.walk(directory) for f in fs if f.lower().endswith(exts))
    if not files:
        raise InvalidArgumentError(f"{directory}: no image files ({', '.join(exts)})")
    size = config.get("size", {})
    edge = int(size.get("shortest_edge") or size.get("height") or side) if isinstance(size, dict) else int(size)
    crop = config.get("crop_size", side)
    crop = int(crop.get("height", side)) if isinstance(crop, dict) else int(crop)
    mean = np.array(config.get("image_mean", [0.5, 0.5, 0.5]), np.float32).reshape(3, 1, 1)
    std = np.array(config.get("image_std", [0.5, 0.5, 0.5]), np.float32).reshape(3, 1, 1)

    def load(first: int, end: int) -> "torch.Tensor":
        out = np.empty((end - first, 3, crop, crop), np.float32)
        for i, name in enumerate(files[first:end]):
            with Image.open(os.path.join(directory, name)) as im:
                im = im.convert("RGB")
                w, h = im.size
                s = edge / min(w, h)
                im = im.resize((max(crop, round(w * s)), max(crop, round(h * s))), Image.Resampling.BICUBIC)
                w, h = im.size
                left, top = (w - crop) // 2, (h - crop) // 2
                im = im.crop((left, top, left + crop, top + crop))
                a = np.asarray(im, np.float32).transpose(2, 0, 1) / 255.0
            out[i] = (a - mean) / std
        return torch.from_numpy(out)

    return files, load


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    """``python -m shardkit.record``: records a vision model's blocks over a folder of images
    (or preprocessed pixels in a .npy file), or a language model's over windows of a text
    corpus, into a saev dataset, this process's part of it (rank and world size from the
    launcher). Prints and returns the dataset's status."""
    import argparse
    import json

    ap = argparse.ArgumentParser(prog="python -m shardkit.record", description=main.__doc__)
    ap.add_argument("--model", required=True, help="a local Hugging Face model directory (from_pretrained)")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--images", help="a folder of images (sorted by path; needs Pillow)")
    src.add_argument("--pixels", help="a .npy of float32 (n, 3, H, W), already preprocessed")
    src.add_argument("--text", help="a language model's corpus: JSONL (one document a line, its "
                     "--text-key) or plain text (one document a line), tokenized with the model's tokenizer")
    ap.add_argument("--text-key", default="text", help="the JSONL field holding a document (default: text)")
    ap.add_argument("--context", type=int, default=1024, help="--text: tokens per window (one example)")
    ap.add_argument("--out", required=True, help="the dataset root (a directory or s3:// URL)")
    ap.add_argument("--layers", required=True, type=int, nargs="+", help="block indices (saev layer labels)")
    ap.add_argument("--family", help="saev's family: clip, siglip, dinov2, ... (required for images; "
                    "--text: the model's model_type)")
    ap.add_argument("--ckpt", help="the checkpoint's name in metadata.json (default: --model)")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"],
                    help="the model's compute dtype (the stored type is --store-dtype)")
    ap.add_argument("--store-dtype", default="float32", choices=["float32", "bfloat16", "bf16", "float16", "fp16"],
                    help="the type activations are stored in: float32 (saev's, default), or bfloat16/float16 "
                    "(half the bytes, rounded to nearest even, with each shard's error recorded)")
    ap.add_argument("--max-rel-error", type=float, default=None,
                    help="refuse a row whose relative L2 rounding error exceeds this (with --store-dtype "
                    "bfloat16/float16)")
    ap.add_argument("--max-tokens-per-shard", type=int, default=2_400_000)
    ap.add_argument("--no-cls", action="store_true", help="the model has no CLS token (SigLIP)")
    args = ap.parse_args(argv)

    from transformers import AutoModel

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.text:
        return _main_text(args, device)
    if not args.family:
        ap.error("--family is required for --images and --pixels")
    model = AutoModel.from_pretrained(args.model, torch_dtype=getattr(torch, args.dtype))
    model = getattr(model, "vision_model", model).eval().to(device)  # CLIP/SigLIP: the vision tower
    config_path = os.path.join(args.model, "preprocessor_config.json")
    processor: Dict[str, Any] = {}
    if os.path.isfile(config_path):
        with open(config_path) as f:
            processor = json.load(f)
    side = _config_int(model, "image_size") or 224
    if args.images:
        names, load = _images(args.images, processor, side)
        inputs: Any = names
        n = len(names)
    else:
        pixels = np.load(args.pixels, mmap_mode="r")
        if pixels.ndim != 4 or pixels.dtype != np.float32:
            raise InvalidArgumentError(f"{args.pixels}: expected float32 (n, 3, H, W), got {pixels.dtype} {pixels.shape}")
        n = int(pixels.shape[0])
        inputs = os.path.abspath(args.pixels)

        def load(first: int, end: int) -> "torch.Tensor":
            return torch.from_numpy(np.array(pixels[first:end]))  # a writable copy of the memory map

    md = {"family": args.family, "ckpt": args.ckpt or args.model, "data": args.images or args.pixels,
          "dataset": os.path.abspath(args.images or args.pixels), "max_tokens_per_shard": args.max_tokens_per_shard}
    rec = ActivationRecorder(model, args.out, layers=args.layers, n_examples=n, metadata=md,
                             cls_token=not args.no_cls, processor=json.dumps(processor, sort_keys=True),
                             inputs=inputs, dtype=args.store_dtype, max_rel_error=args.max_rel_error)
    with rec:
        for first, end in rec.batches(args.batch_size):
            rec(load(first, end).to(device=device, dtype=getattr(torch, args.dtype)))
    status = rec.close()
    print(json.dumps({"path": rec.path, **status}))
    return status


def _windows(path: str, key: str, tokenizer: Any, context: int) -> "torch.Tensor":
    """The corpus at ``path`` as windows of ``context`` token ids: each document tokenized as
    the tokenizer does by default (a BOS first, for most), followed by the EOS token when the
    tokenizer has one, all concatenated, cut into whole windows (the tail shorter than a window
    is left out)."""
    import json

    ids: List[int] = []
    eos = getattr(tokenizer, "eos_token_id", None)
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            if path.endswith((".jsonl", ".json")):
                try:
                    doc = json.loads(line)[key]
                except (ValueError, KeyError, TypeError) as e:
                    raise InvalidArgumentError(f"{path}:{n}: not a JSON object with a string {key!r}: {e}") from None
                if not isinstance(doc, str):
                    raise InvalidArgumentError(f"{path}:{n}: {key!r} is not a string")
            else:
                doc = line.rstrip("\n")
            ids.extend(tokenizer(doc)["input_ids"])
            if eos is not None:
                ids.append(int(eos))
    n_windows = len(ids) // context
    if n_windows == 0:
        raise InvalidArgumentError(f"{path}: {len(ids)} tokens, fewer than one window of {context}")
    return torch.tensor(ids[: n_windows * context], dtype=torch.long).reshape(n_windows, context)


def _main_text(args: Any, device: "torch.device") -> Dict[str, Any]:
    """``main`` for ``--text``: a language model over windows of the corpus (TextRecorder)."""
    import json

    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    windows = _windows(args.text, args.text_key, tokenizer, _args.count("context", args.context, lo=1))
    model = AutoModel.from_pretrained(args.model, torch_dtype=getattr(torch, args.dtype)).eval().to(device)
    md: Dict[str, Any] = {"ckpt": args.ckpt or args.model, "data": args.text, "dataset": os.path.abspath(args.text),
                          "max_tokens_per_shard": args.max_tokens_per_shard}
    if args.family:
        md["family"] = args.family
    rec = TextRecorder(model, args.out, layers=args.layers, n_examples=len(windows), context=args.context,
                       metadata=md, tokenizer=tokenizer,
                       inputs={"corpus": os.path.abspath(args.text), "windows": len(windows)},
                       dtype=args.store_dtype, max_rel_error=args.max_rel_error)
    with rec:
        for first, end in rec.batches(args.batch_size):
            rec(windows[first:end].to(device))
    status = rec.close()
    print(json.dumps({"path": rec.path, **status}))
    return status


if __name__ == "__main__":
    main()
