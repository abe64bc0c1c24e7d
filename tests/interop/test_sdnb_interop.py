"""SameDiff containers (SDNB, shard sets, SDZ) checked without shardkit's own code, as
samediff.md section 9.8 demands (no DL4J at hand):

- the manifest: a clean-room Java program (tests/interop/java, stock OpenJDK) reads shardkit's
  manifests with ObjectInputStream and writes reference manifests with ObjectOutputStream that
  shardkit must parse and re-encode byte for byte; PyPI javaobj-py3 is a second reader;
- the graph region [32, B): Debian's flatc decodes it with crates/shardkit/src/sdnb/samediff.fbs;
- SDZ archives: Python's zipfile (plus a by-hand local-header walk for STORED and alignment),
  `zip -T`, and java.util.zip's ZipFile and ZipInputStream;
- the data: tensors of many dtypes (NaN payloads, bf16 and fp8 bit patterns, the 1 MiB append
  threshold) packed from a safetensors file written here by hand, unpacked, compared byte for byte.

java/javac, flatc and zip/unzip come from Debian packages that scripts/test installs. A missing
tool fails these tests, unless SHARDKIT_ALLOW_MISSING_TOOLS=1 turns that into a skip.
"""

import hashlib
import json
import os
import shutil
import struct
import subprocess
import zipfile
from pathlib import Path

import numpy as np
import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
JAVA_SRC = HERE / "java"
FBS = ROOT / "crates" / "shardkit" / "src" / "sdnb" / "samediff.fbs"
ALIGN = 64

try:
    import javaobj.v2 as javaobj
except ImportError:  # reported by the javaobj fixture
    javaobj = None


def _missing(what, how):
    msg = (f"{what} is not available ({how}); scripts/test installs it. "
           "Set SHARDKIT_ALLOW_MISSING_TOOLS=1 to skip the checks that need it instead.")
    if os.environ.get("SHARDKIT_ALLOW_MISSING_TOOLS") == "1":
        pytest.skip(msg)
    pytest.fail(msg)


def need_tool(cmd, package):
    path = shutil.which(cmd)
    if not path:
        _missing(f"`{cmd}`", f"Debian package {package}")
    return path


# ------------------------------------------------------------------ tools (session fixtures)


@pytest.fixture(scope="session")
def java(tmp_path_factory):
    """Compiles tests/interop/java once per session; returns run(mode, *args) -> JSON lines."""
    javac = need_tool("javac", "openjdk-17-jdk-headless")
    java_bin = need_tool("java", "openjdk-17-jdk-headless")
    classes = tmp_path_factory.mktemp("java-classes")
    sources = sorted(str(p) for p in JAVA_SRC.rglob("*.java"))
    r = subprocess.run([javac, "-encoding", "UTF-8", "-d", str(classes), *sources],
                       capture_output=True, text=True)
    assert r.returncode == 0, f"javac failed:\n{r.stdout}{r.stderr}"

    def run(mode, *args):
        r = subprocess.run([java_bin, "-cp", str(classes), "ManifestCheck", mode, *map(str, args)],
                           capture_output=True, text=True)
        assert r.returncode == 0, f"java ManifestCheck {mode} failed:\n{r.stderr}"
        return [json.loads(line) for line in r.stdout.splitlines() if line]

    return run


@pytest.fixture(scope="session")
def flatc():
    return need_tool("flatc", "flatbuffers-compiler")


@pytest.fixture(scope="session")
def zip_t():
    """`zip -T` (it runs `unzip -tqq` to test the archive)."""
    need_tool("unzip", "unzip")
    z = need_tool("zip", "zip")

    def run(path):
        r = subprocess.run([z, "-T", str(path)], capture_output=True, text=True)
        assert r.returncode == 0 and "OK" in r.stdout, f"zip -T {path}: {r.stdout}{r.stderr}"

    return run


@pytest.fixture(scope="session")
def jobj():
    if javaobj is None:
        _missing("the javaobj-py3 package", "scripts/requirements-test.txt")
    return javaobj


def sk(binary, *args, ok=True):
    r = subprocess.run([binary, *map(str, args)], capture_output=True)
    if ok:
        assert r.returncode == 0, f"shardkit {' '.join(map(str, args))}: {r.stderr.decode()}"
    assert b"panicked" not in r.stderr, r.stderr.decode()
    return r


def inspect(binary, path):
    return json.loads(sk(binary, "sdnb", "inspect", path, "--json").stdout)


# ------------------------------------------------------------------ safetensors, by hand

# safetensors dtype -> (FlatBuffers DType code of samediff.md 3.1, element width)
DTYPES = {
    "BOOL": (1, 1), "F8_E4M3": (2, 1), "F16": (3, 2), "F32": (5, 4), "F64": (6, 8), "I8": (7, 1),
    "I16": (8, 2), "I32": (9, 4), "I64": (10, 8), "U8": (11, 1), "U16": (12, 2), "U32": (13, 4),
    "U64": (14, 8), "BF16": (17, 2),
}


