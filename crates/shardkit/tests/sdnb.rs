//! SameDiff containers end to end: single files, shard sets and SDZ archives written and read
//! back bit for bit, the §9.2 layout, in-place metadata edits, conversions and refusals.

use std::fs;
use std::io::Read;
use std::path::{Path, PathBuf};

use shardkit::sdnb::{
    self, convert, open, save, set_metadata, DType, Format, Kind, Order, SaveOptions, Storage,
    TensorIn, VarType,
};
use shardkit::Error;

/// Deterministic bytes, with NaN payloads and subnormals sprinkled in for float types.
fn pattern(n: usize, seed: u8) -> Vec<u8> {
    let mut x = 0x9e3779b9u32 ^ seed as u32;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            (x >> 11) as u8
        })
        .collect()
}

struct Spec {
    name: &'static str,
    dtype: DType,
    shape: Vec<i64>,
    order: Order,
    var_type: VarType,
}

fn specs() -> Vec<Spec> {
    let s = |name, dtype, shape: &[i64], order, var_type| Spec {
        name,
        dtype,
        shape: shape.to_vec(),
        order,
        var_type,
    };
    vec![
        s(
            "big_f32",
            DType::Float,
            &[512, 1024],
            Order::C,
            VarType::Variable,
        ),
        s(
            "exact_1mib_u8",
            DType::Uint8,
            &[1 << 20],
            Order::C,
            VarType::Constant,
        ),
        s(
            "below_u8",
            DType::Uint8,
            &[(1 << 20) - 1],
            Order::C,
            VarType::Variable,
        ),
        s(
            "bf16",
            DType::Bfloat16,
            &[600, 1000],
            Order::C,
            VarType::Variable,
        ),
        s("f16", DType::Half, &[3, 5], Order::F, VarType::Variable),
        s("fp8", DType::Float8, &[17], Order::C, VarType::Constant),
        s(
            "f64",
            DType::Double,
            &[2, 2, 2],
            Order::C,
            VarType::Variable,
        ),
        s("i8", DType::Int8, &[7], Order::C, VarType::Variable),
        s("i16", DType::Int16, &[7], Order::C, VarType::Variable),
        s("i32", DType::Int32, &[7], Order::C, VarType::Variable),
        s("i64", DType::Int64, &[7], Order::C, VarType::Variable),
        s("u16", DType::Uint16, &[7], Order::C, VarType::Variable),
        s("u32", DType::Uint32, &[7], Order::C, VarType::Variable),
        s("u64", DType::Uint64, &[7], Order::C, VarType::Variable),
        s("bool", DType::Bool, &[9], Order::C, VarType::Constant),
        s("scalar", DType::Float, &[], Order::C, VarType::Constant),
        s("empty", DType::Float, &[0, 4], Order::C, VarType::Variable),
        s(
            "naïve ünïcode",
            DType::Float,
            &[2],
            Order::C,
            VarType::Variable,
        ),
    ]
}

/// Bytes per element of the fixed-width types the specs use.
fn width(d: DType) -> usize {
    match d {
        DType::Bool | DType::Float8 | DType::Int8 | DType::Uint8 => 1,
        DType::Half | DType::Int16 | DType::Uint16 | DType::Bfloat16 => 2,
        DType::Float | DType::Int32 | DType::Uint32 => 4,
        _ => 8,
    }
}

/// One metadata value of `c`.
fn meta<'a>(c: &'a sdnb::Container, key: &str) -> Option<&'a str> {
    c.metadata()
        .iter()
        .find(|(k, _)| k == key)
        .map(|(_, v)| v.as_str())
}

fn data(specs: &[Spec]) -> Vec<Vec<u8>> {
    specs
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let n: i64 = s.shape.iter().product();
            let mut b = pattern(n as usize * width(s.dtype), i as u8);
            if s.dtype == DType::Float && b.len() >= 8 {
                // A signalling NaN with a payload and a negative quiet NaN.
                b[..4].copy_from_slice(&0x7f80_0001u32.to_le_bytes());
                b[4..8].copy_from_slice(&0xffc1_2345u32.to_le_bytes());
            }
            if s.dtype == DType::Bool {
                // BOOL holds bytes 0 and 1 only (a save refuses anything else).
                for x in &mut b {
                    *x &= 1;
                }
            }
            b
        })
        .collect()
}

