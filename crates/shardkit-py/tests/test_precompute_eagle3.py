"""The EAGLE-3 teacher-output producer (shardkit.precompute_eagle3): the cache of a tiny seeded
Llama-style model over seeded chat samples equals a straightforward reference computation
(forward with output_hidden_states, softmax over the draft columns in fp32, NeMo's shift and
masks), lossless and top-k, fp32 and bf16, and passes validation; the draft vocabulary is
NeMo's; chat templates with and without {% generation %} and pre-tokenized samples give the
same bytes; 2 ranks give the bytes one process gives, and so does a SIGKILLed run resumed
with another world size; the entry point gives the function's bytes; bad inputs are clear
errors and write nothing."""

import collections
import json
import os
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from shardkit import eagle3, provenance  # noqa: E402
from shardkit.errors import AlreadyExistsError, InvalidArgumentError, InvalidArgumentTypeError  # noqa: E402
from shardkit.precompute_eagle3 import default_aux_layer_ids, load_data, precompute, tokenize  # noqa: E402

from _procs import TIMEOUT, child_env, run_child, snapshot  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _eagle3_child as child  # noqa: E402

SEQ, AUX, VD = child.SEQ, [1, 3, 4], 12
TORCH_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def reference_vocab(rows, tok, v):
    """NeMo's draft vocabulary, written out: specials, then supervised tokens by count
    (ties by id), then the remaining ids."""
    counts = collections.Counter(t for r in rows for t, m in zip(r["input_ids"], r["loss_mask"]) if m)
    out = []
    for t in (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.unk_token_id):
        if t is not None and t not in out:
            out.append(t)
    out += [t for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])) if t not in out]
    out += [t for t in range(v) if t not in out]
    return out[:VD]


def reference(dtype, topk):
    """The cache's items computed directly (dict of arrays, samples stacked), in the producer's
    batches of 2 (kernels may depend on the batch size)."""
    model, tok = child.model(), child.tokenizer(child.GENERATION)
    samples = child.samples()
    encs = [tok.apply_chat_template(s["messages"], tokenize=True, return_dict=True, return_assistant_tokens_mask=True,
                                    padding="max_length", truncation=True, max_length=SEQ) for s in samples]
    ids = torch.tensor([e["input_ids"] for e in encs])
    att = torch.tensor([e["attention_mask"] for e in encs])
    loss = torch.tensor([e["assistant_masks"] for e in encs]) * att
    rows = [{"input_ids": i, "loss_mask": m} for i, m in zip(ids.tolist(), loss.tolist())]
    sel = reference_vocab(rows, tok, model.config.vocab_size)
    with torch.no_grad():
        runs = [model(input_ids=ids[a:a + 2], attention_mask=att[a:a + 2], output_hidden_states=True)
                for a in range(0, len(samples), 2)]
    aux = torch.cat([torch.cat([r.hidden_states[i + 1] for i in AUX], -1) for r in runs])
    logits = torch.cat([r.logits for r in runs])
    n = len(samples)
    # Position t holds the target of the prediction made at t + 1 (ids, loss mask too); the
    # last position's target is the softmax of zero logits: uniform.
    nxt = logits[:, 1:]
    probs = torch.cat([torch.softmax(nxt[..., sel].float(), -1), torch.full((n, 1, VD), 1.0 / VD)], 1)
    sel_mask = torch.zeros(model.config.vocab_size, dtype=torch.bool)
    sel_mask[sel] = True
    pos = torch.zeros(n, SEQ, 1, dtype=torch.bool)
    pos[:, :-1, 0] = sel_mask[nxt.argmax(-1)] & loss[:, 1:].bool()
    td = TORCH_DTYPES[dtype]
    if topk:
        values, idx = torch.topk(probs, topk, -1)
        probs = torch.zeros_like(probs).scatter(-1, idx, (values / values.sum(-1, keepdim=True)).to(td).float())
    zero = torch.zeros(n, 1, dtype=torch.long)
    want = {
        "input_ids": torch.cat([ids[:, 1:], zero], 1).numpy(),
        "attention_mask": att.numpy(),
        "loss_mask": torch.cat([loss[:, 1:], zero], 1).numpy(),
        "aux_hidden_states": aux.to(td).float().numpy(),
        "position_mask": pos.numpy(),
        "target_probs": probs.to(td).float().numpy(),
    }
    return want, sel, model.model.embed_tokens.weight.detach().numpy()


