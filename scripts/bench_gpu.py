#!/usr/bin/env python3
"""Does the GPU wait for shardkit? Times one training step with its batches already on the
device, then the same step fed by each shardkit.torch device loader (and, for saev, by
``torch.utils.data.DataLoader(num_workers=N)`` over ``SaevDataset`` with pinned memory),
and prints JSON with each fed/resident ratio (target: >= 0.97).

The step is a sparse autoencoder's (d_model -> width -> d_model, ReLU, bf16 autocast, MSE + L1,
Adam), the model the saev caches train; flat-tokens batches feed it through an embedding of
their token ids and EAGLE-3 batches through their ``aux_hidden_states`` rows, so every loader
delivers ``rows`` rows of ``d_model`` per step. The datasets are written once under ``--dir``
(and stay in the page cache when memory allows: the warm case, where a loader can be the
bottleneck). On a machine without CUDA, ``--device cpu --smoke`` runs every path at toy sizes.

    .venv/bin/python scripts/bench_gpu.py [--dir bench-gpu] [--steps 200] [--workers 4]
"""

import argparse
import itertools
import json
import os
import time
from pathlib import Path

import numpy as np
import torch

from bench_common import ratio
from shardkit import eagle3, flat_tokens, saev
from shardkit import torch as sktorch

ROOT = Path(__file__).resolve().parents[1]