def write_safetensors(path, tensors):
    """name -> (dtype, shape, raw bytes), in order; the format's layout, written by hand."""
    header, off = {}, 0
    for name, (dt, shape, raw) in tensors.items():
        header[name] = {"dtype": dt, "shape": list(shape), "data_offsets": [off, off + len(raw)]}
        off += len(raw)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h)
        for _, _, raw in tensors.values():
            f.write(raw)


def read_safetensors(path):
    data = Path(path).read_bytes()
    (n,) = struct.unpack_from("<Q", data)
    header = json.loads(data[8:8 + n])
    header.pop("__metadata__", None)
    body = data[8 + n:]
    out = {}
    for name, t in header.items():
        a, b = t["data_offsets"]
        assert 0 <= a <= b <= len(body)
        out[name] = (t["dtype"], list(t["shape"]), body[a:b])
    return out


def u(values, dt):
    return np.array(values, dtype=dt).tobytes()


def make_tensors():
    rng = np.random.default_rng(20250415)
    return {
        # NaN payloads (quiet, signalling, negative), -0.0, inf, a denormal: must survive bit for bit
        "f32_nan": ("F32", [2, 4], u([0x7FC00001, 0xFFC00000, 0x7F800001, 0xFFBADBAD, 0x7FFFFFFF,
                                      0x80000000, 0x7F800000, 0x00000001], "<u4")),
        "f64_nan": ("F64", [3], u([0x7FF0000000000001, 0xFFF8DEADBEEF0000, 0x8000000000000000], "<u8")),
        "f16": ("F16", [2, 3], u([0x7C01, 0xFE00, 0x7E55, 0x8000, 0x3C00, 0x0001], "<u2")),
        "bf16": ("BF16", [2, 2], u([0x7FC1, 0xFF81, 0x0001, 0x8000], "<u2")),
        "f8_e4m3": ("F8_E4M3", [4], bytes([0x7F, 0xFF, 0x01, 0x80])),
        "i8": ("I8", [3], u([-128, 0, 127], "<i1")),
        "i16": ("I16", [2], u([-32768, 32767], "<i2")),
        "i32": ("I32", [2], u([-2**31, 2**31 - 1], "<i4")),
        "i64": ("I64", [2], u([-2**63, 2**63 - 1], "<i8")),
        "u16": ("U16", [1], u([0xFFFF], "<u2")),
        "u32": ("U32", [1], u([0xFFFFFFFF], "<u4")),
        "u64": ("U64", [1], u([2**64 - 1], "<u8")),
        "bool": ("BOOL", [5], bytes([0, 1, 1, 0, 1])),
        "scalar": ("F16", [], u([0x3C00], "<u2")),
        "empty": ("I32", [0, 3], b""),
        # appended (>= 1 MiB); the name exercises modified UTF-8 in the manifest
        "enc/wé😀": ("F32", [600, 500], rng.standard_normal(300000).astype("<f4").tobytes()),
        "i64_1mib": ("I64", [131072], rng.integers(-2**62, 2**62, 131072).astype("<i8").tobytes()),
        # one byte under the threshold: inline in the FlatBuffer
        "u8_below": ("U8", [1048575], rng.integers(0, 256, 1048575).astype(np.uint8).tobytes()),
    }


TENSORS = make_tensors()
CONSTANT = "i8"
# Keys whose UTF-16 order differs from their UTF-8 order (U+FF00 vs U+1F600), an empty value
USER_META = {"author": "Zoë 😀", "k\uff00": "fullwidth", "k\U0001f600": "astral", "empty": ""}
FORCED_META = {"nd4j.format.version": "1", "nd4j.format.type": "APPENDED_BLOB"}


class Model:
    """The test model packed every way once per session."""

    def __init__(self, root, binary):
        self.root = root
        self.src = root / "input.safetensors"
        write_safetensors(self.src, TENSORS)
        meta = [a for k, v in USER_META.items() for a in ("--meta", f"{k}={v}")]
        common = ["--from", self.src, *meta, "--constant", CONSTANT]
        self.sdnb = root / "m.sdnb"
        sk(binary, "sdnb", "pack", *common, "--out", self.sdnb)
        self.sharded = root / "s.sdnb"
        sk(binary, "sdnb", "pack", *common, "--out", self.sharded, "--shard-size", "1M")
        self.shards = sorted(root.glob("s.shard*-of-*.sdnb"), key=lambda p: int(p.name[7:].split("-")[0]))
        self.sdz = root / "m.sdz"
        sk(binary, "sdnb", "pack", *common, "--out", self.sdz)
        self.sharded_sdz = root / "ms.sdz"
        sk(binary, "sdnb", "pack", *common, "--out", self.sharded_sdz, "--shard-size", "1M")


@pytest.fixture(scope="session")
def model(tmp_path_factory, shardkit_bin):
    return Model(tmp_path_factory.mktemp("sdnb-model"), shardkit_bin)


# ------------------------------------------------------------------ SDNB layout, independently


