"""The activation recorder (shardkit.record): recorded rows equal the recorded modules' outputs
computed directly (tiny random models built from configs, fixed seeds: Hugging Face ViT, CLIP
vision, DINOv2 with registers, SigLIP vision), in the dataset's layer-slot order; several
processes give the bytes one process gives; a killed recording resumes with another world size;
bad module names, wrong token counts and background write failures are clear errors."""

import json
import os
import sys
import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from shardkit import saev  # noqa: E402
from shardkit.errors import InvalidArgumentError  # noqa: E402
from shardkit.record import ActivationRecorder, find_blocks  # noqa: E402

from _procs import run_child, snapshot  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _record_child as child  # noqa: E402

TINY = dict(hidden_size=16, num_hidden_layers=3, num_attention_heads=2, intermediate_size=32,
            image_size=16, patch_size=4)  # 16 patches


def built(kind):
    torch.manual_seed(0)
    t = transformers
    if kind == "vit":
        return t.ViTModel(t.ViTConfig(**TINY)).eval()
    if kind == "clip":
        return t.CLIPVisionModel(t.CLIPVisionConfig(**TINY)).eval()
    if kind == "dinov2-registers":
        return t.Dinov2WithRegistersModel(t.Dinov2WithRegistersConfig(num_register_tokens=4, **TINY)).eval()
    if kind == "siglip":
        return t.SiglipVisionModel(t.SiglipVisionConfig(**TINY)).eval()
    raise ValueError(kind)


def acts(path):
    """The dataset's activations as one (n, L, T, D) array, from its shard files."""
    ds = saev.open(path)
    md = ds.metadata
    shape = (len(md["layers"]), ds.tokens_per_example, md["d_model"])
    files = sorted(f for f in os.listdir(path) if f.startswith("acts"))
    out = np.concatenate([np.fromfile(os.path.join(path, f), dtype=np.float32).reshape(-1, *shape) for f in files])
    return out[: md["n_examples"]]


def record(model, root, x, batch=3, **kw):
    with ActivationRecorder(model, root, n_examples=len(x), metadata={"family": "clip", "ckpt": "tiny"}, **kw) as rec:
        for first, end in rec.pending:
            for at in range(first, end, batch):
                rec(x[at:min(at + batch, end)])
    return rec


@pytest.mark.parametrize("kind, cls, prefix", [
    ("vit", True, 1), ("clip", True, 1), ("dinov2-registers", True, 5), ("siglip", False, 0),
])
def test_recorded_rows_are_the_blocks_outputs_in_the_labels_slots(tmp_path, kind, cls, prefix):
    model = built(kind)
    x = torch.randn(7, 3, 16, 16, generator=torch.Generator().manual_seed(3))
    kw = {} if cls else {"cls_token": False}
    rec = record(model, str(tmp_path), x, layers=[2, -3], **kw)  # slot 0: the last block, run last
    got = acts(rec.path)
    # [i + 1]: block i's output; computed in the recorder's batches (kernels differ by batch size).
    with torch.no_grad():
        runs = [model(x[at:at + 3], output_hidden_states=True).hidden_states for at in range(0, 7, 3)]
    hidden = [torch.cat(h) for h in zip(*runs)]
    assert got.shape == (7, 2, 16 + int(cls), 16)
    for slot, block in enumerate([2, 0]):
        h = hidden[block + 1].detach().numpy()
        content = h[:, prefix:prefix + 16]
        if cls:
            np.testing.assert_array_equal(got[:, slot, 0], h[:, 0])  # CLS
        np.testing.assert_array_equal(got[:, slot, int(cls):], content)  # registers left out
    md = saev.open(rec.path).metadata
    assert md["layers"] == [2, -3] and md["cls_token"] == cls and md["content_tokens_per_example"] == 16


def test_inputs_and_named_modules_are_recorded(tmp_path):
    model = built("vit")
    x = torch.randn(5, 3, 16, 16, generator=torch.Generator().manual_seed(4))
    path, blocks = find_blocks(model)
    # Block 1's input is block 0's output.
    rec = record(model, str(tmp_path / "in"), x, layers=[1], capture="input")
    out0 = record(model, str(tmp_path / "out"), x, layers=[7], modules=[f"{path}.0"])
    np.testing.assert_array_equal(acts(rec.path), acts(out0.path))
    assert out0.modules == [f"{path}.0"] and len(blocks) == 3


