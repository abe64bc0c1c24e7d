//! Mutated valid containers through every public path, and the parsers on their own.
//! Failing cases persist in `mutate.proptest-regressions` beside this file.

use proptest::test_runner::FileFailurePersistence;

use super::*;

// ---- Mutations ----

#[derive(Debug, Clone, Copy)]
enum Value {
    Fixed(u64),
    /// The file's length plus this.
    Len(i8),
}

#[derive(Debug, Clone)]
enum Mutation {
    Flip {
        file: usize,
        region: usize,
        at: usize,
        bit: u8,
    },
    Byte {
        file: usize,
        region: usize,
        at: usize,
        value: u8,
    },
    Word {
        file: usize,
        region: usize,
        at: usize,
        value: Value,
        width: u8,
        big_endian: bool,
        aligned: bool,
    },
    Truncate {
        file: usize,
        keep: usize,
    },
    Insert {
        file: usize,
        region: usize,
        at: usize,
        bytes: Vec<u8>,
    },
    Delete {
        file: usize,
        region: usize,
        at: usize,
        n: usize,
    },
    /// Copies `n` bytes from one place of the file over another.
    Splice {
        file: usize,
        from: (usize, usize),
        to: (usize, usize),
        n: usize,
    },
    /// Removes a file of a shard set.
    Remove {
        file: usize,
    },
    /// Renames a file of a shard set to `m.shard<index>-of-<count>.sdnb`.
    Rename {
        file: usize,
        index: u8,
        count: u8,
    },
}

const EXTREMES: [u64; 18] = [
    0,
    1,
    8,
    32,
    0x7F,
    0x80,
    0xFF,
    0x7FFF,
    0x8000,
    0xFFFF,
    0x7FFF_FFFF,
    0x8000_0000,
    0xFFFF_FFFF,
    1 << 32,
    i64::MAX as u64,
    i64::MIN as u64,
    u64::MAX,
    u64::MAX - 31,
];

fn value() -> impl Strategy<Value = Value> {
    prop_oneof![
        5 => proptest::sample::select(EXTREMES.to_vec()).prop_map(Value::Fixed),
        2 => (-2i8..=2).prop_map(Value::Len),
        // Offsets and lengths that land inside the file (FlatBuffers offsets are 4-aligned).
        3 => (0u64..5000).prop_map(|v| Value::Fixed(v & !3)),
        1 => any::<u64>().prop_map(Value::Fixed),
    ]
}

fn mutation() -> impl Strategy<Value = Mutation> {
    let u = any::<usize>;
    prop_oneof![
        3 => (u(), u(), u(), 0u8..8).prop_map(|(file, region, at, bit)| Mutation::Flip {
            file,
            region,
            at,
            bit
        }),
        2 => (u(), u(), u(), any::<u8>()).prop_map(|(file, region, at, value)| Mutation::Byte {
            file,
            region,
            at,
            value
        }),
        4 => (
            u(),
            u(),
            u(),
            value(),
            proptest::sample::select(vec![2u8, 4, 8]),
            any::<bool>(),
            any::<bool>()
        )
            .prop_map(|(file, region, at, value, width, big_endian, aligned)| {
                Mutation::Word {
                    file,
                    region,
                    at,
                    value,
                    width,
                    big_endian,
                    aligned,
                }
            }),
        1 => (u(), u()).prop_map(|(file, keep)| Mutation::Truncate { file, keep }),
        1 => (u(), u(), u(), vec(any::<u8>(), 1..24)).prop_map(|(file, region, at, bytes)| {
            Mutation::Insert {
                file,
                region,
                at,
                bytes,
            }
        }),
        1 => (u(), u(), u(), 1usize..80).prop_map(|(file, region, at, n)| Mutation::Delete {
            file,
            region,
            at,
            n
        }),
        1 => (u(), (u(), u()), (u(), u()), 1usize..40).prop_map(|(file, from, to, n)| {
            Mutation::Splice { file, from, to, n }
        }),
        1 => u().prop_map(|file| Mutation::Remove { file }),
        1 => (u(), 0u8..6, 0u8..6).prop_map(|(file, index, count)| Mutation::Rename {
            file,
            index,
            count
        }),
    ]
}