fn tensors<'a>(specs: &'a [Spec], data: &'a [Vec<u8>]) -> Vec<TensorIn<'a>> {
    specs
        .iter()
        .zip(data)
        .map(|(s, d)| TensorIn {
            name: s.name.into(),
            var_type: s.var_type,
            dtype: s.dtype,
            shape: s.shape.clone(),
            order: s.order,
            bytes: d,
        })
        .collect()
}

fn opts(format: Format) -> SaveOptions {
    SaveOptions {
        format,
        metadata: vec![
            ("model.name".into(), "tiny".into()),
            ("creation.time".into(), "1700000000000".into()),
        ],
        ..SaveOptions::default()
    }
}

fn check_same(path: &Path, specs: &[Spec], data: &[Vec<u8>]) -> sdnb::Container {
    let c = open(path).unwrap();
    assert_eq!(c.variables().len(), specs.len());
    for (s, d) in specs.iter().zip(data) {
        let v = c.variables().iter().find(|v| v.name == s.name).unwrap();
        assert_eq!(
            (v.dtype, v.var_type, v.order),
            (s.dtype, s.var_type, s.order)
        );
        assert_eq!(v.shape.as_deref(), Some(&s.shape[..]), "{}", s.name);
        let t = c.tensor(s.name).unwrap();
        assert!(t.bytes == &d[..], "{} differs", s.name);
        let want = if d.is_empty() {
            Storage::Empty
        } else if d.len() >= 1 << 20 {
            Storage::Appended
        } else {
            Storage::Inline
        };
        assert_eq!(v.storage, want, "{}", s.name);
        assert_eq!(v.byte_len, d.len() as u64);
    }
    assert_eq!(meta(&c, "model.name"), Some("tiny"));
    assert_eq!(meta(&c, "nd4j.format.version"), Some("1"));
    assert_eq!(meta(&c, "nd4j.format.type"), Some("APPENDED_BLOB"));
    c
}

fn be_u64(b: &[u8], at: usize) -> u64 {
    u64::from_be_bytes(b[at..at + 8].try_into().unwrap())
}

#[test]
fn single_file_round_trips_every_dtype_with_the_documented_layout() {
    let dir = tempfile::tempdir().unwrap();
    let (sp, d) = (specs(), data(&specs()));
    let p = dir.path().join("m.sdnb");
    save(&p, &tensors(&sp, &d), &opts(Format::Sdnb)).unwrap();
    let c = check_same(&p, &sp, &d);
    assert_eq!(c.kind(), Kind::Sdnb);

    let bytes = fs::read(&p).unwrap();
    assert_eq!(&bytes[..8], b"SDNB\0\0\0\x01");
    let (m, mlen) = (be_u64(&bytes, 8), be_u64(&bytes, 16));
    assert_eq!(be_u64(&bytes, 24), 32);
    assert_eq!(m + mlen, bytes.len() as u64, "the manifest ends the file");
    assert_eq!(&bytes[m as usize..m as usize + 4], &[0xac, 0xed, 0, 5]);
    let l = &c.layout()[0];
    assert!(
        l.blob_start >= 32 + l.graph_bytes + (64 << 10),
        "slack reserved"
    );
    assert_eq!(l.blob_start % 64, 0);
    assert_eq!(
        l.manifest_entries, 3,
        "big_f32, exact_1mib_u8 and bf16 are appended"
    );
    // Every blob 64-aligned, and the last one ends at M.
    let mut ends = Vec::new();
    for name in ["big_f32", "exact_1mib_u8", "bf16"] {
        let t = c.tensor(name).unwrap();
        let off = t.bytes.as_ptr() as usize - c.tensor("big_f32").unwrap().bytes.as_ptr() as usize
            + l.blob_start as usize;
        assert_eq!(off % 64, 0, "{name}");
        ends.push(off + t.bytes.len());
    }
    assert_eq!(*ends.iter().max().unwrap() as u64, m);
    // The slack and padding are zero.
    assert!(bytes[32 + l.graph_bytes as usize..l.blob_start as usize]
        .iter()
        .all(|&b| b == 0));
    // F order is presented transposed to C.
    let f16 = c.tensor("f16").unwrap();
    let cbytes = f16.c_order_bytes();
    assert_eq!(
        &cbytes[2..4],
        &d[4][2 * 3..2 * 3 + 2],
        "element (0,1) is F index 3"
    );
}