def test_a_module_name_that_does_not_exist_names_the_closest(tmp_path):
    model = built("vit")
    with pytest.raises(InvalidArgumentError, match=r"no module 'layers\.9\.atention'.*closest: layers\.[0-2]\.attention"):
        ActivationRecorder(model, str(tmp_path), layers=[0], modules=["layers.9.atention"], n_examples=1,
                           metadata={"family": "clip", "ckpt": "x"})
    with pytest.raises(InvalidArgumentError, match=r"layer 5 is not a block of ViTModel \(3 blocks at layers\)"):
        ActivationRecorder(model, str(tmp_path), layers=[5], n_examples=1, metadata={"family": "clip", "ckpt": "x"})
    assert not os.listdir(tmp_path)  # nothing written


def test_a_wrong_token_count_or_a_module_that_did_not_run_is_an_error_and_nothing_is_recorded(tmp_path):
    model = built("vit")
    x = torch.randn(2, 3, 16, 16)
    with pytest.raises(InvalidArgumentError, match=r"emits 17 tokens of 16 dimensions; the dataset records 1 prefix \+ 20"):
        a = ActivationRecorder(model, str(tmp_path / "a"), layers=[0], n_examples=2, content_tokens=20,
                               metadata={"family": "clip", "ckpt": "x"})
        with a:
            a(x)
    # A module the forward never runs.
    class WithUnused(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.vit, self.unused = model, torch.nn.Linear(16, 16)

        def forward(self, x):
            return self.vit(x)

    with pytest.raises(InvalidArgumentError, match=r"did not run the recorded module\(s\) unused; nothing"):
        with ActivationRecorder(WithUnused(), str(tmp_path / "b"), layers=[0, 1], modules=["vit.layers.0", "unused"],
                                n_examples=2, content_tokens=16, d_model=16, metadata={"family": "clip", "ckpt": "x"}) as rec:
            rec(x)
    st = saev.status(a.path)
    assert st["done"] == 0 and not st["committed"]


def test_a_failed_background_write_is_raised_and_the_part_stays_resumable(tmp_path):
    model = built("vit")
    x = torch.randn(4, 3, 16, 16)
    rec = ActivationRecorder(model, str(tmp_path), layers=[0], n_examples=4, metadata={"family": "clip", "ckpt": "x"})
    rec(x[:2], labels=np.zeros((2, 3), np.uint8))  # labels of the wrong width: refused by the writer thread
    with pytest.raises(InvalidArgumentError, match=r"labels.*\(batch, content tokens\)"):
        rec.close()
    assert saev.status(rec.path)["committed"] is False


def test_the_model_waits_when_every_buffer_is_being_written(tmp_path, monkeypatch):
    model = built("vit")
    x = torch.randn(3, 3, 16, 16)
    rec = ActivationRecorder(model, str(tmp_path), layers=[0], n_examples=3, buffers=1,
                             metadata={"family": "clip", "ckpt": "x"})
    release, writing = threading.Event(), threading.Event()
    real = rec._writer.write

    def slow(a, labels=None):
        writing.set()
        release.wait(30)
        real(a, labels)

    monkeypatch.setattr(rec._writer, "write", slow)
    rec(x[:1])
    assert writing.wait(30)
    second = threading.Thread(target=rec, args=(x[1:2],))
    second.start()
    second.join(0.5)
    assert second.is_alive()  # one buffer, being written: the second forward waits for it
    release.set()
    second.join(30)
    assert not second.is_alive()
    rec(x[2:])
    assert rec.close()["committed"]


def test_ranks_record_the_bytes_one_process_records_and_a_killed_run_resumes_with_another_world_size(tmp_path):
    script = os.path.join(HERE, "_record_child.py")
    one = str(tmp_path / "one")
    run_child([sys.executable, script, one])
    want = snapshot(one)
    assert any(k.endswith("shards.json") for k in want)
    # Three ranks.
    three = str(tmp_path / "three")
    procs = [run_child([sys.executable, script, three], RANK=r, WORLD_SIZE=3) for r in range(3)]
    assert any('"committed": true' in " ".join(lines) for _, lines in procs)
    assert snapshot(three) == want
    # One process killed after its fifth batch, then two ranks finish.
    again = str(tmp_path / "again")
    killed, _ = run_child([sys.executable, script, again], kill_at="batch 5")
    assert killed
    for r in range(2):
        run_child([sys.executable, script, again], RANK=r, WORLD_SIZE=2)
    assert snapshot(again) == want


def test_batches_start_at_shard_starts_and_never_cross_a_shard(tmp_path):
    model = built("vit")  # 17 tokens x 2 layers: 34 per example
    md = {"family": "clip", "ckpt": "x", "max_tokens_per_shard": 34 * 5}  # 5 examples a shard
    rec = ActivationRecorder(model, str(tmp_path), layers=[0, 1], n_examples=12, metadata=md, rank=1, world_size=2)
    assert rec.pending == [(10, 12)]  # 3 shards: rank 1 of 2 has the last
    with pytest.raises(InvalidArgumentError, match=r"a batch of 3 examples from example 10 runs past"):
        rec(torch.randn(3, 3, 16, 16))
    rec.abort()
    rec = ActivationRecorder(model, str(tmp_path / "one"), layers=[0, 1], n_examples=12, metadata=md)
    assert rec.batches(2) == [(0, 2), (2, 4), (4, 5), (5, 7), (7, 9), (9, 10), (10, 12)]
    assert rec.batches(100) == [(0, 5), (5, 10), (10, 12)]
    with pytest.raises(InvalidArgumentError, match="batch_size"):
        rec.batches(0)
    rec.abort()


def test_a_restart_with_another_model_processor_or_input_order_is_refused_naming_what_changed(tmp_path):
    from shardkit import provenance
    from shardkit.errors import AlreadyExistsError

    model = built("vit")
    x = torch.randn(4, 3, 16, 16)
    md = {"family": "clip", "ckpt": "tiny"}
    class Processor:  # an image processor's face (transformers' needs torchvision and PIL)
        def __init__(self, **config):
            self.config = config

        def to_json_string(self):
            return json.dumps(self.config, sort_keys=True)

    processor = Processor(size=16, do_normalize=True)
    kw = dict(layers=[0], n_examples=4, metadata=md, processor=processor, inputs=["a.jpg", "b.jpg", "c.jpg", "d.jpg"])
    with ActivationRecorder(model, str(tmp_path), **kw) as rec:
        rec(x[:2])
        rec.abort()  # killed halfway: two examples durable at most
    first = provenance.read(rec.path)
    assert first["model"]["parameters"] == sum(t.numel() for t in model.state_dict().values())
    assert first["processor"]["kind"] == "Processor" and first["inputs"]["count"] == 4
    assert first["recorder"]["modules"] == ["layers.0"]
    before = snapshot(rec.path)
    # The checkpoint changed under the same name: refused before anything is written.
    changed = built("vit")
    with torch.no_grad():
        next(changed.layers[1].parameters()).add_(1e-3)
    with pytest.raises(AlreadyExistsError, match=r"provenance model\.sha256 differs"):
        ActivationRecorder(changed, str(tmp_path), **kw)
    other = dict(kw, inputs=["b.jpg", "a.jpg", "c.jpg", "d.jpg"],
                 processor=Processor(size=16, do_normalize=False))
    with pytest.raises(AlreadyExistsError, match=r"provenance inputs\.sha256, processor\.sha256 differ"):
        ActivationRecorder(model, str(tmp_path), **other)
    assert {k: v for k, v in snapshot(rec.path).items() if ".shardkit-parts" not in k} == \
        {k: v for k, v in before.items() if ".shardkit-parts" not in k}
    # The same source resumes, finishes, and inspect shows the record.
    with ActivationRecorder(model, str(tmp_path), **kw) as rec:
        for first_, end in rec.batches(4):
            rec(x[first_:end])
    assert saev.inspect(rec.path)["provenance"] == first


def test_the_entry_point_records_a_folder_of_images_and_a_pixels_file(tmp_path):
    from PIL import Image

    model = built("vit")
    model.save_pretrained(tmp_path / "model")
    (tmp_path / "model" / "preprocessor_config.json").write_text(json.dumps(
        {"size": {"height": 16, "width": 16}, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.25, 0.25, 0.25]}))
    rng = np.random.default_rng(5)
    (tmp_path / "images" / "b").mkdir(parents=True)
    for i in range(5):
        px = rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)
        Image.fromarray(px).save(tmp_path / "images" / ("b" if i % 2 else "") / f"{i}.png")
    args = ["--model", str(tmp_path / "model"), "--layers", "0", "2", "--family", "clip", "--ckpt", "tiny",
            "--batch-size", "2", "--device", "cpu"]
    r = run_child([sys.executable, "-m", "shardkit.record", *args, "--images", str(tmp_path / "images"),
                   "--out", str(tmp_path / "from-images")])
    status = json.loads(r[1][-1])
    assert status["committed"] is True
    # The same pixels, preprocessed here (16 px already: no resize, no crop), as a .npy.
    files = sorted(["0.png", "2.png", "4.png", "b/1.png", "b/3.png"])
    px = np.stack([np.asarray(Image.open(tmp_path / "images" / f).convert("RGB"), np.float32).transpose(2, 0, 1)
                   for f in files]) / 255.0
    px = ((px - 0.5) / 0.25).astype(np.float32)
    np.save(tmp_path / "px.npy", px)
    r = run_child([sys.executable, "-m", "shardkit.record", *args, "--pixels", str(tmp_path / "px.npy"),
                   "--out", str(tmp_path / "from-pixels")])
    other = json.loads(r[1][-1])
    a, b = acts(status["path"]), acts(other["path"])
    np.testing.assert_array_equal(a, b)
    with torch.no_grad():
        runs = [model(torch.from_numpy(px[i:i + 2]), output_hidden_states=True).hidden_states for i in range(0, 5, 2)]
    hidden = [torch.cat(h) for h in zip(*runs)]
    # Computed in this process, whose torch may use another thread count than the child's
    # (kernels then sum in another order): equal to float32 rounding.
    np.testing.assert_allclose(a[:, 1], hidden[3].numpy(), rtol=1e-5, atol=1e-6)
    from shardkit import provenance
    assert provenance.read(status["path"])["inputs"]["count"] == 5


