//! shardkit's own changes to a dataset keep its checksums sidecar true: EAGLE-3 `set_version`
//! and target embeddings written into a finished cache, SDNB metadata edits (in place and by
//! rewrite, on single files, shard sets and archives), flat-tokens' completion marker, and
//! conversions into a directory that already holds another container (each output has its own
//! sidecar). Each check reads the whole `validate --deep` report, not just its verdict.

use std::path::{Path, PathBuf};

use shardkit::checksum::{self, Verdict};
use shardkit::eagle3::{self, synthetic_sample, Writer, WriterOptions};
use shardkit::json;
use shardkit::report::Validation;
use shardkit::sdnb::{self, DType, Format, Order, SaveOptions, TensorIn, VarType};
use shardkit::Error;

/// No errors, and the note that every block of `files` files matched.
fn assert_deep_valid(v: &Validation, files: usize) {
    let errors: Vec<String> = v.errors().map(ToString::to_string).collect();
    assert!(v.is_valid() && errors.is_empty(), "{errors:?}");
    let want = format!("checksums: {files} file(s)");
    assert!(
        v.notes()
            .any(|n| n.message.starts_with(&want) && n.message.ends_with("every block matches")),
        "{:?}",
        v.notes().map(ToString::to_string).collect::<Vec<_>>()
    );
}

fn intact(path: &Path) -> usize {
    match checksum::verify(path).unwrap() {
        Verdict::Intact { files, .. } => files,
        other => panic!("{}: {other:?}", path.display()),
    }
}

/// The sidecar's text has no `previous` entry (no change left in flight).
fn settled(sidecar: &Path) {
    let text = std::fs::read_to_string(sidecar).unwrap();
    assert!(!text.contains("previous"), "{text}");
}

fn eagle3_cache(dir: &Path, resume: bool) -> Writer {
    let config = json::parse(
        br#"{"target_model": "demo", "target_vocab_size": 8, "draft_vocab_size": 8,
            "seq_length": 4, "dtype": "fp32", "num_samples": 6, "shard_size": 4,
            "aux_hidden_dim": 6, "aux_layer_ids": [1, 2, 3],
            "selected_token_ids": [0, 1, 2, 3, 4, 5, 6, 7],
            "input_data": "demo", "split": null, "shuffle_seed": 1}"#,
    )
    .unwrap();
    let opts = WriterOptions {
        resume,
        ..WriterOptions::default()
    };
    let mut w = Writer::create(dir, &config, opts).unwrap();
    for i in w.resumed_from().unwrap_or(0)..6 {
        let fields = synthetic_sample(w.manifest(), i);
        let refs: Vec<(&str, &[u8])> = fields.iter().map(|(n, b)| (*n, b.as_slice())).collect();
        w.add(1, &refs).unwrap();
    }
    w
}

/// The README's EAGLE-3 steps: write, set-version 1 <-> 2, `validate --deep` valid each time.
#[test]
fn eagle3_set_version_keeps_the_sidecar_true() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("cache");
    eagle3_cache(&dir, false).finish().unwrap();
    let sidecar = dir.join(checksum::SIDECAR);
    let files = intact(&dir);
    assert_deep_valid(&eagle3::validate(&dir, true), files);
    let v1 = std::fs::read(dir.join("manifest.json")).unwrap();
    for version in [2u8, 1, 2, 2] {
        let m = eagle3::set_version(&dir, version).unwrap();
        assert_eq!(m.format_version, version);
        assert_deep_valid(&eagle3::validate(&dir, true), files);
        settled(&sidecar);
    }
    eagle3::set_version(&dir, 1).unwrap();
    assert_eq!(std::fs::read(dir.join("manifest.json")).unwrap(), v1);
    // The sidecar is the one a fresh `checksum` writes.
    let before = std::fs::read(&sidecar).unwrap();
    checksum::record(&dir).unwrap();
    assert_eq!(std::fs::read(&sidecar).unwrap(), before);
}