def manifest_entries(jobj, data):
    """javaobj-py3's reading of a manifest: [(name, offset, length)], checking the classes."""
    m = jobj.loads(data)
    assert not isinstance(m, list), "more than one object in the manifest stream"
    assert m.classdesc.name == "java.util.LinkedHashMap", m.classdesc.name
    assert m.classdesc.super_class.name == "java.util.HashMap"
    out = []
    for k, v in m.items():
        assert v.classdesc.name == "org.nd4j.common.primitives.Pair"
        assert v.classdesc.serialVersionUID == 119
        ((_, fields),) = v.field_data.items()
        vals = {f.name: x for f, x in fields.items()}
        assert sorted(vals) == ["key", "value"]
        for x in vals.values():
            assert x.classdesc.name == "java.lang.Long" and x.classdesc.serialVersionUID == 4290774380558885855
        out.append((str(k), int(vals["key"]), int(vals["value"])))
    return out


def layout(jobj, data):
    """Header (samediff.md 1.2), manifest (javaobj) and B = smallest manifest offset, or M."""
    magic, version, m, n, meta = struct.unpack_from(">4siqqq", data)
    assert (magic, version, meta) == (b"SDNB", 1, 32)
    assert 32 <= m and m + n == len(data), "the manifest must end the file"
    assert data[m:m + 4] == b"\xac\xed\x00\x05"
    entries = manifest_entries(jobj, data[m:m + n])
    blob_start = min((o for _, o, _ in entries), default=m)
    return {"M": m, "manifest_length": n, "entries": entries, "B": blob_start}


def utf16_sorted(keys):
    return sorted(keys, key=lambda s: s.encode("utf-16-be"))


def flatc_decode(flatc, region, workdir):
    """flatc --json of a graph region with shardkit's schema (no file identifier: --raw-binary)."""
    workdir.mkdir(parents=True, exist_ok=True)
    binf = workdir / "region.bin"
    binf.write_bytes(region)
    r = subprocess.run([flatc, "--json", "--raw-binary", "--strict-json", "--no-warnings",
                        "-o", str(workdir), str(FBS), "--", str(binf)], capture_output=True, text=True)
    assert r.returncode == 0, f"flatc failed ({r.returncode}): {r.stdout}{r.stderr}"
    return json.loads((workdir / "region.json").read_text(encoding="utf-8"))


def check_graph(g, data, lay, role, shard_index=None, extra_meta=None):
    """The decoded FlatGraph against the source tensors. role: single | graph | weights."""
    names = [v["name"] for v in g["variables"]]
    assert len(set(names)) == len(names)
    assert isinstance(g.get("nodes"), list) and isinstance(g.get("outputs"), list)
    ids = [(v["id"].get("first", 0), v["id"].get("second", 0)) for v in g["variables"]]
    assert len(set(ids)) == len(ids), "variable ids must be unique"
    manifest = {n: (o, ln) for n, o, ln in lay["entries"]}
    assert set(manifest) <= set(names)
    for v in g["variables"]:
        dt, shape, raw = TENSORS[v["name"]]
        code, width = DTYPES[dt]
        assert v.get("dtype", 0) == code, v["name"]
        assert v["shape"] == shape, v["name"]
        assert v.get("variabletype", 0) == (1 if v["name"] == CONSTANT else 0), v["name"]
        assert v.get("device") == -1
        arr = v.get("ndarray")
        if role == "graph":
            assert arr is None, f"shard 0 holds no data, {v['name']} has an ndarray"
            continue
        assert arr is not None, v["name"]
        assert arr.get("dtype", 0) == code and arr["shape"] == shape and arr.get("byteOrder", 0) == 0
        assert "bufferChunks" not in arr and not arr.get("isExternal", False)
        if v["name"] in manifest:  # appended: a stub that agrees with the manifest, data at offset
            off, ln = manifest[v["name"]]
            assert len(raw) >= 1048576 and ln == len(raw)
            assert "buffer" not in arr
            assert arr.get("appendedDataOffset", 0) == off - lay["B"]
            assert arr["appendedDataLength"] == ln and arr["totalBufferSize"] == ln
            assert off % ALIGN == 0
            assert data[off:off + ln] == raw, v["name"]
        elif raw:  # inline
            assert len(raw) < 1048576
            assert bytes(x & 0xFF for x in arr["buffer"]) == raw, v["name"]
        else:  # zero elements: shape, no buffer
            assert not arr.get("buffer")
    # blobs: aligned, in manifest order, nothing but the manifest after the last one
    ends = [o + ln for _, o, ln in lay["entries"]]
    assert [o for _, o, _ in lay["entries"]] == sorted(o for _, o, _ in lay["entries"])
    if ends:
        assert max(ends) == lay["M"], "the last blob must end at the manifest (C++ rule)"
    keys, values = g["metadataKeys"], g["metadataValues"]
    assert len(keys) == len(values) and keys == utf16_sorted(keys)
    meta = dict(zip(keys, values, strict=True))
    want = {**USER_META, **FORCED_META, **(extra_meta or {})}
    if role != "single":
        want.update({"shard.index": str(shard_index), "shard.type": role})
    assert {k: meta.get(k) for k in want} == want
    return names


def graph_region(data, lay, binary_blob_start):
    assert lay["B"] == binary_blob_start, "inspect's blob_start differs from the manifest's"
    assert lay["B"] % ALIGN == 0 or not lay["entries"]
    return data[32:lay["B"]]


