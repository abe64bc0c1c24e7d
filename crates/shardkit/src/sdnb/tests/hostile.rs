//! Named hostile inputs, refused by the check that names the violated limit.

use super::*;

// ---- Named hostile inputs ----

fn write(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let p = dir.join(name);
    fs::write(&p, bytes).unwrap();
    p
}

/// `open` must fail with little heap, naming the file and saying `needle` (the check that
/// refused it).
fn refused(p: &Path, needle: &str) {
    let (r, heap) = measured(|| sdnb::open(p));
    let e = r.expect_err("opened a hostile file");
    named(&e, &[p]).unwrap();
    assert!(e.to_string().contains(needle), "{e} (expected {needle:?})");
    assert!(heap < 4 * MIB, "{heap} bytes of heap to refuse: {e}");
}

fn small_sdnb() -> Vec<u8> {
    let tmp = tempfile::tempdir().unwrap();
    let p = tmp.path().join("s.sdnb");
    sdnb::save(
        &p,
        &tensor_ins(&small_tensors()),
        &save_opts(Format::Sdnb, None, 64),
    )
    .unwrap();
    fs::read(p).unwrap()
}

fn set_be(b: &mut [u8], at: usize, v: &[u8]) {
    b[at..at + v.len()].copy_from_slice(v);
}

#[test]
fn manifest_counts_of_2_pow_31_fail_fast() {
    let good = manifest::encode(&[]);
    let size_at = rfind(&good, &[0x77, 0x08]).unwrap() + 6;
    for count in [0x7FFF_FFFFu32, 0x8000_0000, 0xFFFF_FFFF, 1 << 24] {
        let mut b = good.clone();
        set_be(&mut b, size_at, &count.to_be_bytes());
        // Even with room for many entries after it.
        b.resize(b.len() + 4096, 0x71);
        let (r, heap) = measured(|| manifest::decode(&b, Path::new(P), usize::MAX));
        let e = r.unwrap_err();
        named(&e, &[Path::new(P)]).unwrap();
        // Refused by the count check before the first entry is decoded: its message gives the
        // claimed count (as Java's signed int) against what the remaining bytes can hold.
        let claimed = format!("{} entries (at most", count as i32);
        assert!(
            e.to_string().contains(&claimed) && e.to_string().contains("fit the remaining bytes"),
            "{e} (expected {claimed:?})"
        );
        assert!(heap < MIB, "{heap} bytes");
    }
    // A long-string key claiming 2^62 bytes.
    let mut b = manifest::encode(&[Entry {
        name: "k".into(),
        offset: 64,
        length: 8,
    }]);
    let at = rfind(&b, &[0x74, 0x00, 0x01, b'k']).unwrap();
    b.splice(at..at + 3, [0x7C, 0x40, 0, 0, 0, 0, 0, 0, 1]);
    let (r, heap) = measured(|| manifest::decode(&b, Path::new(P), 10));
    assert!(r.unwrap_err().to_string().contains("truncated"));
    assert!(heap < MIB);

    // In a file: the manifest's entry count, and the header's manifest length.
    let tmp = tempfile::tempdir().unwrap();
    let f = small_sdnb();
    let m = u64::from_be_bytes(f[8..16].try_into().unwrap()) as usize;
    let mut big_count = f.clone();
    set_be(&mut big_count, m + size_at, &0x8000_0000u32.to_be_bytes());
    refused(&write(tmp.path(), "count.sdnb", &big_count), "entries");
    let mut big_count = f.clone();
    set_be(&mut big_count, m + size_at, &0x7FFF_FFFFu32.to_be_bytes());
    refused(&write(tmp.path(), "count2.sdnb", &big_count), "entries");
    let mut big_len = f.clone();
    set_be(&mut big_len, 16, &(1u64 << 31).to_be_bytes());
    refused(&write(tmp.path(), "len.sdnb", &big_len), "outside the file");

    // A sparse 300 MiB file whose header really does claim a 300 MiB manifest: over the cap,
    // refused without reading it.
    let p = tmp.path().join("sparse.sdnb");
    let len = 300u64 << 20;
    let file = fs::File::create(&p).unwrap();
    file.set_len(len).unwrap();
    let h = Header {
        manifest_offset: 32,
        manifest_len: len - 32,
    };
    std::os::unix::fs::FileExt::write_all_at(&file, &h.to_bytes(), 0).unwrap();
    drop(file);
    let before = cached_bytes(&p);
    refused(&p, "exceeds the cap");
    // What `open` read of the file: the header's page and some read-ahead, not the manifest.
    let read = cached_bytes(&p).saturating_sub(before);
    assert!(
        read < MIB as u64,
        "{read} bytes of a file claiming a {} MiB manifest read to refuse it",
        len >> 20
    );
}