/// A position inside hot range `region` of a `len`-byte buffer, if that range still exists.
fn pick(hot: &[Range<usize>], region: usize, at: usize, len: usize) -> Option<usize> {
    let r = &hot[region % hot.len()];
    let (s, e) = (r.start.min(len), r.end.min(len));
    (s < e).then(|| s + at % (e - s))
}

/// Applies a byte-level mutation to one buffer (file operations are ignored here).
fn mutate(b: &mut Vec<u8>, hot: &[Range<usize>], m: &Mutation) {
    let len = b.len();
    match *m {
        Mutation::Flip {
            region, at, bit, ..
        } => {
            if let Some(p) = pick(hot, region, at, len) {
                b[p] ^= 1 << bit;
            }
        }
        Mutation::Byte {
            region, at, value, ..
        } => {
            if let Some(p) = pick(hot, region, at, len) {
                b[p] = value;
            }
        }
        Mutation::Word {
            region,
            at,
            value,
            width,
            big_endian,
            aligned,
            ..
        } => {
            let Some(mut p) = pick(hot, region, at, len) else {
                return;
            };
            let w = width as usize;
            if aligned {
                p -= p % w;
            }
            let v = match value {
                Value::Fixed(v) => v,
                Value::Len(d) => (len as u64).wrapping_add(d as i64 as u64),
            };
            let bytes = if big_endian {
                v.to_be_bytes()[8 - w..].to_vec()
            } else {
                v.to_le_bytes()[..w].to_vec()
            };
            let end = (p + w).min(len);
            b[p..end].copy_from_slice(&bytes[..end - p]);
        }
        Mutation::Truncate { keep, .. } => b.truncate(keep % (len + 1)),
        Mutation::Insert {
            region,
            at,
            ref bytes,
            ..
        } => {
            let p = pick(hot, region, at, len).unwrap_or(len);
            b.splice(p..p, bytes.iter().copied());
        }
        Mutation::Delete { region, at, n, .. } => {
            if let Some(p) = pick(hot, region, at, len) {
                b.drain(p..(p + n).min(len));
            }
        }
        Mutation::Splice { from, to, n, .. } => {
            if let (Some(f), Some(t)) = (pick(hot, from.0, from.1, len), pick(hot, to.0, to.1, len))
            {
                let n = n.min(len - f).min(len - t);
                let chunk = b[f..f + n].to_vec();
                b[t..t + n].copy_from_slice(&chunk);
            }
        }
        Mutation::Remove { .. } | Mutation::Rename { .. } => {}
    }
}

fn file_of(m: &Mutation) -> usize {
    match *m {
        Mutation::Flip { file, .. }
        | Mutation::Byte { file, .. }
        | Mutation::Word { file, .. }
        | Mutation::Truncate { file, .. }
        | Mutation::Insert { file, .. }
        | Mutation::Delete { file, .. }
        | Mutation::Splice { file, .. }
        | Mutation::Remove { file }
        | Mutation::Rename { file, .. } => file,
    }
}

/// The seed's files after `muts` (file names may change for shard sets).
fn mutated_files(s: &Seed, muts: &[Mutation]) -> Vec<(String, Vec<u8>)> {
    let mut files: Vec<(String, Vec<u8>, usize)> = s
        .files
        .iter()
        .enumerate()
        .map(|(i, (n, b))| (n.clone(), b.clone(), i))
        .collect();
    for m in muts {
        if files.is_empty() {
            break;
        }
        let k = file_of(m) % files.len();
        match *m {
            Mutation::Remove { .. } if s.sharded => {
                files.remove(k);
            }
            Mutation::Rename { index, count, .. } if s.sharded => {
                files[k].0 = format!("m.shard{index}-of-{count}.sdnb");
            }
            _ => {
                let hot = &s.hot[files[k].2];
                mutate(&mut files[k].1, hot, m);
            }
        }
    }
    files.into_iter().map(|(n, b, _)| (n, b)).collect()
}