def check_shard_set(flatc, jobj, parts, blob_starts, workdir, extra_meta=None):
    """parts: bytes of shard 0..N-1; checks roles, coverage and order of a set."""
    held = {}
    for i, data in enumerate(parts):
        lay = layout(jobj, data)
        g = flatc_decode(flatc, graph_region(data, lay, blob_starts[i]), workdir / f"shard{i}")
        role = "graph" if i == 0 else "weights"
        names = check_graph(g, data, lay, role, i, extra_meta)
        if i == 0:
            # Every variable; the order is not specified (DL4J: sameDiff.variables() order).
            assert sorted(names) == sorted(TENSORS), "shard 0 declares every variable"
            assert lay["entries"] == [] and lay["manifest_length"] == 135
        else:
            assert g["nodes"] == []
            sizes = [len(TENSORS[n][2]) for n in names]
            assert sizes == sorted(sizes, reverse=True), "weight shards hold variables by descending size"
            for n in names:
                assert n not in held, f"{n} in shards {held[n]} and {i}"
                held[n] = i
    assert set(held) >= {n for n, (_, _, raw) in TENSORS.items() if raw}


# ------------------------------------------------------------------ 1. manifests: Java, javaobj


def sdnb_files(model):
    return [model.sdnb, *model.shards]


def test_java_and_javaobj_read_shardkit_manifests(model, java, jobj, shardkit_bin):
    files = sdnb_files(model)
    assert len(model.shards) >= 3
    for res, path in zip(java("read", *files), files, strict=True):
        data = path.read_bytes()
        lay = layout(jobj, data)
        assert res["map_class"] == "java.util.LinkedHashMap"
        assert res["header"] == {"version": 1, "manifest_offset": lay["M"],
                                 "manifest_length": lay["manifest_length"], "metadata_offset": 32}
        ours = json.loads(sk(shardkit_bin, "sdnb", "manifest", path).stdout)
        assert ours["reencodes_identically"] is True
        java_entries = [(e["name"], e["offset"], e["length"]) for e in res["entries"]]
        assert java_entries == lay["entries"] == [(e["name"], e["offset"], e["length"]) for e in ours["entries"]]
        for name, off, ln in java_entries:
            assert data[off:off + ln] == TENSORS[name][2]
    single = layout(jobj, model.sdnb.read_bytes())["entries"]
    assert [n for n, _, _ in single] == ["enc/wé😀", "i64_1mib"], "blob order = graph order"


def test_java_reads_a_many_entry_manifest_with_long_keys(tmp_path, java, jobj, shardkit_bin):
    """14 appended tensors (HashMap sizing 24/32), a 70,000-byte key (TC_LONGSTRING) and
    non-ASCII keys in a file shardkit wrote, read by ObjectInputStream."""
    names = [f"layer.{i}.wé" for i in range(11)] + ["😀/\u0000/€", "x" * 70000, "\u07ff" * 40000]
    tensors = {n: ("U8", [1048576], bytes([i]) * 1048576) for i, n in enumerate(names)}
    src = tmp_path / "many.safetensors"
    write_safetensors(src, tensors)
    out = tmp_path / "many.sdnb"
    sk(shardkit_bin, "sdnb", "pack", "--from", src, "--out", out)
    data = out.read_bytes()
    lay = layout(jobj, data)
    (res,) = java("read", out)
    entries = [(e["name"], e["offset"], e["length"]) for e in res["entries"]]
    assert entries == lay["entries"]
    assert [n for n, _, _ in entries] == names
    man = data[lay["M"]:]
    # threshold 24, then after "77 08" bucket count 32 and size 14
    assert struct.unpack_from(">i", man, 119)[0] == 24 and struct.unpack_from(">ii", man, 125) == (32, 14)
    assert man[-2:] == b"\x78\x00"
    for name, off, ln in entries:
        assert ln == 1048576 and data[off:off + ln] == tensors[name][2]
    assert json.loads(sk(shardkit_bin, "sdnb", "manifest", out).stdout)["reencodes_identically"]


def mutf8_len(s):
    """Java's modified UTF-8 length, per UTF-16 code unit."""
    n = 0
    for i in range(0, len(b := s.encode("utf-16-be")), 2):
        c = int.from_bytes(b[i:i + 2], "big")
        n += 1 if 0 < c < 0x80 else 2 if c < 0x800 else 3
    return n


def expected_length(entries):
    """samediff.md 2.4: 135 + (146 if n >= 1) + sum(37 + k) - 9 r."""
    n, total, seen, r = len(entries), 135, set(), 0
    if n:
        total += 146
    for name, off, ln in entries:
        k = mutf8_len(name)
        total += 37 + k + (6 if k > 65535 else 0)
        for v in (off, ln):
            if -128 <= v <= 127:
                if v in seen:
                    r += 1
                seen.add(v)
    return total - 9 * r