#[test]
fn self_referencing_and_oversized_flatbuffer_offsets() {
    let le = |v: u32| v.to_le_bytes();
    let mut cases: Vec<(&str, Vec<u8>)> = vec![
        ("empty", vec![]),
        // All zeros: the root is an empty table that is its own vtable (valid, no variables).
        ("root at itself", vec![0; 16]),
        ("root past the end", [le(0xFFFF_FFFF), le(0)].concat()),
        (
            "root at its own offset, vtable at itself",
            [le(0), le(0)].concat(),
        ),
        // Root table at 8 whose soffset points back to a vtable at 4 that claims 65535 bytes.
        ("huge vtable", [le(8), [0xFF, 0xFF, 8, 0], le(4)].concat()),
        // Root table at 8, vtable below 0.
        (
            "vtable before 0",
            [le(8), le(0), le(0x7FFF_FFF0), le(0)].concat(),
        ),
        // Root table at 8, vtable after the end (negative soffset).
        (
            "vtable after the end",
            [le(8), le(0), le(-64i32 as u32), le(0)].concat(),
        ),
    ];
    // A vtable (at 4) whose variables slot points at a vector claiming 2^32 − 1 elements, and
    // one whose field offsets point back at the table itself.
    let mut v = Vec::new();
    v.extend(le(12)); // root at 12
    v.extend([8, 0, 12, 0]); // vtable at 4: 8 bytes, table of 12
    v.extend([0, 0, 8, 0]); // slot 0 (id) absent, slot 1 (variables) at +8
    v.extend(le(8)); // table at 12: soffset 8 → vtable at 4
    v.extend(le(0)); // padding
    v.extend(le(4)); // variables at 20 + 4 = 24
    v.extend(le(0xFFFF_FFFF)); // vector length
    cases.push(("vector of 2^32 − 1 tables", v.clone()));
    let mut self_ref = v.clone();
    let n = self_ref.len();
    self_ref[n - 8..n - 4].copy_from_slice(&le(0)); // the uoffset points at itself
    cases.push(("uoffset 0: a field that is its own target", self_ref));
    let mut back = v;
    back[n - 4..].copy_from_slice(&le(1)); // a vector of one table …
    back.extend(le(0xFFFF_FFF0)); // … whose uoffset wraps around
    cases.push(("wrapping uoffset", back));
    for (what, region) in &cases {
        let (r, heap) =
            measured(|| catch_unwind(AssertUnwindSafe(|| Graph::parse(region, Path::new(P)))));
        // A zero uoffset makes an empty vector of itself: valid. Everything else is refused.
        match r.unwrap_or_else(|p| panic!("{what}: panicked: {}", panic_text(p))) {
            Ok(g) => assert!(g.variables.is_empty(), "{what}"),
            Err(e) => named(&e, &[Path::new(P)]).unwrap(),
        }
        // The region is a few bytes, any read past it panics, and the heap stays small: the
        // claimed sizes and counts were never walked.
        assert!(heap < MIB, "{what}: {heap} B");
    }

    // Opaque ops nested 20 000 deep are carried without recursion: open, convert, reopen.
    let tmp = tempfile::tempdir().unwrap();
    let p = write(tmp.path(), "deep.sdnb", &handmade_sdnb(20_000));
    let c = sdnb::open(&p).unwrap();
    assert_eq!(c.op_count(), 2);
    let out = tmp.path().join("deep2.sdz");
    sdnb::convert(&c, &out, &save_opts(Format::Sdz, None, 64)).unwrap();
    let d = sdnb::open(&out).unwrap();
    assert_eq!(d.op_count(), 2);
    assert_eq!(d.updater_params(), ["w", "gone"]);
    assert_eq!(d.tensor("app").unwrap().bytes, pattern(16, 4));
    drop((c, d));
    // Without slack after a foreign graph, an in-place edit is refused; a rewrite carries the
    // chain again.
    let edit = [("k".to_string(), Some("v".to_string()))];
    named(&sdnb::set_metadata(&p, &edit, false).unwrap_err(), &[&p]).unwrap();
    assert!(!sdnb::set_metadata(&p, &edit, true).unwrap().in_place);
    let e = sdnb::open(&p).unwrap();
    assert_eq!((meta(&e, "k"), e.op_count()), (Some("v"), 2));
}