def stored(path):
    c = eagle3.open(path)
    got = eagle3.collate([c[i] for i in range(len(c))])
    return {k: (v.astype(np.float32) if v.dtype.kind == "V" or v.dtype.name == "bfloat16" else v) for k, v in got.items()}, c


@pytest.mark.parametrize("dtype, topk", [("fp32", 0), ("bf16", 0), ("fp32", 5), ("bf16", 5)])
def test_the_cache_equals_the_reference_computation(tmp_path, dtype, topk):
    out = str(tmp_path / "cache")
    st = child.produce(out, dtype=dtype, target_probs_topk=topk)
    assert st["committed"]
    want, sel, emb = reference(dtype, topk)
    got, cache = stored(out)
    assert set(got) == set(want)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    m = cache.manifest
    assert m["selected_token_ids"] == sel and m["aux_layer_ids"] == AUX and m["aux_hidden_dim"] == 48
    assert (m["format_version"], m["target_probs_topk"], m["dtype"], m["num_samples"]) == (2, topk, dtype, 11)
    assert (m["target_model"], m["input_data"], m["split"], m["shuffle_seed"]) == ("tiny-llama", "seeded", None, 42)
    np.testing.assert_array_equal(cache.target_embeddings(), emb)
    report = eagle3.validate(out, deep=True)
    assert report["valid"], report["errors"]
    from safetensors import safe_open

    with safe_open(os.path.join(out, "shard-000000.safetensors"), "np") as f:
        names = set(f.keys())
    assert ("target_probs_values" in names and "target_probs_indices" in names) == bool(topk)
    assert ("target_probs" in names) == (not topk)
    # A top-k cache notes, shard by shard, what its top k kept of the draft distribution at the
    # supervised positions (before renormalising); a lossless one notes nothing.
    from shardkit.precompute_eagle3 import retained_mass

    kept = retained_mass(out)
    summary = eagle3.inspect(out)["topk_retained"]
    if not topk:
        assert kept == {"shards": [], "positions": 0} and summary is None
        return
    full, _, _ = reference("fp32", 0)
    mass = np.sort(full["target_probs"], -1)[..., -topk:].sum(-1)
    supervised = full["loss_mask"].astype(bool)
    assert [x["shard"] for x in kept["shards"]] == [0, 1, 2]  # 11 samples in shards of 4
    for x in kept["shards"]:
        rows = slice(4 * x["shard"], 4 * x["shard"] + 4)
        m = mass[rows][supervised[rows]]
        assert x["topk"] == topk and x["positions"] == m.size
        np.testing.assert_allclose([x["mean"], x["min"], x["kl_mean"]], [m.mean(), m.min(), -np.log(m).mean()],
                                   rtol=1e-5)
    assert kept["positions"] == supervised.sum() and 0 < kept["min"] <= kept["mean"] < 1
    # inspect merges the same notes: the smallest mass, position-weighted mean mass and KL.
    assert (summary["shards"], summary["positions"]) == (3, kept["positions"])
    np.testing.assert_allclose([summary["min"], summary["mean"], summary["kl_mean"]],
                               [mass[supervised].min(), mass[supervised].mean(), -np.log(mass[supervised]).mean()],
                               rtol=1e-5)


def test_templates_with_and_without_generation_marks_and_pre_tokenized_samples_give_the_same_bytes(tmp_path):
    plain, marked, pre = (str(tmp_path / n) for n in ("plain", "marked", "pre"))
    child.produce(plain)
    model = child.model()
    precompute(model, child.tokenizer(child.GENERATION), child.samples(), marked, progress=False, **child.KW)
    tok = child.tokenizer()
    rows = [tokenize(s, tok, SEQ) for s in child.samples()]
    # Pre-tokenized samples need no template; the special tokens still come from the tokenizer.
    short = [{"input_ids": r["input_ids"][:sum(r["attention_mask"])], "loss_mask": r["loss_mask"][:sum(r["attention_mask"])]}
             for r in rows]
    precompute(model, tok, short, pre, progress=False, **child.KW)

    def cache(path):  # the provenance record differs (another template, other samples), and
        # so does the checksum sidecar, which covers it
        return {k: v for k, v in snapshot(path).items() if k not in (provenance.FILE, "shardkit.checksums.json")}

    assert cache(plain) == cache(marked) == cache(pre)
    recs = [provenance.read(p) for p in (plain, marked, pre)]
    assert recs[0]["model"] == recs[1]["model"] == recs[2]["model"]
    assert recs[0]["processor"] != recs[1]["processor"] and recs[0]["inputs"] == recs[1]["inputs"]
    assert recs[2]["inputs"] != recs[0]["inputs"]


