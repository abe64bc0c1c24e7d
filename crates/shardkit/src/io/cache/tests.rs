//! The cache's tests.

use super::*;
use std::time::{Duration, SystemTime};

#[test]
fn held_pages_copy_a_range_across_pages_and_refuse_one_outside() {
    let dir = tempfile::tempdir().unwrap();
    let map = |name: &str, bytes: Vec<u8>| {
        let path = dir.path().join(name);
        std::fs::write(&path, bytes).unwrap();
        let f = std::fs::File::open(&path).unwrap();
        Arc::new(unsafe { memmap2::Mmap::map(&f) }.unwrap())
    };
    let (a, b, c) = (
        map("a", (0..100).collect()),
        map("b", (100..150).collect()),
        map("c", (150..160).collect()),
    );
    // The read's bytes 0..140: a[10..100], b[0..50]; then 140..150: c[0..10].
    let held = HeldPages {
        pieces: vec![(0, a, 10, 90), (90, b, 0, 50), (140, c, 0, 10)],
    };
    let mut out = vec![0u8; 60];
    held.copy_into(85, &mut out, |d, s| d.copy_from_slice(s))
        .unwrap();
    let want: Vec<u8> = (95..100).chain(100..150).chain(150..155).collect();
    assert_eq!(out, want);
    assert_eq!(held.first(89), Some(&[99u8][..]));
    assert_eq!(held.first(145).map(<[u8]>::len), Some(5));
    let mut past = vec![0u8; 20];
    assert!(held
        .copy_into(140, &mut past, |d, s| d.copy_from_slice(s))
        .is_none());
    assert!(held.first(150).is_none());
}

fn file(path: &Path, len: usize, age_s: u64) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, vec![7u8; len]).unwrap();
    let f = std::fs::File::options().write(true).open(path).unwrap();
    f.set_modified(SystemTime::now() - Duration::from_secs(age_s))
        .unwrap();
}

#[test]
fn eviction_removes_the_least_recently_used_until_the_incoming_bytes_fit() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let pages = root.join("b/acts/acts000000.bin.pages/00ff");
    file(&pages.join("0"), 100, 50);
    file(&pages.join("1"), 100, 40);
    file(&pages.join("2"), 100, 30);
    file(&root.join("b/m.sdz"), 100, 10);
    // Hidden files are not counted: stamps, and a live writer's temporary.
    file(&root.join("b/.m.sdz.etag"), 5, 60);
    file(&pages.join(".3.1.ThreadId(2).tmp"), 100, 60);
    // A temporary left by a killed process is removed.
    let stale = pages.join(".4.1.ThreadId(2).tmp");
    file(&stale, 100, 2 * 3600);

    assert_eq!(evict(root, 0, 400).unwrap(), 400);
    assert!(!stale.exists());
    assert_eq!(evict(root, 150, 400).unwrap(), 200);
    assert!(!pages.join("0").exists() && !pages.join("1").exists());
    assert!(pages.join("2").exists() && root.join("b/m.sdz").exists());
    assert!(root.join("b/.m.sdz.etag").exists());
    assert!(pages.join(".3.1.ThreadId(2).tmp").exists());
    // More than the target: everything goes.
    assert_eq!(evict(root, 1000, 400).unwrap(), 0);
    assert!(!root.join("b/m.sdz").exists());
}

#[test]
fn a_cache_is_made_only_in_a_new_or_empty_directory_and_keeps_its_mark() {
    let dir = tempfile::tempdir().unwrap();
    // New, and empty: marked.
    let new = dir.path().join("new/cache");
    claim(&new).unwrap();
    assert!(is_ours(&new.join(TAG)).unwrap());
    let empty = dir.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    claim(&empty).unwrap();
    assert!(is_ours(&empty.join(TAG)).unwrap());
    // Marked, it is taken whatever it holds; eviction empties it but for the mark.
    file(&new.join("b/m.sdz"), 100, 10);
    CLAIMED.lock().unwrap().1.clear();
    claim(&new).unwrap();
    assert_eq!(evict(&new, 1000, 400).unwrap(), 0);
    assert!(!new.join("b/m.sdz").exists() && is_ours(&new.join(TAG)).unwrap());
    // A directory of other files is refused, naming it, and left as it was: here a
    // user's data, and another tool's cache (cargo's target directory, same signature).
    let data = dir.path().join("data");
    file(&data.join("train.bin"), 100, 10);
    let target = dir.path().join("target");
    file(&target.join("debug/x"), 10, 10);
    std::fs::write(
        target.join(TAG),
        "Signature: 8a477f597d28d172789f06886806bc55\n# cargo\n",
    )
    .unwrap();
    for (d, found) in [(&data, "train.bin"), (&target, "")] {
        let e = claim(d).unwrap_err();
        assert!(matches!(e, Error::Invalid(_)), "{e:?}");
        let e = e.to_string();
        assert!(
            e.contains(&d.display().to_string()) && e.contains(found),
            "{e}"
        );
        assert!(e.contains("not a shardkit cache"), "{e}");
        // Nor does anything that would write or evict there go ahead.
        let e = reserve(d, 10).err().expect("not a shardkit cache");
        assert!(
            matches!(&e, Error::Invalid(m) if m.contains("not a shardkit cache")),
            "{e:?}"
        );
    }
    assert!(data.join("train.bin").exists() && target.join("debug/x").exists());
    assert!(!data.join(TAG).exists());
    // A marking in progress elsewhere (its temporary) does not make a directory "used".
    let racing = dir.path().join("racing");
    file(&racing.join(".CACHEDIR.TAG.7.ThreadId(2).tmp"), 10, 0);
    claim(&racing).unwrap();
    assert!(is_ours(&racing.join(TAG)).unwrap());
}

