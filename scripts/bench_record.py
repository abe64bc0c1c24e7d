"""Producer overhead (shardkit.record, or shardkit.precompute_eagle3 with --producer eagle3): the
model's forward alone against forward + recording + writing, on the same inputs in the same run, with 1 and several ranks (processes started
together, each recording its part of one saev dataset), and the write rate against the disk's
sequential write ceiling measured in the same run. Prints JSON.

    .venv/bin/python scripts/bench_record.py [--producer saev|eagle3] [--ranks 1,2] [--batches 12]
                                             [--batch 8] [--device cpu|cuda] [--dir DIR]

The model is a random ViT-S/16 built from a config (224 px, 197 tokens, 384 wide, 12 blocks),
whose forward dominates on a CPU; the recorder keeps the CLS and 196 content tokens of 2 blocks.
Each rank gets `cores / ranks` torch threads. Overhead is `recorded / forward - 1` per rank (the
slowest rank's is reported), where `recorded` runs from the first recorded forward to the end
of `close()` (the last writes and, on the rank that completes the set, the commit).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from bench_common import ratio


def ceiling(dir_: str, mib: int = 512) -> float:
    """Sequential write rate of `dir_` in GB/s: `mib` MiB in 8 MiB writes, then fsync."""
    path = os.path.join(dir_, ".ceiling")
    block = os.urandom(8 << 20)
    t = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(mib // 8):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    dt = time.perf_counter() - t
    os.remove(path)
    return mib * (1 << 20) / dt / 1e9


def child_eagle3(args: argparse.Namespace) -> None:
    """One rank of the EAGLE-3 producer: a random Llama (12 layers, 512 wide, vocabulary 8,192,
    sequences of 256) over pre-tokenized samples, draft vocabulary 2,048, bf16 cache."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from shardkit.precompute_eagle3 import precompute

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.world))
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=8192, hidden_size=512, num_hidden_layers=12, num_attention_heads=8,
                      num_key_value_heads=8, intermediate_size=1408, max_position_embeddings=512)
    model = LlamaForCausalLM(cfg).eval().to(args.device)
    seq, n = 256, args.batches * args.batch * args.world
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 8192, (n, seq), generator=gen)
    samples = [{"input_ids": ids[i].tolist(), "loss_mask": [1] * seq} for i in range(n)]
    x = ids[: args.batch].to(args.device)

    def sync() -> None:
        if args.device == "cuda":
            torch.cuda.synchronize()

    with torch.no_grad():
        for _ in range(2):
            model(input_ids=x)
        sync()
        t = time.perf_counter()
        for _ in range(args.batches):
            model(input_ids=x)
        sync()
        forward = time.perf_counter() - t
    written = [0]
    # The provenance digest reads every parameter once per run (setup, not per batch): timed
    # apart, and left out of the overhead as the recorder's construction is.
    from shardkit import provenance

    t = time.perf_counter()
    provenance.model_digest(model)
    setup = time.perf_counter() - t
    t = time.perf_counter()
    precompute(model, None, samples, args.out, seq_length=seq, selected_token_ids=list(range(2048)),
               dtype="bf16", shard_size=args.batch * 4, batch_size=args.batch, target_model="random-llama",
               rank=args.rank, world_size=args.world, progress=lambda d, tot, b: written.__setitem__(0, b))
    sync()
    recorded = time.perf_counter() - t - setup
    print(json.dumps({"rank": args.rank, "forward_s": forward, "recorded_s": recorded, "setup_s": setup,
                      "bytes": written[0]}), flush=True)


def child(args: argparse.Namespace) -> None:
    if args.producer == "eagle3":
        return child_eagle3(args)
    import torch
    from transformers import ViTConfig, ViTModel

    from shardkit.record import ActivationRecorder

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.world))
    torch.manual_seed(0)
    cfg = ViTConfig(hidden_size=384, num_hidden_layers=12, num_attention_heads=6, intermediate_size=1536,
                    image_size=224, patch_size=16)
    model = ViTModel(cfg).eval().to(args.device)
    x = torch.randn(args.batch, 3, 224, 224, device=args.device)
    n = args.batches * args.batch * args.world
    md = {"family": "clip", "ckpt": "vit-s-16-random", "data": "random", "dataset": "none",
          "max_tokens_per_shard": 197 * 2 * args.batch * 4}  # 4 batches a shard

    def sync() -> None:
        if args.device == "cuda":
            torch.cuda.synchronize()

    with torch.no_grad():
        for _ in range(2):
            model(x)
        sync()
        t = time.perf_counter()
        for _ in range(args.batches):
            model(x)
        sync()
        forward = time.perf_counter() - t
    rec = ActivationRecorder(model, args.out, layers=[5, 11], n_examples=n, metadata=md,
                             rank=args.rank, world_size=args.world, progress=False)
    t = time.perf_counter()
    rows = 0
    for first, end in rec.batches(args.batch):
        rec(x[: end - first])
        rows += end - first
    rec.close()
    sync()
    recorded = time.perf_counter() - t
    print(json.dumps({"rank": args.rank, "forward_s": forward, "recorded_s": recorded,
                      "bytes": rows * 2 * 197 * 384 * 4}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="1,2")
    ap.add_argument("--batches", type=int, default=12, help="batches per rank")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--producer", default="saev", choices=["saev", "eagle3"],
                    help="saev: shardkit.record over a ViT-S/16; eagle3: precompute_eagle3 over a Llama")
    ap.add_argument("--dir", default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    base = tempfile.mkdtemp(prefix="bench-record-", dir=args.dir)
    out = {"producer": args.producer, "cores": os.cpu_count(), "device": args.device, "batch": args.batch,
           "ceiling_write_GBps": ceiling(base), "runs": []}
    for world in [int(r) for r in args.ranks.split(",")]:
        root = os.path.join(base, f"w{world}")
        procs = [subprocess.Popen([sys.executable, __file__, "--child", "--rank", str(r), "--world", str(world),
                                   "--out", root, "--batches", str(args.batches), "--batch", str(args.batch),
                                   "--device", args.device, "--producer", args.producer],
                                  stdout=subprocess.PIPE, text=True)
                 for r in range(world)]
        results = []
        for p in procs:
            stdout, _ = p.communicate(timeout=3600)
            if p.returncode != 0:
                sys.exit(f"bench_record: rank failed (exit {p.returncode})")
            results.append(json.loads(stdout.strip().splitlines()[-1]))
        forward = max(r["forward_s"] for r in results)
        recorded = max(r["recorded_s"] for r in results)
        written = sum(r["bytes"] for r in results)
        setup = max(r.get("setup_s", 0.0) for r in results)
        out["runs"].append({
            "ranks": world,
            "forward_s": round(forward, 3),
            "recorded_s": round(recorded, 3),
            "setup_s": round(setup, 3),
            "overhead": round(ratio("recorded vs forward", recorded, forward) - 1, 4),
            "written_GB": round(written / 1e9, 3),
            "write_GBps": round(written / recorded / 1e9, 3),
            "write_vs_ceiling": round(ratio("write vs ceiling", written / recorded / 1e9,
                                            out["ceiling_write_GBps"]), 3),
        })
    out["ceiling_write_GBps"] = round(out["ceiling_write_GBps"], 3)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