#[test]
fn shard_sets_split_by_size_and_read_back_whole() {
    let dir = tempfile::tempdir().unwrap();
    let (sp, d) = (specs(), data(&specs()));
    let p = dir.path().join("model.bin");
    let mut o = opts(Format::Sharded);
    o.shard_size = Some(3 << 20);
    let files = save(&p, &tensors(&sp, &d), &o).unwrap();
    let n = files.len();
    assert!(n >= 3, "{files:?}");
    for (i, f) in files.iter().enumerate() {
        assert_eq!(
            f.file_name().unwrap().to_str().unwrap(),
            format!("model.shard{i}-of-{n}.sdnb")
        );
    }
    // Opened by base name, by any shard, or by the base path that does not exist.
    for q in [files[0].clone(), files[n - 1].clone(), p.clone()] {
        let c = check_same(&q, &sp, &d);
        assert_eq!(c.kind(), Kind::Sharded { shards: n });
    }
    let c = open(&files[0]).unwrap();
    let lay = c.layout();
    assert_eq!(lay[0].manifest_entries, 0, "shard 0 holds no data");
    // Re-saving with fewer shards removes the old set's extra files.
    let mut o2 = o.clone();
    o2.shard_size = Some(1 << 30);
    let again = save(&p, &tensors(&sp, &d), &o2).unwrap();
    assert_eq!(again.len(), 2);
    let left: Vec<_> = fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    // The two shards and the set's checksums sidecar, which covers exactly them.
    assert_eq!(left.len(), 3, "{left:?}");
    assert!(
        left.iter().any(|n| n == "model.shard-set.checksums.json"),
        "{left:?}"
    );
    assert!(matches!(
        shardkit::checksum::verify(&again[0]).unwrap(),
        shardkit::checksum::Verdict::Intact { files: 2, .. }
    ));
    check_same(&p, &sp, &d);

    // A missing shard is an error, never a partial load.
    fs::remove_file(&again[1]).unwrap();
    let err = open(&again[0]).unwrap_err().to_string();
    assert!(err.contains("missing"), "{err}");
}

#[test]
fn sdz_archives_hold_single_or_sharded_models_and_extra_entries() {
    let dir = tempfile::tempdir().unwrap();
    let (sp, d) = (specs(), data(&specs()));
    for shard_size in [None, Some(2 << 20)] {
        let p = dir.path().join("m.sdz");
        let mut o = opts(Format::Sdz);
        o.shard_size = shard_size;
        o.extra_entries = vec![("tokenizer.json".into(), b"{\"v\": 1}".to_vec())];
        save(&p, &tensors(&sp, &d), &o).unwrap();
        let c = check_same(&p, &sp, &d);
        assert!(matches!(c.kind(), Kind::Sdz { .. }));
        assert_eq!(c.extra_entries(), ["tokenizer.json"]);
        assert_eq!(c.extra_entry("tokenizer.json").unwrap(), b"{\"v\": 1}");
        // The zip crate reads every entry with its CRC checked.
        let mut z = zip::ZipArchive::new(fs::File::open(&p).unwrap()).unwrap();
        let mut names = Vec::new();
        for i in 0..z.len() {
            let mut e = z.by_index(i).unwrap();
            assert_eq!(e.compression(), zip::CompressionMethod::Stored);
            assert_eq!(e.data_start() % 64, 0, "{} is aligned", e.name());
            let mut sink = Vec::new();
            e.read_to_end(&mut sink).unwrap();
            names.push(e.name().to_string());
        }
        if shard_size.is_none() {
            assert_eq!(names, ["model.sdnb", "tokenizer.json"]);
        } else {
            assert!(names[0].starts_with("model.shard0-of-"), "{names:?}");
        }
        // Tensors are served from the archive's map, not copied out.
        let t = c.tensor("big_f32").unwrap();
        assert_eq!(t.bytes.as_ptr() as usize % 64, 0);
    }
}