def tiny_llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=16, num_hidden_layers=3, num_attention_heads=2,
                                   num_key_value_heads=2, intermediate_size=32, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(cfg).eval()


def test_a_language_models_windows_are_recorded_with_their_token_ids_beside(tmp_path):
    from shardkit.record import TextRecorder, token_ids

    model = tiny_llama()
    ids = torch.randint(0, 64, (7, 8), generator=torch.Generator().manual_seed(1))
    md = {"max_tokens_per_shard": 16 * 3, "ckpt": "tiny-llama", "data": "windows", "dataset": "seeded"}
    with TextRecorder(model, str(tmp_path), layers=[1, 0], n_examples=7, context=8, metadata=md) as rec:
        for first, end in rec.batches(2):
            rec(ids[first:end])
    status = rec.close()
    assert status["committed"] and status["token_ids"]["committed"]
    loaded = saev.open(rec.path).metadata
    assert loaded["family"] == "llama" and loaded["shardkit_dialect"] == "text" and loaded["cls_token"] is False
    got = acts(rec.path)
    with torch.no_grad():  # hidden_states[i + 1] is block i's output for every block but the last
        runs = [model(ids[f:e], output_hidden_states=True).hidden_states for f, e in rec.batches(2)]
    hidden = [torch.cat(h) for h in zip(*runs)]
    for slot, block in enumerate([1, 0]):
        np.testing.assert_array_equal(got[:, slot], hidden[block + 1].numpy())
    split = token_ids(rec.path)
    assert len(split) == 7 and all(list(split[e]) == ids[e].tolist() for e in range(7))
    report = saev.validate(rec.path)
    assert report["valid"] and any("text dialect" in n["message"] for n in report["notes"])
    assert saev.inspect(rec.path)["dialect"] == "text" and saev.inspect(rec.path)["saev_loads"] is False
    # shardkit's loaders read it as any saev dataset: one row a token.
    rows = sum(len(b["example_idx"]) for b in saev.Loader(rec.path, layer=0, batch_size=16, seed=3))
    assert rows == 7 * 8


