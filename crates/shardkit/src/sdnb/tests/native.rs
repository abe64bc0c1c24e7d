//! Deeplearning4j's native runtime (ADR 0073): the default SDZ layout checked field by field
//! against what libnd4j's SdzReader/SdnbReader need, validate's notes on archives it would not
//! load, and bundle manifests (docs/sdnb.md "Deeplearning4j's native runtime").

use std::io::Read;

use super::*;
use crate::sdnb::sdz::ZipWriter;

fn u16_at(b: &[u8], o: usize) -> u16 {
    u16::from_le_bytes([b[o], b[o + 1]])
}

fn u32_at(b: &[u8], o: usize) -> u32 {
    u32::from_le_bytes(b[o..o + 4].try_into().unwrap())
}

/// The extra records of an extra field, as (id, data length).
fn records(extra: &[u8]) -> Vec<(u16, usize)> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < extra.len() {
        assert!(i + 4 <= extra.len(), "truncated extra record");
        let (id, len) = (u16_at(extra, i), u16_at(extra, i + 2) as usize);
        assert!(
            i + 4 + len <= extra.len(),
            "extra record overruns its field"
        );
        out.push((id, len));
        i += 4 + len;
    }
    out
}

/// Tensors the native reader maps exactly: C order, dtypes it knows, three of them appended.
fn native_tensors() -> Vec<T> {
    vec![
        t("w", DType::Float, &[3, 5], Order::C),
        t("h", DType::Half, &[7], Order::C),
        t("ids", DType::Int64, &[4], Order::C),
        t("mask", DType::Bool, &[9], Order::C),
        t("empty", DType::Float, &[0, 4], Order::C),
        t("big", DType::Uint16, &[560_000], Order::C),
        t("big2", DType::Float, &[300_000], Order::C),
        t("big3", DType::Bfloat16, &[600_000], Order::C),
    ]
}

const NOTHING: &str = "native runtime: nothing found that keeps Deeplearning4j's native runtime \
                       (sdxLoadBundle) from loading it";

fn native_notes(p: &Path) -> Vec<String> {
    let v = sdnb::validate(p, false);
    assert!(v.is_valid(), "{:?}", v.findings);
    v.notes()
        .map(|f| f.message.clone())
        .filter(|m| m.starts_with("native runtime:"))
        .collect()
}