#[test]
fn conversions_keep_every_byte_and_the_metadata() {
    let dir = tempfile::tempdir().unwrap();
    let (sp, d) = (specs(), data(&specs()));
    let a = dir.path().join("a.sdnb");
    save(&a, &tensors(&sp, &d), &opts(Format::Sdnb)).unwrap();
    let b = dir.path().join("b.sdnb");
    let mut o = SaveOptions {
        format: Format::Sharded,
        shard_size: Some(2 << 20),
        ..SaveOptions::default()
    };
    convert(&open(&a).unwrap(), &b, &o).unwrap();
    check_same(&b, &sp, &d);
    let z = dir.path().join("c.sdz");
    o.format = Format::Sdz;
    o.shard_size = None;
    o.metadata = vec![("extra".into(), "1".into())];
    convert(&open(&b).unwrap(), &z, &o).unwrap();
    let c = check_same(&z, &sp, &d);
    assert_eq!(meta(&c, "extra"), Some("1"));
    assert_eq!(
        meta(&c, "shard.type"),
        None,
        "shard keys belong to shard sets only"
    );
    let back = dir.path().join("d.sdnb");
    convert(&c, &back, &SaveOptions::default()).unwrap();
    check_same(&back, &sp, &d);
    assert_eq!(open(&back).unwrap().metadata(), c.metadata());
}

fn regions_outside_graph(path: &Path) -> (Vec<u8>, Vec<u8>) {
    let bytes = fs::read(path).unwrap();
    let c = open(path).unwrap();
    let b = c.layout()[0].blob_start as usize;
    (bytes[..32].to_vec(), bytes[b..].to_vec())
}

#[test]
fn metadata_edits_stay_inside_the_slack_or_rewrite_on_request() {
    let dir = tempfile::tempdir().unwrap();
    let (sp, d) = (specs(), data(&specs()));
    let p = dir.path().join("m.sdnb");
    save(&p, &tensors(&sp, &d), &opts(Format::Sdnb)).unwrap();
    let before = regions_outside_graph(&p);
    let out = set_metadata(
        &p,
        &[
            ("author".into(), Some("Ada".into())),
            ("model.name".into(), None),
        ],
        false,
    )
    .unwrap();
    assert!(out.in_place);
    assert_eq!(
        regions_outside_graph(&p),
        before,
        "header, blobs and manifest untouched"
    );
    let c = check_meta(&p, &sp, &d);
    assert_eq!(meta(&c, "author"), Some("Ada"));
    assert_eq!(meta(&c, "model.name"), None);

    // Too large for 64 KiB of slack: refused without a byte changed, then rewritten on request.
    let huge = "x".repeat(200 << 10);
    let snapshot = fs::read(&p).unwrap();
    let err = set_metadata(&p, &[("big".into(), Some(huge.clone()))], false).unwrap_err();
    assert!(err.to_string().contains("full rewrite"), "{err}");
    assert_eq!(fs::read(&p).unwrap(), snapshot);
    let out = set_metadata(&p, &[("big".into(), Some(huge.clone()))], true).unwrap();
    assert!(!out.in_place);
    let c = check_meta(&p, &sp, &d);
    assert_eq!(meta(&c, "big"), Some(huge.as_str()));
    assert_eq!(meta(&c, "author"), Some("Ada"));

    // Forced keys are not editable.
    let err = set_metadata(
        &p,
        &[("nd4j.format.version".into(), Some("2".into()))],
        true,
    )
    .unwrap_err();
    assert!(
        matches!(&err, Error::Invalid(m) if m.contains("nd4j.format.version")),
        "{err:?}"
    );
}

fn check_meta(p: &Path, sp: &[Spec], d: &[Vec<u8>]) -> sdnb::Container {
    let c = open(p).unwrap();
    for (s, x) in sp.iter().zip(d) {
        assert!(c.tensor(s.name).unwrap().bytes == &x[..]);
    }
    c
}

#[test]
fn metadata_edits_in_archives_and_shard_sets_keep_crcs_valid() {
    let dir = tempfile::tempdir().unwrap();
    let (sp, d) = (specs(), data(&specs()));
    for (name, format, shard) in [
        ("a.sdz", Format::Sdz, None),
        ("b.sdz", Format::Sdz, Some(2u64 << 20)),
        ("c.sdnb", Format::Sharded, Some(2 << 20)),
    ] {
        let p = dir.path().join(name);
        let mut o = opts(format);
        o.shard_size = shard;
        let files = save(&p, &tensors(&sp, &d), &o).unwrap();
        let target = files[0].clone();
        let out = set_metadata(&target, &[("k".into(), Some("v".into()))], false).unwrap();
        assert!(out.in_place);
        let c = check_meta(&target, &sp, &d);
        assert_eq!(meta(&c, "k"), Some("v"));
        if format == Format::Sdz {
            let mut z = zip::ZipArchive::new(fs::File::open(&p).unwrap()).unwrap();
            for i in 0..z.len() {
                let mut sink = Vec::new();
                z.by_index(i)
                    .unwrap()
                    .read_to_end(&mut sink)
                    .expect("CRC still matches");
            }
        } else {
            for f in &files {
                let one = fs::read(f).unwrap();
                assert!(String::from_utf8_lossy(&one).contains("shard.type"));
            }
        }
    }
}