/// Embeddings written into a finished cache (a resumed writer) are covered before `finish`,
/// and a second write replaces them with the sidecar following.
#[test]
fn eagle3_embeddings_written_into_a_finished_cache_keep_the_sidecar_true() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("cache");
    eagle3_cache(&dir, false).finish().unwrap();
    let files = intact(&dir);
    let w = eagle3_cache(&dir, true);
    let emb: Vec<u8> = (0..8 * 2).flat_map(|i| (i as f32).to_le_bytes()).collect();
    w.write_target_embeddings(&emb, 8, 2).unwrap();
    assert_deep_valid(&eagle3::validate(&dir, true), files + 1);
    let emb2: Vec<u8> = (0..8 * 2)
        .flat_map(|i| (i as f32 * 0.5).to_le_bytes())
        .collect();
    w.write_target_embeddings(&emb2, 8, 2).unwrap();
    assert_deep_valid(&eagle3::validate(&dir, true), files + 1);
    settled(&dir.join(checksum::SIDECAR));
    w.finish().unwrap();
    assert_deep_valid(&eagle3::validate(&dir, true), files + 1);
}

fn tensors() -> (Vec<u8>, Vec<u8>) {
    let small: Vec<u8> = (0..64u32).flat_map(|i| (i as f32).to_le_bytes()).collect();
    // 2 MiB: an appended blob, so a shard set has several shards.
    let big: Vec<u8> = (0..1u32 << 19)
        .flat_map(|i| (i as f32).to_le_bytes())
        .collect();
    (small, big)
}

fn save(path: &Path, format: Format) -> Vec<PathBuf> {
    let (small, big) = tensors();
    let t = |name: &str, shape: Vec<i64>, bytes: &'static [u8]| TensorIn {
        name: name.into(),
        var_type: VarType::Variable,
        dtype: DType::Float,
        shape,
        order: Order::C,
        bytes,
    };
    let small: &'static [u8] = Box::leak(small.into_boxed_slice());
    let big: &'static [u8] = Box::leak(big.into_boxed_slice());
    let opts = SaveOptions {
        format,
        shard_size: (format == Format::Sharded).then_some(1 << 20),
        ..SaveOptions::default()
    };
    sdnb::save(
        path,
        &[t("w", vec![8, 8], small), t("big", vec![1 << 19], big)],
        &opts,
    )
    .unwrap()
}

/// `sdnb meta set` on a single file, a shard set (named by its base name and by a shard) and
/// an archive, in place and by rewrite: `validate --deep` stays valid, the sidecar settled.
#[test]
fn sdnb_metadata_edits_keep_the_sidecar_true() {
    for (format, name, sidecar) in [
        (Format::Sdnb, "m.sdnb", "m.sdnb.checksums.json"),
        (Format::Sharded, "m.sdnb", "m.shard-set.checksums.json"),
        (Format::Sdz, "m.sdz", "m.sdz.checksums.json"),
    ] {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join(name);
        let files = save(&path, format);
        assert!(tmp.path().join(sidecar).is_file(), "{format:?}");
        let n = files.len();
        assert_eq!(intact(&path), n, "{format:?}");
        for (i, rewrite) in [(0, false), (1, false), (2, true)] {
            // A shard set is edited through its base name and through its last shard.
            let target = if i == 1 {
                files[n - 1].clone()
            } else {
                path.clone()
            };
            // The rewrite's value does not fit the 64 KiB slack.
            let value = match rewrite {
                false => format!("MIT-{i}"),
                true => "x".repeat(100 << 10),
            };
            let changes = [("license".to_string(), Some(value.clone()))];
            let out = sdnb::set_metadata(&target, &changes, rewrite).unwrap();
            assert_eq!(out.in_place, !rewrite, "{format:?}");
            assert_eq!(
                sdnb::open(&path)
                    .unwrap()
                    .metadata()
                    .iter()
                    .find(|(k, _)| k == "license")
                    .map(|(_, v)| v.as_str()),
                Some(value.as_str())
            );
            // A rewrite cuts a shard set by the default shard size: fewer shards.
            let now = sdnb::open(&path).unwrap().files();
            assert_deep_valid(&sdnb::validate(&path, true), now.len());
            assert_deep_valid(&sdnb::validate(&now[now.len() - 1], true), now.len());
            settled(&tmp.path().join(sidecar));
        }
        // Only this container's sidecar is there (no second one, no old shared name).
        let sidecars: Vec<String> = std::fs::read_dir(tmp.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.ends_with(".checksums.json"))
            .collect();
        assert_eq!(sidecars, [sidecar], "{format:?}");
    }
}