#[test]
fn a_zip_with_2000_entries_is_refused_before_its_directory_is_read() {
    let many: Vec<ZipIn> = (0..2000)
        .map(|i| stored(format!("f{i}").as_bytes(), b"x"))
        .collect();
    let z = zip_of(&many);
    let (r, heap) = measured(|| sdz::entries(&z, Path::new(P), &ZipLimits::default()));
    let e = r.unwrap_err().to_string();
    assert!(e.contains("2000 entries") && e.contains("1000"), "{e}");
    assert!(heap < MIB, "{heap} B");
    // The count comes from the end record: with the directory itself overwritten, the refusal
    // is the same, so the directory was not read.
    let eocd = rfind(&z, b"PK\x05\x06").unwrap();
    let cd_start = u32::from_le_bytes(z[eocd + 16..eocd + 20].try_into().unwrap()) as usize;
    let mut garbled = z.clone();
    garbled[cd_start..eocd].fill(0xA5);
    let e = sdz::entries(&garbled, Path::new(P), &ZipLimits::default())
        .unwrap_err()
        .to_string();
    assert!(e.contains("2000 entries; the limit is 1000"), "{e}");
    let tmp = tempfile::tempdir().unwrap();
    refused(&write(tmp.path(), "many.sdz", &z), "2000 entries");
    refused(
        &write(tmp.path(), "garbled.sdz", &garbled),
        "2000 entries; the limit is 1000",
    );

    // An end record that claims 65535 entries over a short directory, and a ZIP64 end record
    // that claims 2^40.
    let mut z = zip_of(&[stored(b"model", b"SDNB")]);
    let eocd = rfind(&z, b"PK\x05\x06").unwrap();
    z[eocd + 8..eocd + 12].copy_from_slice(&[0xFF; 4]);
    refused(&write(tmp.path(), "ffff.sdz", &z), "entries");
    let mut z = zip_of(&[stored(b"model", b"SDNB")]);
    let eocd = rfind(&z, b"PK\x05\x06").unwrap();
    let cd_start = u32::from_le_bytes(z[eocd + 16..eocd + 20].try_into().unwrap()) as u64;
    let cd_len = (eocd as u64) - cd_start;
    let tail = z.split_off(eocd);
    let rec_at = z.len() as u64;
    z.extend(0x0606_4b50u32.to_le_bytes());
    z.extend(44u64.to_le_bytes());
    z.extend([45, 3, 45, 0]);
    z.extend([0u8; 8]);
    z.extend((1u64 << 40).to_le_bytes());
    z.extend((1u64 << 40).to_le_bytes());
    z.extend(cd_len.to_le_bytes());
    z.extend(cd_start.to_le_bytes());
    z.extend(0x0706_4b50u32.to_le_bytes());
    z.extend(0u32.to_le_bytes());
    z.extend(rec_at.to_le_bytes());
    z.extend(1u32.to_le_bytes());
    z.extend(&tail);
    let eocd = z.len() - 22;
    z[eocd + 8..eocd + 12].copy_from_slice(&[0xFF; 4]);
    z[eocd + 12..eocd + 20].copy_from_slice(&[0xFF; 8]);
    refused(&write(tmp.path(), "zip64.sdz", &z), "entries");
}

fn files_under(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            out.push(p.clone());
            out.extend(files_under(&p));
        } else {
            out.push(p);
        }
    }
    out.sort();
    out
}