#[test]
fn refusals_name_the_file_and_the_rule() {
    let dir = tempfile::tempdir().unwrap();
    let (sp, d) = (specs(), data(&specs()));
    let t = tensors(&sp, &d);
    // A single file next to shard files of the same base.
    let p = dir.path().join("m.sdnb");
    let mut o = opts(Format::Sharded);
    o.shard_size = Some(4 << 20);
    save(&p, &t, &o).unwrap();
    let err = save(&p, &t, &opts(Format::Sdnb)).unwrap_err().to_string();
    assert!(err.contains("shard files"), "{err}");
    // Not a container.
    let junk = dir.path().join("junk.bin");
    fs::write(&junk, b"hello world").unwrap();
    let err = open(&junk).unwrap_err().to_string();
    assert!(
        err.contains("junk.bin") && err.contains("not a SameDiff container"),
        "{err}"
    );
    let err = open(dir.path()).unwrap_err().to_string();
    assert!(err.contains("directory"), "{err}");
    let err = open(dir.path().join("absent.sdnb"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("absent"), "{err}");
    // Bad tensors.
    let bad = |dtype, shape: Vec<i64>, var_type, bytes: &'static [u8]| TensorIn {
        name: "x".into(),
        var_type,
        dtype,
        shape,
        order: Order::C,
        bytes,
    };
    for (tin, want) in [
        (
            bad(DType::Float, vec![1], VarType::Variable, &[0; 3]),
            "needs 4",
        ),
        (
            bad(DType::Utf8, vec![1], VarType::Variable, &[0; 3]),
            "cannot be stored",
        ),
        (
            bad(DType::Float, vec![-1], VarType::Variable, &[]),
            "negative",
        ),
        (
            bad(DType::Float, vec![0], VarType::Placeholder, &[]),
            "PLACEHOLDER",
        ),
    ] {
        let err = save(&dir.path().join("x.sdnb"), &[tin], &SaveOptions::default())
            .unwrap_err()
            .to_string();
        assert!(err.contains(want), "{err}");
    }
    assert!(!dir.path().join("x.sdnb").exists());
}

#[test]
fn a_model_without_arrays_is_shard0_of_1() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("e.sdnb");
    let o = SaveOptions {
        format: Format::Sharded,
        ..SaveOptions::default()
    };
    let files: Vec<PathBuf> = save(&p, &[], &o).unwrap();
    assert_eq!(files.len(), 1);
    assert!(files[0].ends_with("e.shard0-of-1.sdnb"));
    let c = open(&files[0]).unwrap();
    assert!(c.variables().is_empty());
}

#[test]
fn progress_counts_every_byte_written() {
    use std::sync::{Arc, Mutex};
    let dir = tempfile::tempdir().unwrap();
    let (sp, d) = (specs(), data(&specs()));
    for format in [Format::Sdnb, Format::Sharded, Format::Sdz] {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let sink = seen.clone();
        let mut o = opts(format);
        o.shard_size = (format != Format::Sdnb).then_some(2 << 20);
        o.progress = Some(Arc::new(move |done, total| {
            sink.lock().unwrap().push((done, total))
        }));
        let files = save(
            &dir.path().join(format!("p{format:?}.x")),
            &tensors(&sp, &d),
            &o,
        )
        .unwrap();
        let seen = seen.lock().unwrap();
        let (done, total) = *seen.last().unwrap();
        assert_eq!(done, total);
        assert!(seen.windows(2).all(|w| w[0].0 < w[1].0));
        if format != Format::Sdz {
            let on_disk: u64 = files.iter().map(|f| fs::metadata(f).unwrap().len()).sum();
            assert_eq!(total, on_disk, "{format:?}");
        }
    }
}