REFERENCE_CASES = {
    # samediff.md section 10, vectors 4-7 (SHA-256 of OpenJDK 17's bytes)
    "empty": ([], "81ef2a06029f9529646d324413d0cde061a330d940a2a641473bdcf1bc37ba08"),
    "one": ([("w", 1088, 4194304)], "24e3ed233c00019803c53d4d2b53eb9c0d46b8bdafda140309e7f5471c0baef1"),
    "zero_lengths": ([("e1", 4096, 0), ("e2", 4096, 0)],
                     "ea588bfd7a453b1991728fa2f0686d814b3216f4d86458f763306c0322065dfa"),
    "two": ([("w1", 66624, 4194304), ("w2", 4260928, 1048580)],
            "21866d7668c914f2a6650b86531b53cc522d987ef3b4c92c41daccf2b2be06d0"),
    # Long cache: every value in 0..127 repeated, 128 (not cached) repeated
    "long_cache": ([("a", 0, 0), ("b", 127, 1), ("c", 1, 127), ("d", 128, 128), ("e", 0, 127),
                    ("f", 128, 5)], None),
    "large_offsets": ([("a", 2**31, 2**31 + 1), ("b", 2**32 + 7, 5), ("c", 2**63 - 1, 2**40)], None),
    "non_ascii": ([("é", 40, 1), ("😀", 41, 2), ("a\u0000bé€😀", 42, 3),
                   ("\u0080\u07ff\u0800\uffff\U0010ffff", 43, 4), ("日本語/層.0", 44, 5)], None),
    "tc_string_max": ([("y" * 65535, 40, 1)], None),
    "tc_longstring": ([("x" * 70000, 40, 1)], None),
    "tc_longstring_min": ([("y" * 65536, 40, 1), ("z", 41, 1)], None),
    # 22,000 UTF-16 units but 66,000 bytes: the byte length decides
    "longstring_multibyte": ([("€" * 22000, 40, 1)], None),
    **{f"n{n}": ([(f"v{i:03d}", 1000 + 4096 * i, 4096 + i) for i in range(n)], None)
       for n in (12, 13, 24, 25, 48, 49, 96, 97)},
}


def write_specs(tmp_path, cases, kind="linked"):
    args = []
    for name, entries in cases.items():
        spec = tmp_path / f"{name}.spec"
        spec.write_text(kind + "\n" + "".join(f"{o} {ln} {n.encode('utf-8').hex()}\n" for n, o, ln in entries))
        args += [spec, tmp_path / f"{name}.ser"]
    return args


def test_shardkit_parses_and_reproduces_java_written_manifests(tmp_path, java, jobj, shardkit_bin):
    java("write", *write_specs(tmp_path, {k: v[0] for k, v in REFERENCE_CASES.items()}))
    for case, (entries, sha) in REFERENCE_CASES.items():
        ref = (tmp_path / f"{case}.ser").read_bytes()
        if sha:
            assert hashlib.sha256(ref).hexdigest() == sha, f"{case}: the JDK disagrees with samediff.md"
        assert len(ref) == expected_length(entries), case
        assert manifest_entries(jobj, ref) == entries, case
        enc = tmp_path / f"{case}.shardkit"
        r = sk(shardkit_bin, "sdnb", "manifest", tmp_path / f"{case}.ser", "--encode-to", enc, ok=False)
        assert r.returncode == 0, f"{case}: {r.stderr.decode()}"
        got = json.loads(r.stdout)
        assert got["reencodes_identically"] is True, case
        assert [(e["name"], e["offset"], e["length"]) for e in got["entries"]] == entries, case
        assert enc.read_bytes() == ref, f"{case}: shardkit's encoding differs from ObjectOutputStream's"
    # The vector 9 key bytes (modified UTF-8: C0 80 for NUL, surrogates 3 bytes each)
    ref = (tmp_path / "non_ascii.ser").read_bytes()
    assert bytes.fromhex("74000f61c08062c3a9e282aceda0bdedb880") in ref
    assert (tmp_path / "tc_longstring.ser").read_bytes()[133:142] == bytes.fromhex("7c0000000000011170")
    assert len((tmp_path / "tc_longstring.ser").read_bytes()) == 70324
    assert (tmp_path / "tc_string_max.ser").read_bytes()[133:136] == b"\x74\xff\xff"
    # threshold / buckets written by HashMap for n puts (vector 8)
    for n, want in {12: (12, 16), 13: (24, 32), 24: (24, 32), 25: (48, 64), 48: (48, 64),
                    49: (96, 128), 96: (96, 128), 97: (192, 256)}.items():
        b = (tmp_path / f"n{n}.ser").read_bytes()
        assert (struct.unpack_from(">i", b, 119)[0], struct.unpack_from(">i", b, 125)[0]) == want


