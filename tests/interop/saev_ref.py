"""What saev's own code does with a directory, restated from the format reference
(../shared/formats/saev.md §3.2, §6, §10) so shardkit's output can be checked without saev
installed: `load_metadata` fails where saev's `Metadata.load` (a dataclass built from the
file's keys under a runtime type checker) raises; `make_data_cfg` unpickles `data` as saev does;
`vector` addresses one activation as saev's indexed reader does.

Written independently of shardkit: only json, base64, pickle and numpy.
"""

import base64
import dataclasses
import json
import pickle
import sys
import types
from pathlib import Path

import numpy as np

# Each protocol's `Metadata` fields: name -> (type check, required).
_INT = ("int", lambda v: isinstance(v, int) and not isinstance(v, bool))
_STR = ("str", lambda v: isinstance(v, str))
_BOOL = ("bool", lambda v: isinstance(v, bool))
_INTS = ("tuple[int, ...]", lambda v: isinstance(v, list) and all(_INT[1](x) for x in v))


def _literal(*values):
    return (f"Literal{list(values)}", lambda v: v in values)


FIELDS = {
    "2.1": {
        "family": (_literal("bird-mae", "clip", "dinov2", "dinov3", "fake-clip", "pe-core",
                            "pe-spatial", "siglip"), True),
        "ckpt": (_STR, True), "layers": (_INTS, True), "content_tokens_per_example": (_INT, True),
        "cls_token": (_BOOL, True), "d_model": (_INT, True), "n_examples": (_INT, True),
        "max_tokens_per_shard": (_INT, True), "data": (_STR, True), "dataset": (_STR, True),
        "pixel_agg": (_literal("majority", "prefer-fg"), True),
        "dtype": (_literal("float32"), False), "protocol": (_literal("1.0.0", "1.1", "2.1"), False),
    },
    "2.0": {
        "family": (_literal("clip", "siglip", "dinov2", "dinov3", "fake-clip"), True),
        "ckpt": (_STR, True), "layers": (_INTS, True), "patches_per_ex": (_INT, True),
        "cls_token": (_BOOL, True), "d_model": (_INT, True), "n_ex": (_INT, True),
        "patches_per_shard": (_INT, True), "data": (("dict", lambda v: isinstance(v, dict)), True),
        "dataset": (_STR, True), "pixel_agg": (_literal("majority", "prefer-fg", None), False),
        "dtype": (_literal("float32"), False), "protocol": (_literal("1.0.0", "1.1", "2.0"), False),
    },
    "1.0.0": {
        "vit_family": (_literal("clip", "siglip", "dinov2", "dinov3"), True),
        "vit_ckpt": (_STR, True), "layers": (_INTS, True), "n_patches_per_img": (_INT, True),
        "cls_token": (_BOOL, True), "d_vit": (_INT, True), "n_imgs": (_INT, True),
        "max_patches_per_shard": (_INT, True),
        "data": (("dict", lambda v: isinstance(v, dict)), True),
        "dtype": (_literal("float32"), False), "protocol": (_literal("1.0.0"), False),
    },
}
# Logical fields by each version's key names: P, D, N, M.
NAMES = {
    "2.1": ("content_tokens_per_example", "d_model", "n_examples", "max_tokens_per_shard"),
    "2.0": ("patches_per_ex", "d_model", "n_ex", "patches_per_shard"),
    "1.0.0": ("n_patches_per_img", "d_vit", "n_imgs", "max_patches_per_shard"),
}


def load_metadata(directory, protocol="2.1"):
    """The metadata dict, or TypeError / AssertionError where saev's Metadata.load fails."""
    md = json.loads((Path(directory) / "metadata.json").read_text(encoding="utf-8"))
    fields = FIELDS[protocol]
    for key in md:
        if key not in fields:
            raise TypeError(f"__init__() got an unexpected keyword argument '{key}'")
    for key, ((name, ok), required) in fields.items():
        if key not in md:
            if required:
                raise TypeError(f"__init__() missing required keyword argument: '{key}'")
            continue
        if not ok(md[key]):
            raise TypeError(f"{key}={md[key]!r} violates type hint {name}")
    p, _, _, m = (md[k] for k in NAMES[protocol])
    tokens = p + int(md["cls_token"])
    assert m // (tokens * len(md["layers"])) >= 1, "At least one example per shard must fit"
    return md


@dataclasses.dataclass(frozen=True)
class FakeImg:
    n_examples: int = 1


def make_data_cfg(md):
    """saev's `pickle.loads(base64.b64decode(md["data"]))`, with saev's FakeImg config class
    stood in for by a dataclass of the same module and name."""
    mod = types.ModuleType("saev.data.datasets")
    mod.FakeImg = FakeImg
    FakeImg.__module__ = "saev.data.datasets"
    saved = {k: sys.modules.get(k) for k in ("saev", "saev.data", "saev.data.datasets")}
    sys.modules.update({"saev": types.ModuleType("saev"), "saev.data": types.ModuleType("saev.data"),
                        "saev.data.datasets": mod})
    try:
        return pickle.loads(base64.b64decode(md["data"], validate=True))
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v


def vector(directory, md, example, layer_value, token_slot, protocol="2.1"):
    """One activation vector, addressed as saev's indexed reader does (§6)."""
    p, d, _, m = (md[k] for k in NAMES[protocol])
    layers = md["layers"]
    t = p + int(md["cls_token"])
    eps = m // (t * len(layers))
    shard = np.memmap(Path(directory) / f"acts{example // eps:06}.bin", dtype="<f4", mode="r",
                      shape=(eps, len(layers), t, d))
    return np.array(shard[example % eps, layers.index(layer_value), token_slot])