class SAE(torch.nn.Module):
    def __init__(self, d: int, width: int) -> None:
        super().__init__()
        self.enc = torch.nn.Linear(d, width)
        self.dec = torch.nn.Linear(width, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f = torch.relu(self.enc(x))
        return torch.mean((self.dec(f) - x) ** 2) + 1e-3 * f.abs().sum(dim=-1).mean()


def make_step(d: int, width: int, device: torch.device, vocab: int):
    sae = SAE(d, width).to(device)
    embed = torch.nn.Embedding(vocab, d).to(device).requires_grad_(False)
    opt = torch.optim.Adam(sae.parameters(), lr=1e-4)
    amp = torch.autocast(device.type, dtype=torch.bfloat16)

    def step(x: torch.Tensor) -> None:
        with amp:
            loss = sae(x)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    def rows(which: str, batch: dict) -> torch.Tensor:
        if which == "saev":
            return batch["act"]
        if which == "flat_tokens":
            return embed(batch["inputs"].reshape(-1).long())
        return batch["aux_hidden_states"].reshape(-1, d)

    return step, rows


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def write_saev(root: Path, rows: int, d: int) -> str:
    tokens = 256
    examples = max(1, rows // tokens)
    md = {
        "family": "clip", "ckpt": "synthetic", "layers": [0], "content_tokens_per_example": tokens,
        "cls_token": False, "d_model": d, "n_examples": examples,
        "max_tokens_per_shard": max(tokens, (256 << 20) // (4 * d)), "data": "gASV",
        "dataset": "bench-gpu", "protocol": "2.1",
    }
    rng = np.random.default_rng(0)
    with saev.Writer(root / "saev", md, resume=True, progress=True) as w:
        if w.already_complete:
            return w.path
        chunk = max(1, (64 << 20) // (tokens * d * 4))
        for start in range(w.next_example, examples, chunk):
            n = min(chunk, examples - start)
            w.write(rng.standard_normal((n, 1, tokens, d), dtype=np.float32))
    return w.path


def write_tokens(root: Path, rows: int, seq: int, vocab: int) -> str:
    path = root / "tokens.zarr"
    if Path(str(path) + ".done").exists():
        return str(path)
    rng = np.random.default_rng(1)
    with flat_tokens.Writer(path, "train", progress=True) as w:
        left = rows
        while left > 0:
            docs = [rng.integers(1, vocab, size=int(rng.integers(seq // 4, 2 * seq))).tolist() for _ in range(64)]
            w.append(docs)
            left -= sum(len(x) for x in docs)
    Path(str(path) + ".done").touch()
    return str(path)


def write_eagle3(root: Path, rows: int, seq: int, d: int) -> str:
    path = root / "eagle3"
    samples = max(2, rows // seq)
    vd = 64
    m = {"target_model": "bench", "target_vocab_size": 32000, "draft_vocab_size": vd,
         "seq_length": seq, "dtype": "bf16", "num_samples": samples, "shard_size": 64,
         "aux_hidden_dim": d, "aux_layer_ids": [1, 2, 3], "selected_token_ids": list(range(vd))}
    if Path(str(path) + ".done").exists():
        return str(path)
    rng = np.random.default_rng(2)
    with eagle3.Writer(path, m, resume=path.exists(), progress=True) as w:
        for _ in range(w.next_sample, samples):
            w.add({"input_ids": np.arange(seq), "attention_mask": np.ones(seq, dtype=np.int64),
                   "loss_mask": np.ones(seq, dtype=np.int64),
                   "aux_hidden_states": rng.standard_normal((seq, d), dtype=np.float32),
                   "position_mask": np.ones((seq, 1), dtype=bool),
                   "target_probs": np.full((seq, vd), 1 / vd, dtype=np.float32)})
    Path(str(path) + ".done").touch()
    return str(path)


def endless(loader):
    """Batches across epoch boundaries."""
    for epoch in itertools.count():
        if hasattr(loader, "set_epoch"):
            loader.set_epoch(epoch)
        yield from loader


def time_steps(step, rows, which, batches, steps: int, device: torch.device, row_bytes: int) -> dict:
    for _ in range(3):  # warm-up: kernels chosen, allocator and pools at their steady size
        step(rows(which, next(batches)))
    sync(device)
    t0 = time.perf_counter()
    n = 0
    for _ in range(steps):
        x = rows(which, next(batches))
        n += x.shape[0]
        step(x)
    sync(device)
    dt = time.perf_counter() - t0
    return {"steps_per_s": steps / dt, "rows_per_s": n / dt, "gb_per_s": n * row_bytes / dt / 1e9}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=str(ROOT / "bench-gpu"))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rows", type=int, default=16384, help="rows per step (saev batch size)")
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--width", type=int, default=16384)
    ap.add_argument("--dataset-gib", type=float, default=4.0, help="saev dataset size")
    ap.add_argument("--workers", type=int, default=4, help="DataLoader workers for the comparison (0: skip it)")
    ap.add_argument("--formats", default="saev,flat_tokens,eagle3")
    ap.add_argument("--smoke", action="store_true", help="toy sizes: checks every path, measures nothing")
    a = ap.parse_args()
    if a.smoke:
        a.steps, a.rows, a.d_model, a.width, a.dataset_gib = 4, 256, 32, 64, 0.002
    device = torch.device(a.device)
    root = Path(a.dir)
    root.mkdir(parents=True, exist_ok=True)
    seq = min(1024, a.rows)
    per_batch = max(1, a.rows // seq)
    rows_total = max(8 * a.rows, int(a.dataset_gib * (1 << 30)) // (4 * a.d_model))
    vocab = 32000
    step, rows = make_step(a.d_model, a.width, device, vocab)
    formats = [f for f in a.formats.split(",") if f]

    def loader(which: str, path: str):
        if which == "saev":
            return sktorch.SaevLoader(path, layer=0, batch_size=a.rows, seed=0, device=device)
        if which == "flat_tokens":
            return sktorch.TokensLoader(path, seq_len=seq, batch_size=per_batch, packed=True, epochs=True,
                                        sequences_per_read_block=max(1, min(1024, rows_total // seq // 16)),
                                        read_blocks_per_shuffle_buffer=8, device=device)
        return sktorch.Eagle3Loader(path, batch_size=per_batch, shuffle=True, rank=0, world_size=1, device=device)

    paths = {
        "saev": lambda: write_saev(root, rows_total, a.d_model),
        "flat_tokens": lambda: write_tokens(root, rows_total, seq, vocab),
        "eagle3": lambda: write_eagle3(root, rows_total // 4, seq, a.d_model),
    }
    report = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "cores": os.cpu_count(),
        "sae": {"d_model": a.d_model, "width": a.width, "rows_per_step": a.rows, "autocast": "bf16"},
        "steps": a.steps,
    }
    for which in formats:
        path = paths[which]()
        row_bytes = 4 * a.d_model
        # Resident: the same step on batches already on the device (the first few of the
        # loader, kept there and cycled), the ceiling for any loader.
        warm = loader(which, path)
        resident = [b for b, _ in zip(endless(warm), range(8))]
        on_device = time_steps(step, rows, which, itertools.cycle(resident), a.steps, device, row_bytes)
        del resident, warm
        fed = time_steps(step, rows, which, endless(loader(which, path)), a.steps, device, row_bytes)
        entry = {"path": path, "resident": on_device, "shardkit": fed,
                 "ratio": ratio(f"{which}: shardkit-fed vs resident", fed["steps_per_s"], on_device["steps_per_s"])}
        if which == "saev" and a.workers > 0:
            ds = sktorch.SaevDataset(path, layer=0, batch_size=a.rows, seed=0, rank=0, world_size=1)
            dl = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=a.workers,
                                             pin_memory=device.type == "cuda", persistent_workers=True)
            moved = ({k: v.to(device, non_blocking=True) for k, v in b.items()} for b in endless(dl))
            via = time_steps(step, rows, which, moved, a.steps, device, row_bytes)
            entry[f"dataloader_{a.workers}_workers"] = {
                **via, "ratio": ratio(f"{which}: DataLoader workers vs resident", via["steps_per_s"], on_device["steps_per_s"])}
        report[which] = entry
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