// ---- Exercising a container ----

/// Each variable's C-order bytes (`None` without an array), every byte read.
type Snapshot = Vec<(String, Option<Vec<u8>>)>;

fn snapshot(c: &Container, places: &[&Path]) -> Result<Snapshot, String> {
    let mut out = Vec::with_capacity(c.variables().len());
    for v in c.variables() {
        if c.variable(&v.name).map(|w| &w.name) != Some(&v.name) {
            return Err(format!("variable({:?}) does not find it", v.name));
        }
        let got = typed(&format!("tensor({:?})", v.name), places, || {
            c.tensor(&v.name)
        })?;
        let Some(t) = got else {
            if v.storage != Storage::None && v.shape.is_some() {
                return Err(format!(
                    "tensor({:?}) failed though its storage is {}",
                    v.name, v.storage
                ));
            }
            out.push((v.name.clone(), None));
            continue;
        };
        let sum = t
            .bytes
            .iter()
            .fold(0u64, |a, &x| a.wrapping_add(u64::from(x)));
        std::hint::black_box(sum);
        if t.bytes.len() as u64 != v.byte_len {
            return Err(format!(
                "{:?}: {} bytes served, {} listed",
                v.name,
                t.bytes.len(),
                v.byte_len
            ));
        }
        if let Some(w) = t.dtype.width() {
            let want = t.shape.iter().try_fold(w as u64, |a, &d| {
                u64::try_from(d).ok().and_then(|d| a.checked_mul(d))
            });
            if want != Some(t.bytes.len() as u64) {
                return Err(format!(
                    "{:?}: {} bytes for shape {:?} × {w}",
                    v.name,
                    t.bytes.len(),
                    t.shape
                ));
            }
        }
        let cb = catch_unwind(AssertUnwindSafe(|| t.c_order_bytes().into_owned()))
            .map_err(|p| format!("c_order_bytes({:?}) panicked: {}", v.name, panic_text(p)))?;
        if cb.len() != t.bytes.len() {
            return Err(format!("{:?}: c_order_bytes changed the length", v.name));
        }
        out.push((v.name.clone(), Some(cb)));
    }
    if typed("tensor(missing)", places, || {
        c.tensor("\u{0}no such variable")
    })?
    .is_some()
    {
        return Err("a missing variable has a tensor".into());
    }
    Ok(out)
}

/// Listing, layout, metadata and extra entries.
fn inspect(c: &Container, places: &[&Path]) -> Result<(), String> {
    for l in c.layout() {
        let ok = l.blob_start >= 32
            && l.blob_start <= l.manifest_offset
            && l.manifest_offset.checked_add(l.manifest_bytes) <= Some(l.bytes)
            && l.graph_bytes <= (l.blob_start - 32).next_multiple_of(8);
        if !ok {
            return Err(format!("inconsistent layout {l:?}"));
        }
    }
    std::hint::black_box((
        c.kind(),
        c.metadata().len(),
        meta(c, "model.name"),
        c.op_count(),
        c.updater_params(),
        c.path(),
    ));
    for name in c.extra_entries().to_vec() {
        typed(&format!("extra_entry({name:?})"), places, || {
            c.extra_entry(name)
        })?;
    }
    if typed("extra_entry(missing)", places, || c.extra_entry("no/such")).map(|x| x.is_some())? {
        return Err("a missing extra entry was served".into());
    }
    Ok(())
}