def test_text_windows_must_be_full_and_in_order(tmp_path):
    from shardkit.record import TextRecorder

    model = tiny_llama()
    ids = torch.randint(0, 64, (4, 8))
    rec = TextRecorder(model, str(tmp_path), layers=[0], n_examples=4, context=8)
    with pytest.raises(InvalidArgumentError, match=r"input_ids must be \(batch, 8\) windows"):
        rec(ids[:, :5])
    with pytest.raises(InvalidArgumentError, match="attention_mask has zeros"):
        rec(ids[:2], attention_mask=torch.tensor([[1] * 8, [1] * 6 + [0] * 2]))
    with pytest.raises(InvalidArgumentError, match="runs past this rank's pending windows"):
        rec(torch.randint(0, 64, (5, 8)))
    rec(ids[:2], attention_mask=torch.ones(2, 8, dtype=torch.long))
    rec(ids[2:])
    assert rec.close()["committed"]


def test_a_killed_text_recording_resumes_its_ids_and_activations(tmp_path):
    from shardkit.record import TextRecorder, token_ids

    model = tiny_llama()
    ids = torch.randint(0, 64, (9, 8), generator=torch.Generator().manual_seed(2))
    md = {"max_tokens_per_shard": 8 * 3, "ckpt": "tiny-llama", "data": "w", "dataset": "s"}  # 3 windows a shard

    def run(root, stop=None, **kw):
        rec = TextRecorder(model, root, layers=[0], n_examples=9, context=8, metadata=md, **kw)
        for i, (first, end) in enumerate(rec.batches(3)):
            if i == stop:
                rec.abort()
                return rec
            rec(ids[first:end])
        rec.close()
        return rec

    one = run(str(tmp_path / "one"))
    cut = run(str(tmp_path / "cut"), stop=2)  # shards 0 and 1 durable, then killed
    for r in range(2):
        run(str(tmp_path / "cut"), rank=r, world_size=2)
    assert snapshot(one.path) == snapshot(cut.path)
    assert list(token_ids(cut.path)[8]) == ids[8].tolist()