#[test]
fn escaping_entry_names_are_refused_before_anything_is_written() {
    let model = small_sdnb();
    let names: [&[u8]; 9] = [
        b"../evil",
        b"/abs",
        b"C:x",
        b"a\\b",
        b"a\0b",
        b"x/../../evil",
        b"..",
        b"",
        b"\xff\xfe",
    ];
    // Where a careless extractor would write, relative to the working directory or absolute.
    let outside = |base: &Path| -> Vec<PathBuf> {
        [
            "evil",
            "../evil",
            "../../evil",
            "C:x",
            "a\\b",
            "a",
            "abs",
            "/abs",
        ]
        .iter()
        .map(|n| base.join(n))
        .collect()
    };
    let cwd = std::env::current_dir().unwrap();
    let existed: Vec<PathBuf> = outside(&cwd).into_iter().filter(|p| p.exists()).collect();
    for name in names {
        for local_only in [false, true] {
            let tmp = tempfile::tempdir().unwrap();
            let sub = tmp.path().join("sub");
            fs::create_dir(&sub).unwrap();
            let mut z = zip_of(&[stored(b"model", &model), stored(name, b"pwned")]);
            if local_only && !name.is_empty() {
                // The central directory names the entry "eee…"; only the local header carries
                // the hostile name. The two must agree.
                let good = vec![b'e'; name.len()];
                let cd = rfind(&z, b"PK\x01\x02").unwrap();
                z[cd + 46..cd + 46 + good.len()].copy_from_slice(&good);
            }
            let p = write(&sub, "a.sdz", &z);
            let shown = String::from_utf8_lossy(name).into_owned();
            let e = sdz::entries(&z, &p, &ZipLimits::default()).unwrap_err();
            named(&e, &[&p]).unwrap();
            let e = sdnb::open(&p).unwrap_err();
            named(&e, &[&p]).unwrap();
            assert!(
                e.to_string().contains("entry") || e.to_string().contains("ZIP"),
                "{shown:?}: {e}"
            );
            let r = sdnb::set_metadata(&p, &[("k".into(), Some("v".into()))], true);
            named(&r.unwrap_err(), &[&p]).unwrap();
            assert_eq!(
                files_under(tmp.path()),
                [sub.clone(), p.clone()],
                "{shown:?}"
            );
            assert_eq!(fs::read(&p).unwrap(), z, "{shown:?}: the archive changed");
            for q in outside(&sub).into_iter().chain(outside(tmp.path())) {
                assert!(!q.exists(), "{shown:?}: {} was created", q.display());
            }
        }
        // The writer refuses such a name as an extra entry, before creating any file.
        let Ok(text) = std::str::from_utf8(name) else {
            continue;
        };
        let tmp = tempfile::tempdir().unwrap();
        let p = tmp.path().join("w.sdz");
        let mut o = save_opts(Format::Sdz, None, 64);
        o.extra_entries = vec![(text.to_string(), b"pwned".to_vec())];
        let e = sdnb::save(&p, &tensor_ins(&small_tensors()), &o).unwrap_err();
        named(&e, &[&p]).unwrap();
        assert_eq!(files_under(tmp.path()), Vec::<PathBuf>::new(), "{text:?}");
    }
    for q in outside(&cwd) {
        assert!(
            existed.contains(&q) || !q.exists(),
            "{} was created",
            q.display()
        );
    }
}