def test_shardkit_reads_a_top_level_hashmap(tmp_path, java, shardkit_bin):
    """DL4J casts to Map, so a plain HashMap is a valid manifest: shardkit reads it (its own
    encoding is a LinkedHashMap, so the re-encoding differs: exit status 1), and Java reads
    shardkit's LinkedHashMap re-encoding of it with the same entries."""
    entries = [(f"k{i}é", 4096 * i + 32, 7 + i) for i in range(20)]
    java("write", *write_specs(tmp_path, {"hash": entries, "hash_empty": []}, kind="hash"))
    ref = (tmp_path / "hash.ser").read_bytes()
    assert ref[4:8] == b"\x73\x72\x00\x11" and ref[8:25] == b"java.util.HashMap"
    assert len((tmp_path / "hash_empty.ser").read_bytes()) == 82  # samediff.md 2.3
    r = sk(shardkit_bin, "sdnb", "manifest", tmp_path / "hash_empty.ser", ok=False)
    assert r.returncode == 1 and json.loads(r.stdout)["entries"] == []
    enc = tmp_path / "hash.shardkit"
    r = sk(shardkit_bin, "sdnb", "manifest", tmp_path / "hash.ser", "--encode-to", enc, ok=False)
    assert r.returncode == 1, r.stderr.decode()
    got = json.loads(r.stdout)
    assert got["reencodes_identically"] is False
    decoded = [(e["name"], e["offset"], e["length"]) for e in got["entries"]]
    assert sorted(decoded) == sorted(entries)
    (res,) = java("read", enc)
    assert res["map_class"] == "java.util.LinkedHashMap"
    assert [(e["name"], e["offset"], e["length"]) for e in res["entries"]] == decoded


def test_negative_manifest_values_are_refused_cleanly(tmp_path, java, shardkit_bin):
    """Java can write negative Longs; offsets and lengths cannot be negative, so shardkit must
    refuse them with an error (not a panic)."""
    java("write", *write_specs(tmp_path, {"neg": [("a", -1, 5)]}))
    r = sk(shardkit_bin, "sdnb", "manifest", tmp_path / "neg.ser", ok=False)
    assert r.returncode != 0 and r.stderr


# ------------------------------------------------------------------ 2. the graph region: flatc


def test_flatc_decodes_the_single_file_graph(model, flatc, jobj, shardkit_bin, tmp_path):
    data = model.sdnb.read_bytes()
    lay = layout(jobj, data)
    (part,) = inspect(shardkit_bin, model.sdnb)["parts"]
    g = flatc_decode(flatc, graph_region(data, lay, part["blob_start"]), tmp_path)
    # (the order itself is checked by test_pack_keeps_the_safetensors_order)
    assert sorted(check_graph(g, data, lay, "single")) == sorted(TENSORS)
    assert g["nodes"] == [] and g["outputs"] == []
    # the graph itself ends before B; the rest of the region is zero slack
    assert part["graph_bytes"] <= lay["B"] - 32
    assert data[32 + part["graph_bytes"]:lay["B"]].count(0) == lay["B"] - 32 - part["graph_bytes"]


def test_flatc_decodes_every_shard_of_a_set(model, flatc, jobj, shardkit_bin, tmp_path):
    info = inspect(shardkit_bin, model.sharded)
    assert [Path(p["name"]).name for p in info["parts"]] == [p.name for p in model.shards]
    n = len(model.shards)
    assert [p.name for p in model.shards] == [f"s.shard{i}-of-{n}.sdnb" for i in range(n)]
    check_shard_set(flatc, jobj, [p.read_bytes() for p in model.shards],
                    [p["blob_start"] for p in info["parts"]], tmp_path)


# ------------------------------------------------------------------ 3. SDZ: zipfile, zip -T, Java


def local_header(raw, zi):
    """The local file header of entry zi, parsed by hand (APPNOTE 4.3.7)."""
    off = zi.header_offset
    (sig, _ver, flags, method, _t, _d, crc, csize, usize, nlen, elen) = struct.unpack_from("<IHHHHHIIIHH", raw, off)
    assert sig == 0x04034B50, zi.filename
    name = raw[off + 30:off + 30 + nlen]
    extra = raw[off + 30 + nlen:off + 30 + nlen + elen]
    return {"flags": flags, "method": method, "crc": crc, "csize": csize, "usize": usize, "name": name,
            "extra": extra, "data_start": off + 30 + nlen + elen}


def extra_records(extra):
    out, i = {}, 0
    while i < len(extra):
        hid, size = struct.unpack_from("<HH", extra, i)
        assert i + 4 + size <= len(extra), "truncated extra record"
        out[hid] = extra[i + 4:i + 4 + size]
        i += 4 + size
    return out