def test_transformer_lens_style_hook_points_are_recorded_by_name(tmp_path):
    """TransformerLens names its hook points as modules (`blocks.1.hook_resid_post`, identity
    modules the residual stream runs through): a tiny model built the same way."""

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp = torch.nn.Linear(8, 8)
            self.hook_resid_post = torch.nn.Identity()

        def forward(self, x):
            return self.hook_resid_post(x + self.mlp(x))

    class Lens(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Linear(3, 8)
            self.blocks = torch.nn.ModuleList(Block() for _ in range(3))

        def forward(self, x):
            h = self.embed(x)
            for b in self.blocks:
                h = b(h)
            return h

    torch.manual_seed(0)
    model = Lens().eval()
    assert find_blocks(model)[0] == "blocks"
    x = torch.randn(4, 5, 3)  # 4 examples of 5 tokens
    rec = record(model, str(tmp_path), x, layers=[1], modules=["blocks.1.hook_resid_post"], cls_token=False,
                 content_tokens=5, d_model=8, batch=4)
    with torch.no_grad():
        want = model.blocks[1](model.blocks[0](model.embed(x)))
    np.testing.assert_array_equal(acts(rec.path)[:, 0], want.numpy())


def test_the_entry_point_records_a_language_model_over_windows_of_a_corpus(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    from shardkit.record import token_ids

    model = tiny_llama()
    model.model.save_pretrained(tmp_path / "model")  # the base model: its blocks, no head
    words = ["<s>", "</s>"] + [f"w{i}" for i in range(62)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(tmp_path / "model")
    rng = np.random.default_rng(7)
    docs = [" ".join(f"w{int(i)}" for i in rng.integers(0, 62, rng.integers(3, 20))) for _ in range(12)]
    (tmp_path / "corpus.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    r = run_child([sys.executable, "-m", "shardkit.record", "--model", str(tmp_path / "model"), "--text",
                   str(tmp_path / "corpus.jsonl"), "--context", "8", "--layers", "0", "1", "--batch-size", "3",
                   "--device", "cpu", "--out", str(tmp_path / "out")])
    status = json.loads(r[1][-1])
    assert status["committed"] and status["token_ids"]["committed"]
    # The windows: every document's ids (as the tokenizer gives them) then EOS, concatenated.
    stream = [t for d in docs for t in fast(d)["input_ids"] + [fast.eos_token_id]]
    n = len(stream) // 8
    ids = token_ids(status["path"])
    assert len(ids) == n and [t for e in range(n) for t in ids[e]] == stream[: n * 8]
    md = saev.open(status["path"]).metadata
    assert md["family"] == "llama" and md["content_tokens_per_example"] == 8 and md["n_examples"] == n
    got = acts(status["path"])
    windows = torch.tensor(stream[: n * 8]).reshape(n, 8)
    with torch.no_grad():  # in the recorder's batches, as this process computes them
        hidden = [torch.cat(h) for h in zip(*[model.model(windows[b:b + 3], output_hidden_states=True).hidden_states
                                             for b in range(0, n, 3)])]
    np.testing.assert_allclose(got[:, 0], hidden[1].numpy(), rtol=1e-5, atol=1e-6)


def test_progress_reports_each_written_batch_against_what_the_run_owes(tmp_path):
    model = built("vit")
    x = torch.randn(7, 3, 16, 16)
    calls = []
    record(model, str(tmp_path), x, batch=3, layers=[0], progress=lambda done, total: calls.append((done, total)))
    assert calls == [(3, 7), (6, 7), (7, 7)]


def test_patch_labels_are_recorded_into_labels_bin(tmp_path):
    model = built("vit")  # 16 content tokens
    x = torch.randn(5, 3, 16, 16)
    labels = np.arange(5 * 16).reshape(5, 16) % 7
    with ActivationRecorder(model, str(tmp_path), layers=[0], n_examples=5,
                            metadata={"family": "clip", "ckpt": "x", "max_tokens_per_shard": 17 * 2}) as rec:
        for first, end in rec.batches(2):
            rec(x[first:end], labels=torch.from_numpy(labels[first:end]))
    stored = np.fromfile(os.path.join(rec.path, "labels.bin"), dtype=np.uint8).reshape(5, 16)
    np.testing.assert_array_equal(stored, labels)
    batch = next(iter(saev.Loader(rec.path, layer=0, batch_size=80, order="sequential")))
    np.testing.assert_array_equal(batch["token_label"], labels.reshape(-1))


def test_a_text_batch_owing_part_of_its_windows_to_one_writer_is_refused(tmp_path):
    from shardkit.record import TextRecorder

    model = tiny_llama()
    ids = torch.randint(0, 64, (9, 8), generator=torch.Generator().manual_seed(3))
    md = {"max_tokens_per_shard": 8 * 3, "ckpt": "tiny-llama", "data": "w", "dataset": "s"}  # 3 windows a shard
    rec = TextRecorder(model, str(tmp_path), layers=[0], n_examples=9, context=8, metadata=md)
    rec(ids[0:3])
    rec._ids.append(list(ids[3:6].numpy()))  # killed after shard 1's ids, before its activations
    rec.abort()
    rec = TextRecorder(model, str(tmp_path), layers=[0], n_examples=9, context=8, metadata=md)
    assert rec.pending == [(3, 9)] and rec.batches(3) == [(3, 6), (6, 9)]
    with pytest.raises(InvalidArgumentError, match=r"windows 3\.\.7 are partly owed to the token ids"):
        rec(ids[3:7])
    assert rec(ids[3:6]) is not None  # shard 1: its activations only
    rec(ids[6:9])
    assert rec.close()["token_ids"]["committed"]
    from shardkit.record import token_ids

    assert [list(token_ids(rec.path)[e]) for e in range(9)] == ids.tolist()


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="no CUDA device on this machine: the pinned-buffer, side-stream path runs where a GPU is lent")
def test_on_cuda_rows_are_the_blocks_outputs_through_pinned_buffers_reused(tmp_path):
    model = built("vit").cuda()
    x = torch.randn(11, 3, 16, 16, generator=torch.Generator().manual_seed(9)).cuda()
    # One buffer: every batch reuses the same staging tensors and pinned host buffers, so a
    # copy read before it completed, or a slot reused too early, shows in the rows.
    rec = record(model, str(tmp_path), x, batch=2, layers=[2, 0], buffers=1)
    got = acts(rec.path)
    with torch.no_grad():
        runs = [model(x[a:a + 2], output_hidden_states=True).hidden_states for a in range(0, 11, 2)]
    hidden = [torch.cat(h).cpu() for h in zip(*runs)]
    for slot, block in enumerate([2, 0]):
        np.testing.assert_array_equal(got[:, slot], hidden[block + 1].numpy())