/// An in-place edit first checks the blocks it rewrites: damage there refuses the edit (it
/// would record damaged bytes as good), naming the file and range; nothing changes.
#[test]
fn an_in_place_edit_of_a_damaged_graph_region_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("m.sdnb");
    save(&path, Format::Sdnb);
    let sidecar = tmp.path().join("m.sdnb.checksums.json");
    let sums = std::fs::read(&sidecar).unwrap();
    // A byte of the zero slack between the graph and the first blob (`big`, whose first
    // floats are 0, 1, 2, ...): the container still opens, but the block is damaged.
    let mut bytes = std::fs::read(&path).unwrap();
    let (_, big) = tensors();
    let blob = bytes
        .windows(64)
        .position(|w| w == &big[..64])
        .expect("the blob");
    let at = blob - 16;
    assert_eq!(bytes[at], 0, "a slack byte");
    bytes[at] = 1;
    std::fs::write(&path, &bytes).unwrap();
    sdnb::open(&path).unwrap();
    let changes = [("k".to_string(), Some("v".to_string()))];
    let e = sdnb::set_metadata(&path, &changes, false).unwrap_err();
    assert!(matches!(e, Error::Format { .. }), "{e:?}");
    let msg = e.to_string();
    assert!(
        msg.contains("m.sdnb")
            && msg.contains("bytes 0 to 1048575 do not match their checksum")
            && msg.contains("not changed"),
        "{msg}"
    );
    assert_eq!(std::fs::read(&path).unwrap(), bytes);
    assert_eq!(std::fs::read(&sidecar).unwrap(), sums);
}

/// Containers of one base in one directory each keep their own sidecar: converting m.sdnb to
/// m.sdz and to a shard set, then saving each again, leaves all of them intact.
#[test]
fn conversions_into_one_directory_keep_each_sidecar() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    save(&d.join("m.sdnb"), Format::Sdnb);
    let c = sdnb::open(d.join("m.sdnb")).unwrap();
    let sdz = SaveOptions {
        format: Format::Sdz,
        ..SaveOptions::default()
    };
    sdnb::convert(&c, &d.join("m.sdz"), &sdz).unwrap();
    // A shard set beside a single file of its base is ambiguous to open; beside the archive
    // it is not: a second directory holds the set and an archive of the same stem.
    let d2 = d.join("set");
    std::fs::create_dir(&d2).unwrap();
    let sharded = SaveOptions {
        format: Format::Sharded,
        shard_size: Some(1 << 20),
        ..SaveOptions::default()
    };
    let shards = sdnb::convert(&c, &d2.join("m.sdnb"), &sharded).unwrap();
    sdnb::convert(&c, &d2.join("m.sdz"), &sdz).unwrap();
    drop(c);
    for _ in 0..2 {
        assert_eq!(intact(&d.join("m.sdnb")), 1);
        assert_eq!(intact(&d.join("m.sdz")), 1);
        assert_eq!(intact(&d2.join("m.sdnb")), shards.len());
        assert_eq!(intact(&d2.join("m.sdz")), 1);
        for p in [
            d.join("m.sdnb"),
            d.join("m.sdz"),
            d2.join("m.sdnb"),
            d2.join("m.sdz"),
        ] {
            let n = sdnb::open(&p).unwrap().files().len();
            assert_deep_valid(&sdnb::validate(&p, true), n);
        }
        // Saving each again rewrites only its own sidecar.
        save(&d.join("m.sdz"), Format::Sdz);
        save(&d2.join("m.sdnb"), Format::Sharded);
    }
    for (dir, names) in [
        (d, vec!["m.sdnb.checksums.json", "m.sdz.checksums.json"]),
        (
            &d2,
            vec!["m.sdz.checksums.json", "m.shard-set.checksums.json"],
        ),
    ] {
        let mut got: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.ends_with(".checksums.json"))
            .collect();
        got.sort();
        assert_eq!(got, names);
    }
}

/// `verify` and `checksum` take every path `sdnb::open` takes: a shard set's base name (which
/// is no file), any shard, an archive.
#[test]
fn verify_and_checksum_take_a_shard_sets_base_name() {
    let tmp = tempfile::tempdir().unwrap();
    let base = tmp.path().join("model.sdnb");
    let files = save(&base, Format::Sharded);
    assert!(!base.exists() && files.len() >= 2);
    let sidecar = tmp.path().join("model.shard-set.checksums.json");
    std::fs::remove_file(&sidecar).unwrap();
    assert_eq!(checksum::verify(&base).unwrap(), Verdict::NoSidecar);
    let recorded = checksum::record(&base).unwrap();
    assert_eq!(recorded.sidecar, sidecar);
    assert_eq!(intact(&base), files.len());
    assert_eq!(intact(&tmp.path().join("model")), files.len());
    assert_eq!(intact(&files[1]), files.len());
    assert_eq!(recorded.files.len(), files.len());
    // A name that is neither a file nor a set's base: NotFound naming it.
    let e = checksum::verify(&tmp.path().join("none.sdnb")).unwrap_err();
    assert!(matches!(e, Error::NotFound { .. }), "{e:?}");
    assert!(e.to_string().contains("none.sdnb"), "{e}");
}