#[test]
fn usage_and_clearing_go_by_object_and_leave_writes_in_progress() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("cache");
    claim(&root).unwrap();
    let acts = root.join("b/acts");
    file(&acts.join("acts000000.bin.pages/00ff/0"), 100, 30);
    file(&acts.join("acts000000.bin.pages/00ff/1"), 100, 20);
    file(&acts.join("acts000001.bin.pages/00ff/0"), 50, 10);
    let writing = acts.join("acts000001.bin.pages/00ff/.1.7.ThreadId(3).tmp");
    file(&writing, 50, 0);
    file(&root.join("b/models/m.sdz"), 70, 40);
    file(&root.join("b/models/.m.sdz.etag"), 5, 40);
    file(&root.join("c/x.pages/v/0"), 10, 5);
    let u = cache_usage(&root).unwrap();
    assert_eq!(u.bytes, 330);
    let got: Vec<(&str, u64, u64)> = u
        .objects
        .iter()
        .map(|o| (o.url.as_str(), o.bytes, o.pages))
        .collect();
    assert_eq!(
        got,
        [
            ("s3://b/acts/acts000000.bin", 200, 2),
            ("s3://b/models/m.sdz", 70, 0),
            ("s3://b/acts/acts000001.bin", 50, 1),
            ("s3://c/x", 10, 1),
        ]
    );
    let newest = std::fs::metadata(acts.join("acts000000.bin.pages/00ff/1"))
        .unwrap()
        .modified()
        .unwrap();
    assert_eq!(u.objects[0].last_used, newest);

    // A prefix is matched by path segments; an object by its URL (copy and stamp).
    assert_eq!(clear_cache(&root, Some("s3://b/act")).unwrap(), (0, 0));
    assert_eq!(clear_cache(&root, Some("s3://b/acts/")).unwrap(), (3, 250));
    assert!(writing.exists(), "a write in progress is left to finish");
    assert_eq!(
        clear_cache(&root, Some("s3://b/models/m.sdz")).unwrap(),
        (2, 70)
    );
    assert!(!root.join("b/models/.m.sdz.etag").exists());
    assert_eq!(cache_usage(&root).unwrap().bytes, 10);
    assert_eq!(clear_cache(&root, None).unwrap(), (1, 10));
    assert_eq!(
        cache_usage(&root).unwrap(),
        CacheUsage {
            bytes: 0,
            limit: cache_limit(),
            objects: vec![]
        }
    );
    assert!(is_ours(&root.join(TAG)).unwrap() && writing.exists());

    let e = clear_cache(&root, Some("b/acts")).unwrap_err();
    assert!(
        matches!(e, Error::Invalid(_)) && e.to_string().contains("b/acts"),
        "{e}"
    );
    // Only a shardkit cache is looked at or cleared.
    let data = dir.path().join("data");
    file(&data.join("train.bin"), 100, 10);
    for e in [
        clear_cache(&data, None).unwrap_err(),
        cache_usage(&data).unwrap_err(),
    ] {
        assert!(e.to_string().contains("not a shardkit cache"), "{e}");
    }
    assert!(data.join("train.bin").exists());
    let e = cache_usage(&dir.path().join("none")).unwrap_err();
    assert!(matches!(e, Error::NotFound { .. }), "{e:?}");
}

#[test]
fn a_file_written_aside_is_whole_or_absent() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("x.pages/v/0");
    write_aside(&path, |f, tmp| {
        use std::io::Write;
        f.write_all(b"page").at(tmp)
    })
    .unwrap();
    assert_eq!(std::fs::read(&path).unwrap(), b"page");
    // A failed write leaves the old page and no temporary.
    let err = write_aside(&path, |_, tmp| {
        Err(Error::Io {
            path: tmp.to_path_buf(),
            source: std::io::Error::other("disk full"),
        })
    })
    .unwrap_err();
    assert!(err.to_string().contains("disk full"), "{err}");
    assert_eq!(std::fs::read(&path).unwrap(), b"page");
    let left: Vec<_> = std::fs::read_dir(path.parent().unwrap())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(left, vec![std::ffi::OsString::from("0")]);
}