#[test]
fn zip_bombs_are_refused_by_ratio_and_by_what_they_produce() {
    let tmp = tempfile::tempdir().unwrap();
    let model = small_sdnb();
    // 4 MiB of zeros after an SDNB header: about 1000:1.
    let mut bomb = model[..32].to_vec();
    bomb.resize(4 * MIB, 0);
    let z = zip_of(&[deflated(b"model", &bomb)]);
    assert!(z.len() < 64 << 10);
    let (r, heap) = measured(|| sdz::entries(&z, Path::new(P), &ZipLimits::default()));
    assert!(r.unwrap_err().to_string().contains("compression ratio"));
    assert!(heap < MIB, "{heap}");
    refused(&write(tmp.path(), "bomb.sdz", &z), "compression ratio");
    // As an extra entry beside a good model.
    let z = zip_of(&[stored(b"model", &model), deflated(b"x.json", &bomb)]);
    refused(&write(tmp.path(), "bomb2.sdz", &z), "compression ratio");

    // A bomb that lies: the directory declares 50:1, the stream holds 4 MiB. Inflating stops
    // one byte past the declared size.
    let mut liar = deflated(b"model", &bomb);
    liar.size = liar.raw.len() as u32 * 50;
    let declared = liar.size as usize;
    let z = zip_of(&[liar]);
    let p = write(tmp.path(), "liar.sdz", &z);
    let (r, heap) = measured(|| sdnb::open(&p));
    let e = r.unwrap_err();
    named(&e, &[&p]).unwrap();
    assert!(e.to_string().contains("not the declared"), "{e}");
    assert!(
        heap < declared + 4 * MIB,
        "{heap} bytes for a {declared}-byte entry"
    );

    // A total over the limit.
    let z = zip_of(&[stored(b"model", &model), stored(b"more", &model)]);
    let small = ZipLimits {
        max_total_bytes: model.len() as u64 + 10,
        ..ZipLimits::default()
    };
    let e = sdz::entries(&z, Path::new(P), &small).unwrap_err();
    assert!(e.to_string().contains("uncompressed bytes"), "{e}");
    let p = write(tmp.path(), "total.sdz", &z);
    let limits = Limits {
        zip: small,
        ..Limits::default()
    };
    let e = Container::open_with(&p, &limits).unwrap_err();
    named(&e, &[&p]).unwrap();
}

#[test]
fn header_fields_out_of_range() {
    let tmp = tempfile::tempdir().unwrap();
    let f = small_sdnb();
    let len = f.len() as u64;
    let cases: Vec<(usize, Vec<u8>, &str)> = vec![
        (8, (len + 1).to_be_bytes().to_vec(), "outside the file"),
        (8, len.to_be_bytes().to_vec(), "outside the file"),
        (
            8,
            (i64::MAX as u64).to_be_bytes().to_vec(),
            "outside the file",
        ),
        (8, u64::MAX.to_be_bytes().to_vec(), "negative"),
        (8, 31u64.to_be_bytes().to_vec(), "outside the file"),
        (
            16,
            (i64::MAX as u64).to_be_bytes().to_vec(),
            "outside the file",
        ),
        (16, u64::MAX.to_be_bytes().to_vec(), "negative"),
        (16, (len).to_be_bytes().to_vec(), "outside the file"),
        (4, 2u32.to_be_bytes().to_vec(), "version 2"),
        (4, 0u32.to_be_bytes().to_vec(), "version 0"),
        (4, u32::MAX.to_be_bytes().to_vec(), "version -1"),
        (24, 33u64.to_be_bytes().to_vec(), "metadata offset 33"),
        (24, u64::MAX.to_be_bytes().to_vec(), "metadata offset -1"),
        (0, b"SDNC".to_vec(), "not a SameDiff container"),
    ];
    for (i, (at, v, needle)) in cases.into_iter().enumerate() {
        let mut b = f.clone();
        set_be(&mut b, at, &v);
        refused(&write(tmp.path(), &format!("h{i}.sdnb"), &b), needle);
    }
    // Offset + length overflowing u64.
    let mut b = f.clone();
    set_be(&mut b, 8, &40u64.to_be_bytes());
    set_be(&mut b, 16, &(i64::MAX as u64).to_be_bytes());
    refused(&write(tmp.path(), "ovf.sdnb", &b), "outside the file");
    // Truncated below the header.
    for n in [0, 4, 8, 31] {
        let p = write(tmp.path(), &format!("t{n}.sdnb"), &f[..n]);
        let e = sdnb::open(&p).unwrap_err();
        named(&e, &[&p]).unwrap();
    }
    // A manifest entry pointing past M, and one before the header's end.
    let g = flat_graph(&GraphSpec {
        vars: handmade_vars(),
        metadata: forced_metadata(),
        ..GraphSpec::default()
    });
    for (offset, length) in [(1u64 << 40, 16), (0, 16), (64, u64::MAX >> 1)] {
        let mut b = sdnb_bytes(&g, 64, &[("app", &pattern(16, 4))]);
        let m = u64::from_be_bytes(b[8..16].try_into().unwrap()) as usize;
        let man = manifest::encode(&[Entry {
            name: "app".into(),
            offset,
            length,
        }]);
        b.truncate(m);
        b.extend(&man);
        set_be(&mut b, 16, &(man.len() as u64).to_be_bytes());
        refused(
            &write(tmp.path(), "entry.sdnb", &b),
            "outside the blob section",
        );
    }
    // Tight limits.
    let p = write(tmp.path(), "ok.sdnb", &f);
    for limits in [
        Limits {
            max_graph_bytes: 16,
            ..Limits::default()
        },
        Limits {
            max_manifest_bytes: 16,
            ..Limits::default()
        },
    ] {
        let e = Container::open_with(&p, &limits).unwrap_err();
        assert!(e.to_string().contains("cap"), "{e}");
        named(&e, &[&p]).unwrap();
    }
}