fn copy_dir(from: &Path, to: &Path) {
    fs::create_dir_all(to).unwrap();
    for e in fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

/// Opens `open_as` and does everything a user can with the container; `Err` describes a
/// broken rule (a panic, an unnamed error, a converted or edited copy that reads differently).
fn exercise(
    open_as: &Path,
    dir: &Path,
    scratch: &Path,
    to: Format,
    sharded: bool,
) -> Result<(), String> {
    let places: Vec<&Path> = if sharded { vec![dir] } else { vec![open_as] };
    let Some(c) = typed("open", &places, || sdnb::open(open_as))? else {
        return Ok(());
    };
    let before = snapshot(&c, &places)?;
    inspect(&c, &places)?;

    // Convert, then the copy must open and hold the same arrays.
    let out = scratch.join("out");
    fs::create_dir_all(&out).unwrap();
    let dst = out.join(match to {
        Format::Sdnb => "out.sdnb",
        Format::Sharded => "out.bin",
        Format::Sdz => "out.sdz",
    });
    let opts = SaveOptions {
        format: to,
        shard_size: (to == Format::Sharded).then_some(4096),
        slack: 512,
        metadata: vec![("fuzz".into(), "1".into())],
        ..SaveOptions::default()
    };
    if typed("convert", &[dir, &out], || sdnb::convert(&c, &dst, &opts))?.is_some() {
        let d = sdnb::open(&dst).map_err(|e| format!("the converted copy does not open: {e}"))?;
        if snapshot(&d, &[&out])? != before {
            return Err("the converted copy holds other arrays".into());
        }
        if meta(&d, "fuzz") != Some("1") {
            return Err("the converted copy lost the new metadata".into());
        }
        inspect(&d, &[&out])?;
    }
    drop(c);

    // Edit a copy in place.
    let copy = scratch.join("copy");
    copy_dir(dir, &copy);
    let target = copy.join(open_as.file_name().unwrap());
    let edit = [("fuzz.edit".to_string(), Some("yes".to_string()))];
    if typed("set_metadata", &[&copy], || {
        sdnb::set_metadata(&target, &edit, false)
    })?
    .is_some()
    {
        let e = sdnb::open(&target).map_err(|e| format!("the edited copy does not open: {e}"))?;
        if meta(&e, "fuzz.edit") != Some("yes") {
            return Err("the edit is not visible".into());
        }
        if snapshot(&e, &[&copy])? != before {
            return Err("the edit changed the arrays".into());
        }
    }
    Ok(())
}

fn run_case(s: &Seed, muts: &[Mutation], to: Format) -> Result<(), TestCaseError> {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("in");
    fs::create_dir(&dir).unwrap();
    for (name, bytes) in mutated_files(s, muts) {
        fs::write(dir.join(name), bytes).unwrap();
    }
    let scratch = tmp.path().join("scratch");
    let open_as = dir.join(&s.open_as);
    match catch_unwind(AssertUnwindSafe(|| {
        exercise(&open_as, &dir, &scratch, to, s.sharded)
    })) {
        Ok(Ok(())) => Ok(()),
        Ok(Err(msg)) => Err(TestCaseError::fail(format!("{}: {msg}", s.name))),
        Err(p) => Err(TestCaseError::fail(format!(
            "{}: panicked: {}",
            s.name,
            panic_text(p)
        ))),
    }
}

fn format() -> impl Strategy<Value = Format> {
    proptest::sample::select(vec![Format::Sdnb, Format::Sharded, Format::Sdz])
}

/// `n` cases from a fixed RNG seed, so that every CI run checks the same inputs and a failure
/// reproduces; `PROPTEST_RNG_SEED=<n>` explores others.
fn cases(n: u32) -> ProptestConfig {
    let d = ProptestConfig::default();
    ProptestConfig {
        cases: n,
        max_shrink_iters: 2000,
        rng_seed: match d.rng_seed {
            RngSeed::Random => RngSeed::Fixed(SEED),
            fixed => fixed,
        },
        // Beside this file (the default would be a `proptest-regressions` folder beside src).
        failure_persistence: Some(Box::new(FileFailurePersistence::WithSource(
            "proptest-regressions",
        ))),
        ..d
    }
}

#[test]
fn every_seed_is_valid_and_survives_the_exercise() {
    for s in &corpus().seeds {
        run_case(s, &[], Format::Sdnb).unwrap();
        run_case(s, &[], Format::Sdz).unwrap();
    }
    let kinds: Vec<(&str, Kind)> = corpus()
        .seeds
        .iter()
        .map(|s| {
            let tmp = tempfile::tempdir().unwrap();
            for (n, b) in &s.files {
                fs::write(tmp.path().join(n), b).unwrap();
            }
            (
                s.name,
                sdnb::open(tmp.path().join(&s.open_as)).unwrap().kind(),
            )
        })
        .collect();
    let kind = |name: &str| kinds.iter().find(|k| k.0 == name).unwrap().1;
    assert!(
        matches!(kind("sharded"), Kind::Sharded { shards } if shards >= 3),
        "{kinds:?}"
    );
    assert!(
        matches!(kind("sdz-sharded"), Kind::Sdz { shards } if shards >= 3),
        "{kinds:?}"
    );
    assert_eq!(kind("deflate-sdz"), Kind::Sdz { shards: 1 });
    assert_eq!(kind("single"), Kind::Sdnb);
    let c = sdnb::open(PathBuf::from("/nonexistent/x.sdnb")).unwrap_err();
    named(&c, &[Path::new("/nonexistent/x.sdnb")]).unwrap();
}

proptest! {
    #![proptest_config(cases(600))]

    #[test]
    fn mutated_single_files(muts in vec(mutation(), 1..4), to in format()) {
        run_case(seed("single"), &muts, to)?;
    }
}

proptest! {
    #![proptest_config(cases(1500))]

    #[test]
    fn mutated_shard_sets(muts in vec(mutation(), 1..4), to in format()) {
        run_case(seed("sharded"), &muts, to)?;
    }

    #[test]
    fn mutated_sdz_archives(muts in vec(mutation(), 1..4), to in format()) {
        run_case(seed("sdz"), &muts, to)?;
    }

    #[test]
    fn mutated_sharded_sdz_archives(muts in vec(mutation(), 1..4), to in format()) {
        run_case(seed("sdz-sharded"), &muts, to)?;
    }

    #[test]
    fn mutated_deflate_archives(muts in vec(mutation(), 1..4), to in format()) {
        run_case(seed("deflate-sdz"), &muts, to)?;
    }

    #[test]
    fn mutated_hand_built_graphs(muts in vec(mutation(), 1..4), to in format()) {
        run_case(seed("handmade"), &muts, to)?;
    }

    #[test]
    fn mutated_converted_files(muts in vec(mutation(), 1..4), to in format()) {
        run_case(seed("converted"), &muts, to)?;
    }
}

// ---- The parsers on their own ----

fn no_panic<T>(
    what: &str,
    f: impl FnOnce() -> crate::Result<T>,
) -> Result<Option<T>, TestCaseError> {
    typed(what, &[Path::new(P)], f).map_err(TestCaseError::fail)
}

fn check_graph(region: &[u8]) -> Result<(), TestCaseError> {
    let Some(g) = no_panic("Graph::parse", || Graph::parse(region, Path::new(P)))? else {
        return Ok(());
    };
    for v in &g.variables {
        if let Some(r) = v.array.as_ref().and_then(|a| a.inline.clone()) {
            prop_assert!(
                r.start <= r.end && r.end <= region.len(),
                "inline bytes {r:?} of {:?} outside the {}-byte region",
                v.name,
                region.len()
            );
        }
    }
    std::hint::black_box((g.meta("x"), g.updater_params()));
    Ok(())
}

fn check_manifest(bytes: &[u8], max: usize) -> Result<(), TestCaseError> {
    if let Some(es) = no_panic("manifest::decode", || {
        manifest::decode(bytes, Path::new(P), max)
    })? {
        prop_assert!(es.len() <= max);
        for e in &es {
            prop_assert!(e.offset <= i64::MAX as u64 && e.length <= i64::MAX as u64);
        }
    }
    Ok(())
}

fn check_header(bytes: &[u8], file_len: u64) -> Result<(), TestCaseError> {
    if let Some(h) = no_panic("Header::parse", || {
        Header::parse(bytes, file_len, Path::new(P))
    })? {
        prop_assert!(h.manifest_offset >= 32);
        prop_assert!(h.manifest_offset.checked_add(h.manifest_len) <= Some(file_len));
    }
    Ok(())
}

fn check_zip(bytes: &[u8]) -> Result<(), TestCaseError> {
    let Some(es) = no_panic("sdz::entries", || {
        sdz::entries(bytes, Path::new(P), &ZipLimits::default())
    })?
    else {
        return Ok(());
    };
    for e in &es {
        prop_assert!(e.data.start <= e.data.end && e.data.end <= bytes.len() as u64);
        let peeked = catch_unwind(AssertUnwindSafe(|| sdz::peek(bytes, e, 64)))
            .map_err(|p| TestCaseError::fail(format!("peek panicked: {}", panic_text(p))))?;
        prop_assert!(peeked.len() <= 64);
        if e.method == Method::Deflate {
            if let Some(v) = no_panic("sdz::inflate", || sdz::inflate(bytes, e, Path::new(P)))? {
                prop_assert_eq!(v.len() as u64, e.size);
            }
        }
    }
    match no_panic("choose_model", || {
        sdz::choose_model(bytes, &es, Path::new(P))
    })? {
        Some(ModelEntries::Single(i)) => prop_assert!(i < es.len()),
        Some(ModelEntries::Sharded(v)) => prop_assert!(v.iter().all(|&i| i < es.len())),
        None => {}
    }
    Ok(())
}

fn whole(b: &[u8]) -> Vec<Range<usize>> {
    let n = b.len();
    vec![0..n, 0..n.min(64), n.saturating_sub(64)..n, 0..n.min(256)]
}

proptest! {
    #![proptest_config(cases(5000))]

    #[test]
    fn headers_from_arbitrary_bytes(bytes in vec(any::<u8>(), 0..48), file_len in prop_oneof![any::<u64>(), 0u64..4096]) {
        check_header(&bytes, file_len)?;
        let mut magic = b"SDNB\0\0\0\x01".to_vec();
        magic.extend(&bytes);
        check_header(&magic, file_len)?;
    }

    #[test]
    fn mutated_headers(m in 0u64..1 << 20, len in 0u64..1 << 20, file_len in 0u64..1 << 21, muts in vec(mutation(), 0..4)) {
        let mut b = Header { manifest_offset: m.max(32), manifest_len: len }.to_bytes().to_vec();
        for mu in &muts {
            mutate(&mut b, &[0..32, 8..24, 4..8], mu);
        }
        check_header(&b, file_len)?;
    }

    #[test]
    fn manifests_from_arbitrary_bytes(bytes in vec(any::<u8>(), 0..600), max in 0usize..8) {
        check_manifest(&bytes, max)?;
        // After a valid map header and a small entry count, so the entry grammar is reached.
        let mut framed = manifest::encode(&[]);
        framed.truncate(rfind(&framed, &[0x77, 0x08]).unwrap() + 6);
        framed.extend((max as u32 % 3).to_be_bytes());
        framed.extend(&bytes);
        check_manifest(&framed, max)?;
    }

    #[test]
    fn manifests_round_trip_or_refuse_mutations(
        entries in vec(("\\PC{0,6}|.{0,4}", 0u64..=i64::MAX as u64, prop_oneof![0u64..300, any::<u64>()]), 0..6),
        muts in vec(mutation(), 0..3),
    ) {
        let mut entries: Vec<Entry> = entries
            .into_iter()
            .map(|(name, offset, length)| Entry { name, offset, length: length & (i64::MAX as u64) })
            .collect();
        let mut seen = std::collections::HashSet::new();
        entries.retain(|e| seen.insert(e.name.clone()));
        let mut bytes = manifest::encode(&entries);
        if muts.is_empty() {
            let back = manifest::decode(&bytes, Path::new(P), 100).map_err(|e| TestCaseError::fail(e.to_string()))?;
            prop_assert_eq!(back, entries);
        }
        let hot = whole(&bytes);
        for m in &muts {
            mutate(&mut bytes, &hot, m);
        }
        check_manifest(&bytes, 100)?;
        check_manifest(&bytes, 1)?;
    }

    #[test]
    fn mutated_seed_manifests(which in any::<usize>(), muts in vec(mutation(), 1..4)) {
        let all = &corpus().manifests;
        let mut bytes = all[which % all.len()].clone();
        let hot = whole(&bytes);
        for m in &muts {
            mutate(&mut bytes, &hot, m);
        }
        check_manifest(&bytes, 1 << 20)?;
    }

    #[test]
    fn graphs_from_arbitrary_bytes(bytes in vec(any::<u8>(), 0..1024)) {
        check_graph(&bytes)?;
    }

    #[test]
    fn mutated_graph_regions(which in any::<usize>(), muts in vec(mutation(), 1..5)) {
        let all = &corpus().graphs;
        let mut g = all[which % all.len()].clone();
        let hot = whole(&g);
        for m in &muts {
            mutate(&mut g, &hot, m);
        }
        check_graph(&g)?;
    }

    #[test]
    fn zips_from_arbitrary_bytes(bytes in vec(any::<u8>(), 0..700), tail in vec(any::<u8>(), 0..22)) {
        check_zip(&bytes)?;
        // With the signatures in place, the parser goes further.
        let mut framed = b"PK\x03\x04".to_vec();
        framed.extend(&bytes);
        framed.extend(0x0605_4b50u32.to_le_bytes());
        framed.extend(&tail);
        framed.resize(framed.len() - tail.len() + 18, 0);
        check_zip(&framed)?;
    }

    #[test]
    fn mutated_zips(which in any::<usize>(), muts in vec(mutation(), 1..4)) {
        let all = &corpus().zips;
        let mut z = all[which % all.len()].clone();
        let mut hot = whole(&z);
        if let Ok(es) = sdz::entries(&z, Path::new(P), &ZipLimits::default()) {
            for e in &es {
                hot.push(e.local_header as usize..e.data.start as usize);
                hot.push(e.central_header as usize..e.central_header as usize + 46 + e.name.len());
            }
        }
        if let Some(at) = rfind(&z, b"PK\x05\x06") {
            hot.push(at..z.len());
        }
        for m in &muts {
            mutate(&mut z, &hot, m);
        }
        check_zip(&z)?;
    }
}

proptest! {
    #![proptest_config(cases(1000))]

    /// Random files with a valid signature, straight into `open`.
    #[test]
    fn arbitrary_files_open_or_fail(kind in 0u8..4, body in vec(any::<u8>(), 0..400)) {
        let tmp = tempfile::tempdir().unwrap();
        let (name, head): (&str, &[u8]) = match kind {
            0 => ("a.sdnb", b"SDNB\0\0\0\x01"),
            1 => ("a.sdz", b"PK\x03\x04"),
            2 => ("a.shard0-of-1.sdnb", b"SDNB"),
            _ => ("a.bin", b""),
        };
        let p = tmp.path().join(name);
        fs::write(&p, [head, &body].concat()).unwrap();
        typed("open", &[&p], || sdnb::open(&p)).map_err(TestCaseError::fail)?;
    }
}