/// Every property libnd4j's SdzReader relies on, checked on the raw bytes of an archive
/// shardkit writes by default, single and sharded, with an extra entry.
#[test]
fn default_sdz_is_what_the_native_reader_needs_entry_by_entry() {
    let dir = tempfile::tempdir().unwrap();
    let ts = native_tensors();
    for shard_size in [None, Some(1 << 20)] {
        let p = dir.path().join("m.sdz");
        let mut o = save_opts(Format::Sdz, shard_size, 4096);
        o.extra_entries = vec![("tokenizer.json".into(), b"{}".to_vec())];
        sdnb::save(&p, &tensor_ins(&ts), &o).unwrap();
        let b = fs::read(&p).unwrap();
        // The end record: the first signature a backward scan from len - 22 meets, no comment,
        // no ZIP64 locator before it, no saturated field.
        let eocd = (0..=b.len() - 22)
            .rev()
            .find(|&i| u32_at(&b, i) == 0x0605_4b50)
            .unwrap();
        assert_eq!(eocd, b.len() - 22, "no comment after the end record");
        assert_ne!(u32_at(&b, eocd - 20), 0x0706_4b50, "no ZIP64 locator");
        let (count, cd_size, cd_at) = (
            u16_at(&b, eocd + 10),
            u32_at(&b, eocd + 12),
            u32_at(&b, eocd + 16),
        );
        assert_eq!(u16_at(&b, eocd + 8), count, "one disk");
        assert!(count < 0xFFFF && cd_size != u32::MAX && cd_at != u32::MAX);
        assert_eq!(
            cd_at as usize + cd_size as usize,
            eocd,
            "the directory ends at the end record"
        );
        // The central directory, walked the native way (46 + name + extra + comment).
        let mut o = cd_at as usize;
        let mut names = Vec::new();
        let mut last_local = None;
        for _ in 0..count {
            assert_eq!(u32_at(&b, o), 0x0201_4b50);
            let flags = u16_at(&b, o + 8);
            let (method, crc) = (u16_at(&b, o + 10), u32_at(&b, o + 16));
            let (csize, size) = (u32_at(&b, o + 20), u32_at(&b, o + 24));
            let (nlen, elen, clen) = (
                u16_at(&b, o + 28) as usize,
                u16_at(&b, o + 30) as usize,
                u16_at(&b, o + 32) as usize,
            );
            let local = u32_at(&b, o + 42) as usize;
            let name = String::from_utf8(b[o + 46..o + 46 + nlen].to_vec()).unwrap();
            assert_eq!(flags & 0x9, 0, "{name}: not encrypted, no data descriptor");
            assert_eq!(method, 0, "{name}: STORED");
            assert_eq!(csize, size, "{name}: STORED sizes agree");
            assert!(
                csize != u32::MAX && local != u32::MAX as usize,
                "{name}: no saturated field"
            );
            assert_eq!(
                (elen, clen),
                (0, 0),
                "{name}: no central extra field or comment"
            );
            assert!(last_local < Some(local), "{name}: entries in file order");
            last_local = Some(local);
            // The local header: what the central directory says, and the data where
            // local + 30 + the local name and extra lengths put it.
            assert_eq!(u32_at(&b, local), 0x0403_4b50, "{name}");
            assert_eq!(u16_at(&b, local + 6) & 0x9, 0, "{name}");
            assert_eq!(u16_at(&b, local + 8), 0, "{name}: local STORED");
            assert_eq!(
                (
                    u32_at(&b, local + 14),
                    u32_at(&b, local + 18),
                    u32_at(&b, local + 22)
                ),
                (crc, csize, size),
                "{name}: CRC-32 and sizes in the local header"
            );
            let (ln, le) = (
                u16_at(&b, local + 26) as usize,
                u16_at(&b, local + 28) as usize,
            );
            assert_eq!(&b[local + 30..local + 30 + ln], name.as_bytes());
            let extra = &b[local + 30 + ln..local + 30 + ln + le];
            let recs = records(extra);
            assert_eq!(recs.len(), 1, "{name}: one extra record");
            assert_eq!(
                recs[0].0,
                sdz::ALIGN_EXTRA_ID,
                "{name}: the alignment record only"
            );
            let data_at = local + 30 + ln + le;
            assert_eq!(data_at % 64, 0, "{name}: data aligned");
            let data = &b[data_at..data_at + size as usize];
            assert_eq!(crc32fast::hash(data), crc, "{name}: CRC-32 of the data");
            if name.ends_with(".sdnb") {
                assert_eq!(&data[..4], b"SDNB", "{name}");
                // SdnbReader: the blob section counted back from M gives the real B.
                let h = Header::parse(data, data.len() as u64, Path::new(&name)).unwrap();
                assert_eq!(h.manifest_offset + h.manifest_len, size as u64);
            }
            names.push(name);
            o += 46 + nlen + elen + clen;
        }
        assert_eq!(o, eocd);
        let model: Vec<&String> = names.iter().filter(|n| n.ends_with(".sdnb")).collect();
        match shard_size {
            None => assert_eq!(names, ["model.sdnb", "tokenizer.json"]),
            Some(_) => {
                let n = model.len();
                assert!(n >= 3, "{names:?}");
                let want: Vec<String> = (0..n)
                    .map(|i| format!("model.shard{i}-of-{n}.sdnb"))
                    .collect();
                assert_eq!(
                    model,
                    want.iter().collect::<Vec<_>>(),
                    "graph shard first, then in order"
                );
                assert_eq!(names.last().unwrap(), "tokenizer.json");
            }
        }
        // The blobs end at M in every part, and a stub (not only the manifest) locates each.
        let c = sdnb::open(&p).unwrap();
        for (part, l) in c.parts.iter().zip(c.layout()) {
            let ends: Vec<u64> = part
                .graph
                .variables
                .iter()
                .filter_map(|v| v.array.as_ref())
                .filter(|a| a.appended_length > 0)
                .map(|a| l.blob_start + (a.appended_offset + a.appended_length) as u64)
                .collect();
            assert_eq!(ends.len(), part.manifest.len(), "{:?}", l.name);
            if let Some(&end) = ends.iter().max() {
                assert_eq!(end, l.manifest_offset, "{:?}", l.name);
            }
            assert!(part.graph.has_nodes, "{:?}: a nodes vector", l.name);
        }
        assert_eq!(native_notes(&p), [NOTHING]);
        fs::remove_file(&p).unwrap();
    }
    // A single file written by default needs nothing either.
    let p = dir.path().join("m.sdnb");
    sdnb::save(&p, &tensor_ins(&ts), &save_opts(Format::Sdnb, None, 0)).unwrap();
    assert_eq!(native_notes(&p), [NOTHING]);
}