#[test]
fn external_and_chunked_arrays_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let secret = tmp.path().join("secret.bin");
    fs::write(&secret, pattern(24, 7)).unwrap();
    let external = VarSpec {
        name: "w".into(),
        dtype: 5,
        shape: Some(vec![2, 3]),
        var_type: 0,
        array: Some(ArraySpec {
            shape: Some(vec![2, 3]),
            dtype: 5,
            external: Some(secret.to_string_lossy().into_owned()),
            ..ArraySpec::default()
        }),
    };
    let mut chunked = external.clone();
    chunked.array.as_mut().unwrap().external = None;
    chunked.array.as_mut().unwrap().chunks = true;
    for (var, needle) in [(external, "isExternal"), (chunked, "bufferChunks")] {
        let g = flat_graph(&GraphSpec {
            vars: vec![var],
            metadata: forced_metadata(),
            ..GraphSpec::default()
        });
        let e = Graph::parse(&g, Path::new(P)).unwrap_err();
        assert!(e.to_string().contains(needle), "{e}");
        refused(
            &write(tmp.path(), "x.sdnb", &sdnb_bytes(&g, 0, &[])),
            needle,
        );
        // Inside an archive too.
        let z = zip_of(&[stored(b"model", &sdnb_bytes(&g, 0, &[]))]);
        refused(&write(tmp.path(), "x.sdz", &z), needle);
    }
}

// ---- Regression tests for bugs these tests found (each once panicked or over-allocated) ----

/// A FlatGraph whose `variables` vector holds `copies` offsets to one variable with a shape of
/// `dims` dimensions: FlatBuffers offsets may alias, so the bytes are tiny and the parsed graph
/// is not.
fn aliased_graph(copies: usize, dims: usize) -> Vec<u8> {
    let mut b = FlatBufferBuilder::new();
    let v = flat_variable(
        &mut b,
        &VarSpec {
            name: "v".into(),
            dtype: 5,
            shape: Some(vec![1; dims]),
            var_type: 2,
            array: None,
        },
        0,
    );
    let variables = b.create_vector(&vec![v; copies]);
    let root = b.start_table();
    b.push_slot_always(slot(1), variables);
    let root = b.end_table(root);
    b.finish_minimal(root);
    b.finished_data().to_vec()
}

/// Aliased offsets must not amplify: a 48 KiB region (4096 offsets to one variable with a
/// 4096-dimension shape) describes 128 MiB of shape vectors, and a 12 MiB one (2^20 offsets,
/// 2^20 dimensions) 8 TiB. The verifier's bounded apparent size refuses both before anything
/// is materialised. (Names, control dependencies and metadata keys alias the same way.)
#[test]
fn aliased_offsets_do_not_amplify_allocations() {
    let g = aliased_graph(4096, 4096);
    let (r, heap) = measured(|| Graph::parse(&g, Path::new(P)));
    let variables = r.map(|g| g.variables.len());
    assert!(
        heap < 32 * g.len().max(MIB),
        "{heap} bytes of heap to parse a {}-byte region: {variables:?}",
        g.len()
    );
    let tmp = tempfile::tempdir().unwrap();
    refused(
        &write(tmp.path(), "alias.sdnb", &sdnb_bytes(&g, 0, &[])),
        "verification",
    );
}