/// A sidecar under the name earlier versions gave every container of a base
/// (`BASE.checksums.json`) is still read for the container it covers, and only for it; the
/// next `checksum` (or save) replaces it with the container's own.
#[test]
fn sidecars_of_the_old_shared_name_are_still_read() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    save(&d.join("m.sdnb"), Format::Sdnb);
    save(&d.join("m.sdz"), Format::Sdz);
    std::fs::rename(d.join("m.sdnb.checksums.json"), d.join("m.checksums.json")).unwrap();
    std::fs::remove_file(d.join("m.sdz.checksums.json")).unwrap();
    assert_eq!(intact(&d.join("m.sdnb")), 1);
    assert_deep_valid(&sdnb::validate(d.join("m.sdnb"), true), 1);
    // It covers m.sdnb, not m.sdz: the archive has no sidecar.
    assert_eq!(
        checksum::verify(&d.join("m.sdz")).unwrap(),
        Verdict::NoSidecar
    );
    // An in-place edit keeps the old-named sidecar true.
    let changes = [("k".to_string(), Some("v".to_string()))];
    assert!(
        sdnb::set_metadata(&d.join("m.sdnb"), &changes, false)
            .unwrap()
            .in_place
    );
    assert_eq!(intact(&d.join("m.sdnb")), 1);
    settled(&d.join("m.checksums.json"));
    // Recording the archive leaves it alone; recording m.sdnb moves it to the new name.
    checksum::record(&d.join("m.sdz")).unwrap();
    assert!(d.join("m.checksums.json").is_file());
    checksum::record(&d.join("m.sdnb")).unwrap();
    assert!(!d.join("m.checksums.json").exists());
    assert_eq!(intact(&d.join("m.sdnb")), 1);
    assert_eq!(intact(&d.join("m.sdz")), 1);
    // A shard set's old-named sidecar too, and saving the set again replaces it.
    let set = d.join("s.sdnb");
    let files = save(&set, Format::Sharded);
    std::fs::rename(
        d.join("s.shard-set.checksums.json"),
        d.join("s.checksums.json"),
    )
    .unwrap();
    assert_eq!(intact(&set), files.len());
    save(&set, Format::Sharded);
    assert!(!d.join("s.checksums.json").exists());
    assert_eq!(intact(&set), files.len());
}

/// flat-tokens: marking seqax data complete rewrites the root's attributes, which the sidecar
/// covers (v2 `.zattrs`; v3 `zarr.json`, byte-identical to what zarrs writes).
#[cfg(feature = "zarr")]
#[test]
fn flat_tokens_mark_complete_keeps_the_sidecar_true() {
    use shardkit::flat_tokens::{self, mark_complete, Completion, Layout, Split, WriterOptions};
    let tmp = tempfile::tempdir().unwrap();
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../../shared/fixtures/flat_tokens/seqax_synthetic_dataset.zarr");
    let seqax = tmp.path().join("seqax.zarr");
    copy_dir(&fixture, &seqax);
    checksum::record(&seqax).unwrap();
    let files = intact(&seqax);
    assert_eq!(
        Split::open(&seqax, "train").unwrap().info().completion,
        Completion::Unmarked
    );
    // seqax writes no root .zattrs: the marker creates it, and the sidecar covers it.
    assert!(!seqax.join(".zattrs").exists());
    mark_complete(&seqax).unwrap();
    assert!(
        Split::open(&seqax, "train").unwrap().info().completion
            == shardkit::flat_tokens::Completion::Complete
    );
    let mut v = flat_tokens::validate(&seqax);
    checksum::verify_into(&seqax, &mut v);
    assert_deep_valid(&v, files + 1);
    settled(&seqax.join(checksum::SIDECAR));

    // v3: a dataset whose marker was dropped (as another writer would leave it).
    let v3 = tmp.path().join("v3.zarr");
    let opts = WriterOptions {
        layout: Some(Layout::V3(Default::default())),
        ..WriterOptions::default()
    };
    let mut w = flat_tokens::Writer::create(&v3, "train", opts).unwrap();
    w.append(&[vec![1u32, 2, 3], vec![4, 5]]).unwrap();
    w.finish().unwrap();
    let text = std::fs::read_to_string(v3.join("zarr.json")).unwrap();
    // Another attribute in its place keeps the document's shape.
    let unmarked = text.replace("\"write_completed\": true", "\"other\": true");
    assert_ne!(unmarked, text);
    std::fs::write(v3.join("zarr.json"), &unmarked).unwrap();
    checksum::record(&v3).unwrap();
    let files = intact(&v3);
    mark_complete(&v3).unwrap();
    let want = text.replace(
        "\"write_completed\": true",
        "\"other\": true,\n    \"write_completed\": true",
    );
    assert_eq!(std::fs::read_to_string(v3.join("zarr.json")).unwrap(), want);
    assert_eq!(intact(&v3), files);
    settled(&v3.join(checksum::SIDECAR));
}