def check_sdz(path, java, zip_t, jobj, model_names, extra=None):
    """Every independent ZIP check; returns {entry name: bytes}."""
    raw = path.read_bytes()
    assert raw[:4] == b"PK\x03\x04"
    extra = extra or {}
    with zipfile.ZipFile(path) as zf:
        assert zf.testzip() is None
        infos = zf.infolist()
        assert sorted(zi.filename for zi in infos) == sorted([*model_names, *extra])
        # Deeplearning4j's native SdzReader (ADR 0073) takes the graph from the first .sdnb
        # entry and reads no ZIP64 and no entry whose name does not end in .sdnb.
        assert [zi.filename for zi in infos if zi.filename in model_names] == list(model_names)
        assert all(n.endswith(".sdnb") for n in model_names) and zf.comment == b""
        contents = {zi.filename: zf.read(zi) for zi in infos}
    for zi in infos:
        lh = local_header(raw, zi)
        assert lh["name"] == zi.filename.encode()
        assert lh["method"] == zi.compress_type
        if zi.filename in extra:
            assert contents[zi.filename] == extra[zi.filename]
            continue
        assert zi.compress_type == zipfile.ZIP_STORED, f"{zi.filename} is not STORED"
        assert zi.flag_bits & 8 == 0 and lh["flags"] & 8 == 0, "no data descriptor"
        assert (lh["crc"], lh["csize"], lh["usize"]) == (zi.CRC, zi.compress_size, zi.file_size)
        assert lh["data_start"] % ALIGN == 0, f"{zi.filename}: data at {lh['data_start']}"
        assert raw[lh["data_start"]:lh["data_start"] + zi.file_size] == contents[zi.filename]
        rec = extra_records(lh["extra"])
        assert 0xD935 in rec, "zipalign-style record in the local header"
        assert len(rec[0xD935]) >= 2 and struct.unpack_from("<H", rec[0xD935])[0] == ALIGN
        assert not rec[0xD935][2:].strip(b"\x00")
        assert 0xD935 not in extra_records(zi.extra), "the record is in the local header only"
        assert 0x0001 not in rec and 0x0001 not in extra_records(zi.extra), "no ZIP64 extra field"
        layout(jobj, contents[zi.filename])
    zip_t(path)
    (res,) = java("zip", path)
    for key in ("zipfile", "zipinputstream"):
        got = res[key]
        assert [e["name"] for e in got] == [zi.filename for zi in infos], key
        for e, zi in zip(got, infos, strict=True):
            data = contents[zi.filename]
            assert e["read"] == e["size"] == len(data) == zi.file_size
            assert e["crc"] == e["crc_of_data"] == zi.CRC
            assert e["sha256"] == hashlib.sha256(data).hexdigest()
            if zi.filename in model_names:
                assert e["method"] == 0
                entries = [(x["name"], x["offset"], x["length"]) for x in e["sdnb"]["entries"]]
                assert entries == layout(jobj, data)["entries"]
    return contents


def shard_names(n):
    return [f"model.shard{i}-of-{n}.sdnb" for i in range(n)]


def test_single_sdz(model, java, zip_t, jobj, flatc, shardkit_bin, tmp_path):
    contents = check_sdz(model.sdz, java, zip_t, jobj, ["model.sdnb"])
    data = contents["model.sdnb"]
    lay = layout(jobj, data)
    (part,) = inspect(shardkit_bin, model.sdz)["parts"]
    g = flatc_decode(flatc, graph_region(data, lay, part["blob_start"]), tmp_path)
    check_graph(g, data, lay, "single")


def test_sharded_sdz(model, java, zip_t, jobj, flatc, shardkit_bin, tmp_path):
    n = len(model.shards)
    names = shard_names(n)
    contents = check_sdz(model.sharded_sdz, java, zip_t, jobj, names)
    info = inspect(shardkit_bin, model.sharded_sdz)
    check_shard_set(flatc, jobj, [contents[k] for k in names], [p["blob_start"] for p in info["parts"]], tmp_path)


def test_sharded_sdz_with_an_extra_entry(java, zip_t, jobj, flatc, tmp_path):
    try:
        from shardkit import sdnb
    except ImportError as e:
        pytest.skip(f"the shardkit Python package is not installed ({e}); the CLI cannot add extra entries")
    if not hasattr(sdnb, "save"):
        pytest.skip("shardkit.sdnb.save does not exist yet; the CLI cannot add extra entries")
    from shardkit import _shardkit
    if not hasattr(_shardkit, "sdnb_save"):
        pytest.fail("shardkit's compiled extension predates shardkit.sdnb.save: rebuild it "
                    "(maturin develop -m crates/shardkit-py/Cargo.toml; scripts/test does)")
    arrays = {n: np.frombuffer(TENSORS[n][2], dtype=d).reshape(TENSORS[n][1])
              for n, d in [("enc/wé😀", "<f4"), ("i64_1mib", "<i8"), ("i16", "<i2"), ("f32_nan", "<u4")]}
    arrays["f32_nan"] = arrays["f32_nan"].view("<f4")
    tok = json.dumps({"version": "1.0", "model": {"vocab": {"é": 0, "😀": 1}}}, ensure_ascii=False).encode()
    path = tmp_path / "with_tokenizer.sdz"
    sdnb.save(path, arrays, metadata=USER_META, shard_size=1 << 20, extra_entries={"tokenizer.json": tok})
    with zipfile.ZipFile(path) as zf:
        models = [n for n in zf.namelist() if n != "tokenizer.json"]
    n = len(models)
    assert n >= 3 and sorted(models) == sorted(shard_names(n))
    contents = check_sdz(path, java, zip_t, jobj, shard_names(n), extra={"tokenizer.json": tok})
    for i, name in enumerate(shard_names(n)):
        data = contents[name]
        lay = layout(jobj, data)
        for var, off, ln in lay["entries"]:
            assert data[off:off + ln] == arrays[var].tobytes()
        g = flatc_decode(flatc, data[32:lay["B"]], tmp_path / name)
        meta = dict(zip(g["metadataKeys"], g["metadataValues"], strict=True))
        assert meta["shard.index"] == str(i) and {k: meta[k] for k in USER_META} == USER_META
    with sdnb.open(path) as c:
        assert c.extra_entries == ["tokenizer.json"] and c.extra_entry("tokenizer.json") == tok