/// The bytes of each entry of the archive at `p`, in archive order.
fn entries_of(p: &Path) -> Vec<(String, Vec<u8>)> {
    let mut z = zip::ZipArchive::new(fs::File::open(p).unwrap()).unwrap();
    (0..z.len())
        .map(|i| {
            let mut e = z.by_index(i).unwrap();
            let mut v = Vec::new();
            e.read_to_end(&mut v).unwrap();
            (e.name().to_string(), v)
        })
        .collect()
}

fn write(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let p = dir.join(name);
    fs::write(&p, bytes).unwrap();
    p
}

#[test]
fn validate_notes_what_the_native_reader_would_refuse() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let ts = native_tensors();
    let single = d.join("single.sdnb");
    sdnb::save(&single, &tensor_ins(&ts), &save_opts(Format::Sdnb, None, 0)).unwrap();
    let model = fs::read(&single).unwrap();

    // Java's SDZSerializer layout: entry `model`.
    let p = write(d, "java.sdz", &zip_of(&[stored(b"model", &model)]));
    assert_eq!(
        native_notes(&p),
        [
            "native runtime: model entry \"model\" does not end in .sdnb; Deeplearning4j's native \
          SdzReader skips it (only its newest revision reads \"model\"); shardkit names entries \
          model.sdnb or model.shard<i>-of-<N>.sdnb"
        ]
    );
    // The older writer's DEFLATE.
    let p = write(
        d,
        "deflate.sdz",
        &zip_of(&[deflated(b"model.sdnb", &model)]),
    );
    assert_eq!(
        native_notes(&p),
        [
            "native runtime: model entry \"model.sdnb\" is DEFLATE-compressed; Deeplearning4j's \
          native SdzReader inflates only when built with zlib, and its strict (file-backed) mode \
          refuses it; shardkit writes STORED entries"
        ]
    );
    // ZIP64 records where none were needed.
    let p = d.join("zip64.sdz");
    let mut w = ZipWriter::new(fs::File::create(&p).unwrap(), &p, 64);
    w.force_zip64(true);
    w.add_stored("model.sdnb", &model).unwrap();
    w.finish().unwrap();
    assert_eq!(
        native_notes(&p),
        [
            "native runtime: the archive has ZIP64 records (the end record defers to a ZIP64 end \
          record); Deeplearning4j's \
          native SdzReader reads only the 32-bit ZIP fields (ZIP64 only in its newest revision). \
          shardkit writes ZIP64 only past 4 GiB per entry or archive"
        ]
    );
    // A stray .sdnb entry the native reader would merge into the model.
    let p = write(
        d,
        "stray.sdz",
        &zip_of(&[
            stored(b"model.sdnb", &model),
            stored(b"backup.sdnb", &model),
        ]),
    );
    assert_eq!(
        native_notes(&p),
        [
            "native runtime: entry \"backup.sdnb\" is not part of the model, but Deeplearning4j's \
          native SdzReader merges the variables of every .sdnb entry into it"
        ]
    );
    // A sharded archive with the graph shard last.
    let sharded = d.join("sharded.sdz");
    sdnb::save(
        &sharded,
        &tensor_ins(&ts),
        &save_opts(Format::Sdz, Some(1 << 20), 0),
    )
    .unwrap();
    let mut es = entries_of(&sharded);
    assert!(es.len() >= 3 && es[0].0.starts_with("model.shard0-of-"));
    es.rotate_left(1);
    let zs: Vec<ZipIn> = es.iter().map(|(n, b)| stored(n.as_bytes(), b)).collect();
    let p = write(d, "graph-last.sdz", &zip_of(&zs));
    assert_eq!(
        sdnb::open(&p).unwrap().variables().len(),
        ts.len(),
        "shardkit still reads it"
    );
    assert_eq!(
        native_notes(&p),
        [format!(
            "native runtime: the graph entry {:?} is not the archive's first .sdnb entry ({:?} \
             is); Deeplearning4j's native SdzReader takes the graph from the first entry",
            es.last().unwrap().0,
            es[0].0
        )]
    );
    // A shard set on disk: the runtime loads one file.
    let set = d.join("set.sdnb");
    let files = sdnb::save(
        &set,
        &tensor_ins(&ts),
        &save_opts(Format::Sharded, Some(1 << 20), 0),
    )
    .unwrap();
    assert_eq!(
        native_notes(&set),
        [format!(
            "native runtime: a shard set is {} files, and Deeplearning4j's native runtime loads \
             one .sdnb or .sdz file (given a shard, that shard alone); write the set as an SDZ \
             (`shardkit sdnb convert SET OUT.sdz --shard-size ...`)",
            files.len()
        )]
    );
}

