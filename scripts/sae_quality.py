#!/usr/bin/env python3
"""Training-quality check of reduced-precision saev datasets (issue 37).

The same activations are written as a float32 and as a bfloat16 saev dataset; the same small
TopK sparse autoencoder (same initialisation, same steps, the same batches in the same order from
shardkit's block-shuffled loader with a fixed seed) is trained on each, the bfloat16 rows widened
to float32 on load; both are evaluated on the same held-out float32 activations. Prints JSON with
both reconstruction MSEs and their relative difference, and exits 1 when that difference is above
``--tolerance`` (default 1%).

The activations come from a synthetic generator with the structure an SAE is meant to find: each
token is a sparse, non-negative combination of a few directions of a fixed dictionary (feature
frequencies falling off as a power law, magnitudes log-normal), plus a shared mean direction and
small dense noise. An SAE learns it within a CPU minute, so a precision effect on what it learns
would show, unlike on random activations where every SAE does equally badly.

Each dataset is written with ``shardkit.saev.Writer``, the bfloat16 one given
``dtype="bfloat16"`` (the library rounds to nearest even and writes the error sidecars). How
rows are read: the float32 loader's batches give the order (``example_idx``, ``token_idx``);
the bfloat16 run takes the same rows from the bfloat16 dataset with ``Dataset.take``, which
widens them to float32 in Rust, so both runs see the same rows in the same order and differ only
in their precision. The script checks that the bfloat16 rows are the float32 rows rounded to
nearest even (ml_dtypes), and that ``take`` on the float32 dataset returns the loader's rows.

    python scripts/sae_quality.py [--dir DIR] [--steps 1000] [--seed 0] [--tolerance 0.01]

Runs in about a minute on 2 CPU cores; needs numpy, torch, ml_dtypes and shardkit (built from
this tree: see docs/development.md).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, Tuple

import ml_dtypes
import numpy as np
import torch

from shardkit import saev


def generate(rng: np.random.Generator, n: int, d: int, dictionary: np.ndarray, mean: np.ndarray) -> np.ndarray:
    """``n`` activations of width ``d``: sparse non-negative codes over ``dictionary``, a shared
    mean direction and small dense noise (float32)."""
    m = dictionary.shape[0]
    # Feature i fires with probability falling off as a power law (about 8 active per token).
    p = (np.arange(1, m + 1, dtype=np.float64) ** -0.7)
    p *= 8.0 / p.sum()
    active = rng.random((n, m)) < p
    mags = rng.lognormal(mean=0.0, sigma=0.5, size=(n, m)) * active
    x: np.ndarray = (mags @ dictionary + mean + 0.05 * rng.standard_normal((n, d))).astype(np.float32)
    return x


def make_data(seed: int, d: int, n_feat: int, n_examples: int, tokens: int, n_eval: int) -> Tuple[np.ndarray, np.ndarray]:
    """(examples of shape (n_examples, 1, 1 + tokens, d): CLS then content tokens; held-out rows)."""
    rng = np.random.default_rng(seed)
    dictionary = rng.standard_normal((n_feat, d))
    dictionary /= np.linalg.norm(dictionary, axis=1, keepdims=True)
    dictionary *= 3.0
    mean = rng.standard_normal(d) * 2.0
    acts = generate(rng, n_examples * (1 + tokens), d, dictionary, mean).reshape(n_examples, 1, 1 + tokens, d)
    held_out = generate(rng, n_eval, d, dictionary, mean)
    return acts, held_out


def metadata(n_examples: int, tokens: int, d: int) -> Dict[str, Any]:
    return {
        "family": "clip", "ckpt": "synthetic-sparse-dictionary", "layers": [0],
        "content_tokens_per_example": tokens, "cls_token": True, "d_model": d,
        "n_examples": n_examples, "max_tokens_per_shard": 64 * (1 + tokens),
        "data": "gASV", "dataset": "sae-quality", "protocol": "2.1",
    }


def write_float32(root: Path, md: Dict[str, Any], acts: np.ndarray) -> str:
    with saev.Writer(root, md, progress=False) as w:
        for i in range(0, acts.shape[0], 256):
            w.write(acts[i:i + 256])
    return w.path


def write_bfloat16(root: Path, md: Dict[str, Any], acts: np.ndarray) -> str:
    """The bfloat16 dataset of the same activations (rounded to nearest even by the writer)."""
    with saev.Writer(root, md, dtype="bfloat16", progress=False) as w:
        for i in range(0, acts.shape[0], 256):
            w.write(acts[i:i + 256])
    return w.path


class TopKSAE(torch.nn.Module):
    """A TopK sparse autoencoder (Gao et al. 2024): keep the k largest pre-activations."""

    def __init__(self, d: int, width: int, k: int) -> None:
        super().__init__()
        self.k = k
        self.b_dec = torch.nn.Parameter(torch.zeros(d))
        w = torch.randn(width, d)
        w /= w.norm(dim=1, keepdim=True)
        self.W_dec = torch.nn.Parameter(w.clone())
        self.W_enc = torch.nn.Parameter(w.t().clone())
        self.b_enc = torch.nn.Parameter(torch.zeros(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pre = (x - self.b_dec) @ self.W_enc + self.b_enc
        top = torch.topk(pre, self.k, dim=-1)
        z = torch.zeros_like(pre).scatter_(-1, top.indices, torch.relu(top.values))
        return z @ self.W_dec + self.b_dec


def new_sae(mean: np.ndarray, args: argparse.Namespace, d: int) -> Tuple[TopKSAE, torch.optim.Optimizer]:
    """The SAE and its optimiser, the same for every dataset (seeded)."""
    torch.manual_seed(args.seed)
    sae = TopKSAE(d, args.width, args.k)
    with torch.no_grad():
        sae.b_dec.copy_(torch.from_numpy(mean))
    return sae, torch.optim.Adam(sae.parameters(), lr=args.lr)


def step(sae: TopKSAE, opt: torch.optim.Optimizer, batch: np.ndarray) -> float:
    x = torch.from_numpy(batch)
    loss = ((sae(x) - x) ** 2).sum(-1).mean()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    with torch.no_grad():
        sae.W_dec.div_(sae.W_dec.norm(dim=1, keepdim=True))
    return float(loss.item())


def evaluate(sae: TopKSAE, held_out: np.ndarray) -> Dict[str, float]:
    x = torch.from_numpy(held_out)
    with torch.no_grad():
        err = ((sae(x) - x) ** 2).mean().item()
        var = ((x - x.mean(0)) ** 2).mean().item()
    return {"mse": err, "normalized_mse": err / var}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", help="where to write the datasets (default: a temporary directory, removed)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--features", type=int, default=512, help="true dictionary size of the generator")
    ap.add_argument("--examples", type=int, default=2048)
    ap.add_argument("--tokens", type=int, default=64, help="content tokens per example (plus a CLS)")
    ap.add_argument("--held-out", type=int, default=8192)
    ap.add_argument("--width", type=int, default=1024, help="SAE latents")
    ap.add_argument("--k", type=int, default=16)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--batch-size", type=int, default=512)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--tolerance", type=float, default=0.01, help="largest relative MSE difference allowed")
    args = ap.parse_args()
    # One thread: the same float sums in every run, and no spinning on a busy machine.
    torch.set_num_threads(1)
    t0 = time.monotonic()

    tmp = None
    root = Path(args.dir) if args.dir else Path(tmp := tempfile.mkdtemp(prefix="sae_quality."))
    try:
        d = args.d_model
        acts, held_out = make_data(args.seed, d, args.features, args.examples, args.tokens, args.held_out)
        md = metadata(args.examples, args.tokens, d)
        f32_path = write_float32(root, md, acts)
        bf16_path = write_bfloat16(root, md, acts)
        f32_ds, bf16_ds = saev.open(f32_path), saev.open(bf16_path)
        t_written = time.monotonic()

        # The batches, in the float32 loader's order (block shuffle, fixed seed; a new epoch
        # each time the data runs out), and the same rows of the bfloat16 dataset, widened: each
        # step trains the float32 SAE on the one and the bfloat16 SAE on the other (the two
        # never share anything, so training them in step changes neither).
        mean = acts[:, 0, 1:].reshape(-1, d).mean(0).astype(np.float32)
        saes = {name: new_sae(mean, args, d) for name in ("float32", "bfloat16")}
        train_s = {name: 0.0 for name in saes}
        load_s = 0.0
        loader = saev.Loader(f32_path, layer=0, batch_size=args.batch_size, order="block", seed=args.seed,
                             drop_last=True, num_threads=2)
        steps, epoch = 0, 0
        while steps < args.steps:
            loader.set_epoch(epoch)
            t = time.monotonic()
            for b in loader:
                if steps == args.steps:
                    break
                rows = np.array(b["act"], dtype=np.float32, copy=True)
                ex, tok = np.asarray(b["example_idx"]), np.asarray(b["token_idx"])
                wide = np.asarray(bf16_ds.take(ex, 0, tok + 1), dtype=np.float32)  # slot 0 is CLS
                if steps == 0:
                    # The order is read right, and the bfloat16 rows are these rows rounded.
                    if not np.array_equal(f32_ds.take(ex, 0, tok + 1), rows):
                        sys.exit("sae_quality: Dataset.take on the float32 dataset differs from the loader's rows")
                    rounded = rows.astype(ml_dtypes.bfloat16).astype(np.float32)
                    if not np.array_equal(rounded.view(np.uint32), wide.view(np.uint32)):
                        sys.exit("sae_quality: the bfloat16 rows are not the float32 rows rounded to nearest even")
                load_s += time.monotonic() - t
                for name, batch in (("float32", rows), ("bfloat16", wide)):
                    t = time.monotonic()
                    step(*saes[name], batch)
                    train_s[name] += time.monotonic() - t
                steps += 1
                t = time.monotonic()
            epoch += 1
        results = {name: {**evaluate(sae, held_out), "train_s": round(train_s[name], 1)}
                   for name, (sae, _) in saes.items()}
        mse_f32, mse_bf16 = results["float32"]["mse"], results["bfloat16"]["mse"]
        rel = abs(mse_bf16 - mse_f32) / mse_f32
        rounding = np.abs(acts - acts.astype(ml_dtypes.bfloat16).astype(np.float32))
        report = {
            "check": "sae_quality",
            "passed": rel <= args.tolerance,
            "relative_mse_difference": rel,
            "tolerance": args.tolerance,
            "float32": results["float32"],
            "bfloat16_upcast": results["bfloat16"],
            "bfloat16_read_by": "Dataset.take (widened to float32 in Rust), rows in the float32 loader's order",
            "bfloat16_dataset": {"path": bf16_path, "inspect_precision": saev_precision(bf16_path)},
            "data": {
                "generator": "sparse non-negative codes over a fixed dictionary + mean + noise",
                "d_model": d, "features": args.features, "train_rows": args.examples * args.tokens,
                "held_out_rows": args.held_out, "bf16_max_abs_rounding_error": float(rounding.max()),
                "mean_abs_value": float(np.abs(acts).mean()),
            },
            "sae": {"kind": "topk", "width": args.width, "k": args.k, "steps": args.steps,
                    "batch_size": args.batch_size, "lr": args.lr, "seed": args.seed,
                    "order": "block", "epochs_read": epoch},
            "seconds": {"write": round(t_written - t0, 1), "load": round(load_s, 1),
                        "total": round(time.monotonic() - t0, 1)},
        }
        print(json.dumps(report, indent=2))
        return 0 if report["passed"] else 1
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def saev_precision(path: str) -> Any:
    """The rounding error the writer recorded (``saev.inspect``'s "precision"), if this build
    reports it."""
    inspect_fn = getattr(saev, "inspect", None)
    if inspect_fn is None:
        return None
    try:
        info = inspect_fn(path)
    except Exception:  # noqa: BLE001 - a report without it is still a report
        return None
    return info.get("precision") if isinstance(info, dict) else None


if __name__ == "__main__":
    sys.exit(main())