/// An SDZ holding one SDNB-looking entry named `model.shard0-of-<count>.sdnb`.
fn shard_count_archive(count: u32) -> Vec<u8> {
    let name = format!("model.shard0-of-{count}.sdnb");
    zip_of(&[stored(name.as_bytes(), &small_sdnb())])
}

/// Formerly a bug: `sdz::choose_model` (sdz.rs) sized `vec![None; n as usize]` by the shard count
/// N parsed from an entry name, before checking that N entries could exist. One 200-byte entry
/// name `model.shard0-of-100000000.sdnb` cost 1.6 GB of heap; with
/// `model.shard0-of-4294967295.sdnb` the 64 GiB request failed and the process aborted ("memory
/// allocation of 68719476720 bytes failed"), which no caller can catch. The set is now refused
/// as incomplete with a bounded message and bounded heap, which this test asserts.
#[test]
fn shard_counts_in_entry_names_do_not_size_allocations() {
    let z = shard_count_archive(100_000_000);
    let (r, heap) = measured(|| {
        let es = sdz::entries(&z, Path::new(P), &ZipLimits::default()).unwrap();
        sdz::choose_model(&z, &es, Path::new(P))
    });
    let e = r.unwrap_err().to_string();
    let shown: String = e.chars().take(300).collect();
    assert!(e.contains("incomplete shard set"), "{shown}");
    assert!(
        heap < 64 * MIB,
        "{heap} bytes of heap to refuse with a {}-byte message: {shown}",
        e.len()
    );
}

/// Formerly a bug: the same in `complete_set` (read.rs) for shard files on disk: a file named
/// `m.shard0-of-100000000.sdnb` made `open` allocate 1.6 GB; `-of-4294967295` aborted.
#[test]
fn shard_counts_in_file_names_do_not_size_allocations() {
    let tmp = tempfile::tempdir().unwrap();
    let p = write(tmp.path(), "m.shard0-of-100000000.sdnb", &small_sdnb());
    let (r, heap) = measured(|| sdnb::open(&p));
    let e = r.unwrap_err().to_string();
    let shown: String = e.chars().take(300).collect();
    assert!(e.contains("incomplete shard set"), "{shown}");
    assert!(
        heap < 64 * MIB,
        "{heap} bytes of heap to refuse with a {}-byte message: {shown}",
        e.len()
    );
}

/// The converted hand-built graph (ops, configuration, updater state and a sub-graph carried
/// by shardkit, so its buffer ends with the end mark followed by zero slack) with the
/// `configuration` offset moved into the slack: all-zero bytes verify as an empty table.
fn configuration_in_slack(dir: &Path) -> PathBuf {
    let src = write(dir, "src.sdnb", &handmade_sdnb(0));
    let p = dir.join("conv.sdnb");
    sdnb::convert(
        &sdnb::open(&src).unwrap(),
        &p,
        &save_opts(Format::Sdnb, None, 256),
    )
    .unwrap();
    let mut b = fs::read(&p).unwrap();
    let layout = sdnb::open(&p).unwrap().layout()[0].clone();
    let region = &b[32..layout.blob_start as usize];
    let u32_at = |o: usize| u32::from_le_bytes(region[o..o + 4].try_into().unwrap()) as usize;
    let u16_at = |o: usize| u16::from_le_bytes([region[o], region[o + 1]]) as usize;
    let root = u32_at(0);
    let vtable = root - u32_at(root);
    let field = root + u16_at(vtable + slot(4) as usize); // FlatGraph.configuration
    let target = (layout.graph_bytes as usize + 128).next_multiple_of(8);
    assert!(target + 8 <= region.len() && region[target..].iter().all(|&x| x == 0));
    let at = 32 + field;
    b[at..at + 4].copy_from_slice(&((target - field) as u32).to_le_bytes());
    write(dir, "conv.sdnb", &b)
}