#[test]
fn validate_notes_sdnb_contents_the_native_reader_misreads() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    // 'f' order and a dtype the native reader does not map.
    let ts = vec![
        t("w", DType::Float, &[3, 5], Order::F),
        t("f8", DType::Float8, &[4], Order::C),
        t("ok", DType::Float, &[2], Order::C),
    ];
    let p = d.join("odd.sdnb");
    sdnb::save(&p, &tensor_ins(&ts), &save_opts(Format::Sdnb, None, 0)).unwrap();
    assert_eq!(
        native_notes(&p),
        [
            "native runtime: variable \"w\" is stored in 'f' order; Deeplearning4j's native \
             SdnbReader reads every array in 'c' order",
            "native runtime: variable \"f8\" is FLOAT8, which Deeplearning4j's native SdnbReader \
             reads as FLOAT32",
        ]
    );
    // A gap between the last blob and the manifest: Java and shardkit use the manifest's
    // absolute offsets, the native reader counts back from M.
    let p = d.join("gap.sdnb");
    sdnb::save(
        &p,
        &tensor_ins(&[big_tensor()]),
        &save_opts(Format::Sdnb, None, 0),
    )
    .unwrap();
    let mut b = fs::read(&p).unwrap();
    let h = Header::parse(&b, b.len() as u64, &p).unwrap();
    let m = h.manifest_offset as usize;
    b.splice(m..m, [0u8; 64]);
    let moved = Header {
        manifest_offset: h.manifest_offset + 64,
        manifest_len: h.manifest_len,
    };
    b[..32].copy_from_slice(&moved.to_bytes());
    fs::write(&p, &b).unwrap();
    assert_eq!(
        native_notes(&p),
        [format!(
            "native runtime: the last blob ends at byte {m}, not where the manifest starts (byte \
             {}); Deeplearning4j's native SdnbReader counts the blob section back from the \
             manifest and would read every appended tensor from the wrong offset",
            m + 64
        )]
    );
    // No nodes vector.
    let g = flat_graph(&GraphSpec {
        vars: Vec::new(),
        metadata: forced_metadata(),
        rich: false,
        nesting: 0,
    });
    let p = write(d, "no-nodes.sdnb", &sdnb_bytes(&g, 0, &[]));
    assert_eq!(
        native_notes(&p),
        ["native runtime: the FlatGraph has no nodes vector; Deeplearning4j's native SdnbReader \
          refuses such a graph (in an archive it drops the entry and its variables)"]
    );
}

#[test]
fn extra_entries_that_loaders_would_take_for_the_model_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let ts = native_tensors();
    for (name, data) in [
        ("weights.sdnb", b"{}".to_vec()),
        ("W.SDNB", b"{}".to_vec()),
        ("model", b"{}".to_vec()),
        ("w.bin", b"SDNB and more".to_vec()),
    ] {
        let p = dir.path().join("m.sdz");
        let mut o = save_opts(Format::Sdz, None, 0);
        o.extra_entries = vec![(name.into(), data)];
        let e = sdnb::save(&p, &tensor_ins(&ts), &o)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(&format!(
                "extra entry {name:?} would be taken for part of the model"
            )),
            "{e}"
        );
        assert!(!p.exists());
    }
}