def regions_outside_graph(data, lay):
    return data[:32], data[lay["B"]:]


@pytest.mark.parametrize("which", ["sdz", "sharded_sdz"])
def test_sdz_after_in_place_metadata_edit(model, which, java, zip_t, jobj, flatc, shardkit_bin, tmp_path):
    src = getattr(model, which)
    path = tmp_path / src.name
    shutil.copyfile(src, path)
    with zipfile.ZipFile(src) as zf:
        before = {n: zf.read(n) for n in zf.namelist()}
    edit = {"edited": "oui é 😀", "author": "someone else"}
    sk(shardkit_bin, "sdnb", "meta", "set", path, *(f"{k}={v}" for k, v in edit.items()))
    assert path.stat().st_size == src.stat().st_size, "an in-place edit keeps the archive's size"
    names = ["model.sdnb"] if which == "sdz" else shard_names(len(model.shards))
    after = check_sdz(path, java, zip_t, jobj, names)
    info = inspect(shardkit_bin, path)
    for i, name in enumerate(names):
        lay = layout(jobj, after[name])
        assert regions_outside_graph(after[name], lay) == regions_outside_graph(before[name], layout(jobj, before[name]))
        g = flatc_decode(flatc, graph_region(after[name], lay, info["parts"][i]["blob_start"]), tmp_path / name)
        meta = dict(zip(g["metadataKeys"], g["metadataValues"], strict=True))
        assert g["metadataKeys"] == utf16_sorted(g["metadataKeys"])
        assert {k: meta.get(k) for k in edit} == edit, f"{name}: every shard carries the metadata"
        assert {k: meta.get(k) for k in FORCED_META} == FORCED_META


def test_sdnb_after_in_place_metadata_edit(model, jobj, flatc, shardkit_bin, tmp_path):
    path = tmp_path / "edited.sdnb"
    shutil.copyfile(model.sdnb, path)
    before = path.read_bytes()
    sk(shardkit_bin, "sdnb", "meta", "set", path, "edited=oui")
    after = path.read_bytes()
    lay = layout(jobj, after)
    assert len(after) == len(before)
    assert regions_outside_graph(after, lay) == regions_outside_graph(before, layout(jobj, before))
    g = flatc_decode(flatc, after[32:lay["B"]], tmp_path)
    check_graph(g, after, lay, "single", extra_meta={"edited": "oui"})


# ------------------------------------------------------------------ 4. data round trips


def test_pack_keeps_the_safetensors_order(tmp_path, jobj, flatc, shardkit_bin):
    """Variables appear in the graph in the file's data order, the same on every run (a
    zero-element tensor shares its start offset with the next tensor, so sorting by start offset
    alone leaves the order to chance)."""
    src = tmp_path / "order.safetensors"
    order = ["a", "z_empty", "b", "c_empty", "d", "y_empty", "x_empty"]
    write_safetensors(src, {n: ("U8", [0] if "empty" in n else [2], b"" if "empty" in n else b"xy")
                            for n in order})
    seen = []
    for i in range(6):
        out = tmp_path / f"order{i}.sdnb"
        sk(shardkit_bin, "sdnb", "pack", "--from", src, "--out", out)
        data = out.read_bytes()
        g = flatc_decode(flatc, data[32:layout(jobj, data)["B"]], tmp_path / f"order{i}")
        seen.append([v["name"] for v in g["variables"]])
    # Deterministic, and in data order where the offsets decide it ([x, x] before [x, y]);
    # the two empty tensors at the end share [6, 6], either order is fine but always the same.
    assert all(s == seen[0] for s in seen), f"graph orders differ between runs: {seen}"
    assert seen[0][:5] == order[:5] and sorted(seen[0][5:]) == ["x_empty", "y_empty"], seen[0]


@pytest.mark.parametrize("which", ["sdnb", "sharded", "sdz", "sharded_sdz", "converted"])
def test_round_trip_is_bit_exact(model, which, shardkit_bin, tmp_path):
    if which == "converted":  # single SDNB -> sharded SDZ via convert
        path = tmp_path / "converted.sdz"
        sk(shardkit_bin, "sdnb", "convert", model.sdnb, path, "--shard-size", "1M")
        with zipfile.ZipFile(path) as zf:
            assert all(n.startswith("model.shard") for n in zf.namelist()) and len(zf.namelist()) >= 3
    else:
        path = getattr(model, which)
    out = tmp_path / "unpacked"
    sk(shardkit_bin, "sdnb", "unpack", path, "--out", out)
    (st,) = list(out.glob("*.safetensors"))
    got = read_safetensors(st)
    assert set(got) == set(TENSORS)
    for name, (dt, shape, raw) in TENSORS.items():
        assert got[name][0] == dt and got[name][1] == shape, name
        assert got[name][2] == raw, f"{name}: bytes differ after {which}"
    # a second reader of our input and output: the safetensors package
    from safetensors import safe_open
    with safe_open(str(st), framework="numpy") as f:
        for name in f.keys():
            if TENSORS[name][0] not in ("BF16", "F8_E4M3"):  # numpy has no such dtype
                assert f.get_tensor(name).tobytes() == TENSORS[name][2], name