/// Formerly a bug: `graph::build` (graph.rs, the `point` closure, `t.base - (c.at.pos - t.lo) as
/// u32`) assumed every carried object lies below the end of the carried tail. A table in the
/// zero slack after a shardkit graph's end mark passes the verifier (soffset 0, vtable length
/// 0), so `open` accepts the file, and `convert` and `set_metadata` then panicked with "attempt
/// to subtract with overflow" in debug builds (in release the offset wrapped and the rebuilt
/// graph failed its parse-back check: "internal error, the graph shardkit built does not parse
/// back"). Both now return without panicking (an error names the file), which this test
/// asserts. `mutated_converted_files` finds it too, with other `PROPTEST_RNG_SEED`s and more
/// cases: one 2-byte write of a small offset into the `converted` seed's graph.
#[test]
fn carried_tables_past_the_end_mark_are_refused_not_panicked() {
    let tmp = tempfile::tempdir().unwrap();
    let p = configuration_in_slack(tmp.path());
    let c = sdnb::open(&p).expect("the reader accepts the file");
    let out = tmp.path().join("out.sdnb");
    let r = catch_unwind(AssertUnwindSafe(|| {
        sdnb::convert(&c, &out, &SaveOptions::default())
    }));
    let r = r.unwrap_or_else(|p| panic!("convert panicked: {}", panic_text(p)));
    if let Err(e) = r {
        named(&e, &[&p, &out]).unwrap();
    }
    drop(c);
    let r = catch_unwind(AssertUnwindSafe(|| {
        sdnb::set_metadata(&p, &[("k".into(), Some("v".into()))], false)
    }));
    let r = r.unwrap_or_else(|p| panic!("set_metadata panicked: {}", panic_text(p)));
    if let Err(e) = r {
        named(&e, &[&p]).unwrap();
    }
}

/// A shard-set overwrite's journal (`.BASE.shard-set.pending`) that is not what shardkit writes
/// is refused by readers and writers with an error naming it; one naming a shard that is
/// missing along with its temporary is refused too, never taken for a smaller set.
#[test]
fn damaged_shard_set_journals_are_refused_naming_the_journal() {
    let tmp = tempfile::tempdir().unwrap();
    let ts = small_tensors();
    let base = tmp.path().join("m.sdnb");
    let files = sdnb::save(
        &base,
        &tensor_ins(&ts),
        &save_opts(Format::Sharded, Some(4096), 0),
    )
    .unwrap();
    assert!(files.len() >= 2, "{files:?}");
    let journal = tmp.path().join(".m.shard-set.pending");
    let n = files.len();
    let save_err = || {
        sdnb::save(
            &base,
            &tensor_ins(&ts),
            &save_opts(Format::Sharded, Some(4096), 0),
        )
        .unwrap_err()
    };
    for (text, why) in [
        (&b"{\"shard_count\": 0}"[..], "not in 1..2^32"),
        (b"{\"shard_count\": 99999999999}", "not in 1..2^32"),
        (b"{\"count\": 2}", "shard_count"),
        (b"{\"shard_count\": 2", "journal"),
        (b"\xff\xfe", "journal"),
    ] {
        fs::write(&journal, text).unwrap();
        let e = sdnb::open(&base).map(|_| ()).unwrap_err();
        assert!(matches!(e, crate::Error::Format { .. }), "{e:?}");
        named(&e, &[&journal]).unwrap();
        assert!(e.to_string().contains(why), "{e}");
        named(&save_err(), &[&journal]).unwrap();
        // Nothing was replaced.
        for f in &files {
            assert!(f.is_file(), "{}", f.display());
        }
    }
    // A journal naming a shard that is gone, and its temporary too: both are named.
    fs::write(&journal, format!("{{\"shard_count\": {n}}}")).unwrap();
    let last = files.last().unwrap();
    let kept = fs::read(last).unwrap();
    fs::remove_file(last).unwrap();
    let e = sdnb::open(&base).map(|_| ()).unwrap_err();
    named(&e, &[&journal]).unwrap();
    named(&e, &[last]).unwrap();
    named(&save_err(), &[&journal]).unwrap();
    fs::write(last, kept).unwrap();
    fs::remove_file(&journal).unwrap();
    assert_eq!(sdnb::open(&base).unwrap().variables().len(), ts.len());
}