#[test]
fn bundles_are_written_read_and_checked() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let ts = native_tensors();
    let p = d.join("m.sdz");
    let mut o = save_opts(Format::Sdz, None, 0);
    o.bundle = true;
    assert_eq!(
        sdnb::save(&p, &tensor_ins(&ts), &o).unwrap(),
        std::slice::from_ref(&p)
    );
    let manifest = d.join("manifest.json");
    assert_eq!(
        fs::read_to_string(&manifest).unwrap(),
        "{\n  \"modelPath\": \"m.sdz\"\n}\n"
    );
    for via in [d.to_path_buf(), manifest.clone()] {
        let c = sdnb::open(&via).unwrap();
        assert_eq!(
            (c.path(), c.bundle_manifest()),
            (p.as_path(), Some(manifest.as_path()))
        );
        assert!(c.tensor("big").unwrap().bytes == &ts[5].bytes[..]);
        let v = sdnb::validate(&via, true);
        assert!(v.is_valid(), "{:?}", v.findings);
        let notes: Vec<String> = v.notes().map(|f| f.to_string()).collect();
        assert!(
            notes.contains(&format!(
                "{}: bundle manifest: modelPath is {}",
                manifest.display(),
                p.display()
            )),
            "{notes:?}"
        );
        assert!(
            notes.contains(&format!("{}: {NOTHING}", p.display())),
            "{notes:?}"
        );
    }
    // The runtime's other model keys.
    fs::write(&manifest, r#"{"graphPath": "m.sdz", "gpuTarget": "cuda"}"#).unwrap();
    assert_eq!(sdnb::open(d).unwrap().path(), p);
    // A bundle needs one file the runtime dispatches by extension.
    for (name, format) in [("s.sdnb", Format::Sharded), ("m.bin", Format::Sdnb)] {
        let mut o = save_opts(format, None, 0);
        o.bundle = true;
        let e = sdnb::save(&d.join(name), &tensor_ins(&ts), &o)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("a bundle's model is one file named *.sdz or *.sdnb"),
            "{e}"
        );
    }
    // Malformed manifests: an error naming the manifest and the rule.
    let outside = tempfile::tempdir().unwrap();
    fs::copy(&p, outside.path().join("o.sdz")).unwrap();
    std::os::unix::fs::symlink(outside.path().join("o.sdz"), d.join("link.sdz")).unwrap();
    let cases: &[(&str, &str)] = &[
        ("{", "bundle manifest: not valid JSON"),
        ("[]", "bundle manifest: the top level must be a JSON object"),
        (
            "{}",
            "bundle manifest: no \"modelPath\" (nor \"graphPath\" or \"modelFile\")",
        ),
        (
            r#"{"modelPath": 3}"#,
            "bundle manifest: \"modelPath\" must be a string",
        ),
        (
            r#"{"modelPath": "../m.sdz"}"#,
            "\"modelPath\" \"../m.sdz\" has a `..` segment",
        ),
        (
            r#"{"modelPath": "/tmp/m.sdz"}"#,
            "\"modelPath\" \"/tmp/m.sdz\" is absolute",
        ),
        (
            r#"{"modelPath": "none.sdz"}"#,
            "\"modelPath\" \"none.sdz\" names no file",
        ),
        (
            r#"{"modelPath": "link.sdz"}"#,
            "\"modelPath\" \"link.sdz\" leaves the bundle directory",
        ),
        (
            r#"{"modelPath": "m.sdz", "x": {"modelPath": "y"}}"#,
            "\"modelPath\" occurs more than once",
        ),
        (
            r#"{"x": {"modelPath": "m.sdz"}}"#,
            "\"modelPath\" appears below the top level",
        ),
        (
            r#"{"model\u0050ath": "m.sdz"}"#,
            "\"modelPath\" is written with escapes",
        ),
        (
            r#"{"modelPath": "m.sdz", "gpuTarget": "TPU"}"#,
            "\"gpuTarget\" \"TPU\" is not one the runtime accepts",
        ),
        (
            r#"{"modelPath": "m.sdz", "tokenizerPath": "tok.json"}"#,
            "\"tokenizerPath\" \"tok.json\" names no file",
        ),
    ];
    for (text, rule) in cases {
        fs::write(&manifest, text).unwrap();
        for via in [d, manifest.as_path()] {
            let e = sdnb::open(via).unwrap_err();
            assert_eq!(e.path(), Some(manifest.as_path()), "{text}: {e}");
            assert!(e.to_string().contains(rule), "{text}: {e}");
            assert!(!sdnb::validate(via, false).is_valid());
        }
    }
    fs::remove_file(&manifest).unwrap();
    let e = sdnb::open(d).unwrap_err().to_string();
    assert!(e.contains("is a directory without manifest.json"), "{e}");
}