#[cfg(feature = "zarr")]
fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        if e.file_type().unwrap().is_dir() {
            copy_dir(&e.path(), &to.join(e.file_name()));
        } else {
            std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
        }
    }
}

/// The crash-safe order of a change, from fsutil's durability trace (only this test's
/// directory): the sidecar accepting both states is renamed into place (and its directory
/// synced) before the data changes; the data is durable (renamed and its directory synced, or
/// fsynced in place) before the sidecar with the new state alone is renamed into place.
#[test]
fn changes_make_the_sidecar_accept_both_states_before_the_data_changes() {
    use shardkit::internals::trace::{self, Event};
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("cache");
    eagle3_cache(&dir, false).finish().unwrap();
    let model = tmp.path().join("m.sdnb");
    save(&model, Format::Sdnb);
    let here = |events: Vec<Event>| -> Vec<Event> {
        events
            .into_iter()
            .filter(|e| match e {
                Event::SyncFile(p) | Event::SyncDir(p) => p.starts_with(tmp.path()),
                Event::Rename { to, .. } => to.starts_with(tmp.path()),
            })
            .collect()
    };
    let renamed = |e: &Event, name: &str| matches!(e, Event::Rename { to, .. } if to.file_name().is_some_and(|n| n == name));
    let at = |events: &[Event], f: &dyn Fn(&Event) -> bool| -> Vec<usize> {
        events
            .iter()
            .enumerate()
            .filter(|(_, e)| f(e))
            .map(|(i, _)| i)
            .collect()
    };
    let synced_dir = |events: &[Event], after: usize, before: usize, d: &Path| {
        events[after..before]
            .iter()
            .any(|e| matches!(e, Event::SyncDir(x) if x == d))
    };

    trace::start();
    eagle3::set_version(&dir, 2).unwrap();
    let events = here(trace::take());
    let sidecar = at(&events, &|e| renamed(e, checksum::SIDECAR));
    let manifest = at(&events, &|e| renamed(e, "manifest.json"));
    assert_eq!((sidecar.len(), manifest.len()), (2, 1), "{events:#?}");
    assert!(
        sidecar[0] < manifest[0] && manifest[0] < sidecar[1],
        "{events:#?}"
    );
    assert!(
        synced_dir(&events, sidecar[0], manifest[0], &dir),
        "{events:#?}"
    );
    assert!(
        synced_dir(&events, manifest[0], sidecar[1], &dir),
        "{events:#?}"
    );

    trace::start();
    let changes = [("license".to_string(), Some("MIT".to_string()))];
    assert!(
        sdnb::set_metadata(&model, &changes, false)
            .unwrap()
            .in_place
    );
    let events = here(trace::take());
    let sidecar = at(&events, &|e| renamed(e, "m.sdnb.checksums.json"));
    let data = at(&events, &|e| matches!(e, Event::SyncFile(p) if *p == model));
    assert_eq!((sidecar.len(), data.len()), (2, 1), "{events:#?}");
    assert!(sidecar[0] < data[0] && data[0] < sidecar[1], "{events:#?}");
    assert!(
        synced_dir(&events, sidecar[0], data[0], tmp.path()),
        "{events:#?}"
    );
}