def test_a_pad_id_of_0_is_the_eos_id_for_the_attention_mask_as_in_nemo(tmp_path):
    tok = child.tokenizer()
    tok.pad_token = "<unk>"  # id 0: NeMo's `_add_pad_token(...) or eos_token_id` takes the eos id
    row = tokenize(child.samples()[0], tok, SEQ)
    assert row["input_ids"][-1] == 0 and row["attention_mask"] == [1] * SEQ and row["loss_mask"][-1] == 0


def test_ranks_and_a_killed_run_resumed_with_another_world_size_give_one_process_bytes(tmp_path):
    script = os.path.join(HERE, "_eagle3_child.py")
    one = str(tmp_path / "one")
    child.produce(one)
    want = snapshot(one)
    # Two ranks at the same time, each a process with the launcher's variables.
    two = str(tmp_path / "two")
    procs = [subprocess.Popen([sys.executable, script, two], env=child_env(RANK=r, WORLD_SIZE=2),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    outs = [p.communicate(timeout=TIMEOUT) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [e for _, e in outs]
    assert sum('"committed": true' in o for o, _ in outs) == 1
    assert snapshot(two) == want
    # One process killed once its third batch is written (shard 0 durable, shard 1 half),
    # then two ranks finish.
    again = str(tmp_path / "again")
    killed, _ = run_child([sys.executable, script, again], kill_at="batch 3")
    assert killed
    st = eagle3.status(again)
    assert st["done"] >= 1 and not st["committed"]
    for r in range(2):
        child.produce(again, rank=r, world_size=2)
    assert snapshot(again) == want


def test_the_entry_point_gives_the_functions_bytes(tmp_path):
    mdir, data = str(tmp_path / "model"), str(tmp_path / "data.jsonl")
    child.model().save_pretrained(mdir)
    child.tokenizer().save_pretrained(mdir)
    with open(data, "w") as f:
        for s in child.samples():
            f.write(json.dumps(s) + "\n")
    cli, fn = str(tmp_path / "cli"), str(tmp_path / "fn")
    _, lines = run_child([sys.executable, "-m", "shardkit.precompute_eagle3", "--model", mdir, "--data", data,
                          "--out", cli, "--seq-length", str(SEQ), "--draft-vocab-size", "12", "--batch-size", "2",
                          "--shard-size", "4", "--dtype", "fp32", "--split", "train[1:]", "--no-progress"],
                         OMP_NUM_THREADS=1)
    assert json.loads(lines[-1])["committed"]
    rows = load_data(data, split="train[1:]")  # NeMo's order: shuffled with seed 42, then sliced
    assert len(rows) == 10 and rows != child.samples()[1:]
    kw = {**child.KW, "dtype": "fp32", "buffers": 4}
    kw.update(target_model=mdir, input_data=data)
    precompute(child.model(), child.tokenizer(), rows, fn, split="train[1:]", progress=False, **kw)
    assert snapshot(cli) == snapshot(fn)


def test_a_failed_write_is_raised_and_a_resume_with_another_configuration_is_refused(tmp_path, monkeypatch):
    out = str(tmp_path / "c")

    def fail(done, total, nbytes):
        if done >= 6:
            raise OSError("disk full (simulated)")

    with pytest.raises(OSError, match="disk full"):
        precompute(child.model(), child.tokenizer(), child.samples(), out, progress=fail, **child.KW)
    st = eagle3.status(out)
    assert not st["committed"] and st["done"] >= 1
    with pytest.raises(Exception, match="seq_length"):
        precompute(child.model(), child.tokenizer(), child.samples(), out, progress=False, **{**child.KW, "seq_length": 20})
    # Another model under the same name, or another sample list: refused naming what changed.
    other = child.model()
    with torch.no_grad():
        next(other.parameters()).add_(1e-3)
    with pytest.raises(AlreadyExistsError, match=r"provenance model\.sha256 differs"):
        precompute(other, child.tokenizer(), child.samples(), out, progress=False, **child.KW)
    with pytest.raises(AlreadyExistsError, match=r"provenance inputs\.sha256 differs"):
        precompute(child.model(), child.tokenizer(), child.samples()[::-1], out, progress=False, **child.KW)
    # The restart takes the draft vocabulary the first run noted: no pass over the samples.
    import shardkit.precompute_eagle3 as pe

    def no_pass(*a, **k):
        raise AssertionError("the draft vocabulary was computed again")

    monkeypatch.setattr(pe, "draft_vocab", no_pass)
    precompute(child.model(), child.tokenizer(), child.samples(), out, progress=False, **child.KW)
    monkeypatch.undo()
    one = str(tmp_path / "one")
    child.produce(one)
    assert snapshot(out) == snapshot(one)


def test_bad_inputs_are_clear_errors_and_write_nothing(tmp_path):
    model, tok, samples = child.model(), child.tokenizer(), child.samples()
    out = str(tmp_path / "c")

    def run(**kw):
        precompute(model, tok, samples, out, progress=False, **{**child.KW, **kw})

    with pytest.raises(InvalidArgumentError, match=r"shard_size \(5\) must be a multiple of batch_size \(2\)"):
        run(shard_size=5)
    with pytest.raises(InvalidArgumentError, match=r"aux layer 8 is not a layer of the target \(8 layers: 0\.\.7\)"):
        run(aux_layer_ids=[1, 3, 8])
    with pytest.raises(InvalidArgumentError, match="exactly 3 layers"):
        run(aux_layer_ids=[1, 3])
    with pytest.raises(InvalidArgumentError, match="distinct"):
        run(aux_layer_ids=[1, 1, 3])
    with pytest.raises(InvalidArgumentError, match=r"too shallow for the default EAGLE-3 aux layers \[1, 2, 2\]"):
        default_aux_layer_ids(6)
    with pytest.raises(InvalidArgumentError, match="target_probs_topk needs format_version 2"):
        run(format_version=1, target_probs_topk=3)
    with pytest.raises(InvalidArgumentError, match="dtype must be one of"):
        run(dtype="fp8")
    with pytest.raises(InvalidArgumentTypeError, match="unexpected keyword argument 'draft_vocab'.*draft_vocab_size"):
        run(draft_vocab=8)
    with pytest.raises(InvalidArgumentError, match="without an assistant message"):
        precompute(model, tok, [{"messages": [{"role": "user", "content": "hello"}]}], out, progress=False, **child.KW)
    with pytest.raises(InvalidArgumentError, match="needs `loss_mask`"):
        precompute(model, tok, [{"input_ids": [1, 2]}], out, progress=False,
                   **{**child.KW, "draft_vocab_size": None})
    bare = child.tokenizer()
    bare.chat_template = None
    with pytest.raises(InvalidArgumentError, match="no chat template"):
        precompute(model, bare, samples, out, progress=False, **child.KW)
    assert not os.path.exists(out) or not [f for f in os.listdir(out) if f.startswith("shard-")]
    # A sample longer than seq_length is truncated, as NeMo truncates it (no error).
    assert len(tokenize(samples[-1], tok, SEQ)["input_ids"]) == SEQ


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="no CUDA device on this machine: the pinned-buffer, side-stream path runs where a GPU is lent")
def test_on_cuda_the_cache_is_the_cpu_caches_values_and_one_buffer_is_reused_safely(tmp_path):
    cpu, gpu = str(tmp_path / "cpu"), str(tmp_path / "gpu")
    precompute(child.model(), child.tokenizer(), child.samples(), cpu, progress=False,
               **{**child.KW, "dtype": "fp32"})
    precompute(child.model().cuda(), child.tokenizer(), child.samples(), gpu, progress=False,
               **{**child.KW, "dtype": "fp32", "buffers": 1})
    (want, _), (got, _) = stored(cpu), stored(gpu)
    # Lossless: a top k could pick another column on a near tie under other kernels.
    for k in want:  # other kernels: equal to float32 rounding; the integer fields exactly
        if want[k].dtype.kind == "f":
            np.testing.assert_allclose(got[k], want[k], rtol=1e-4, atol=1e-5, err_msg=k)
        else:
            np.testing.assert_array_equal(got[k], want[k], err_msg=k)
