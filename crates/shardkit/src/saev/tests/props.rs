//! Property tests of the saev parsers and the index arithmetic (moved from
//! tests/saev_robustness.rs: they reach `Layout`'s byte arithmetic and shards.json, which are
//! internal): no input makes the parsers panic, and the index arithmetic is consistent.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use proptest::prelude::*;

use crate::error::Error;
use crate::json;
use crate::saev::layout::{parse_shards_json, shards_json_bytes, Layout};
use crate::saev::Metadata;

/// The saev reference fixtures (as tests/common/mod.rs finds them).
fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/fixtures/saev")
}

const ALL_FIXTURES: [&str; 7] = [
    "v1.0.0/bc87c00f08bd7bd69b6e64ca1b636ebf86e1ad452a520fa6032818b728a53b47",
    "v1.0.0/abbe30ad92e85b5b2346422cd3fe5d77198b6eb50315ea9f9fac35305004416a",
    "v2.0/eec1d7ba782d48ff23cf8e88b9a79fe637f800b9d56a9b16f2bd03bfcb7a8401",
    "v2.0/36f76cd85cfb77f6ae191c8994a7e313994553017475db89e31564e3464623af",
    "v2.1/aa57b80c",
    "v2.1/1acdd127",
    "v2.1/e64e5d2c",
];

/// Where `Metadata::parse` is told its bytes came from.
const SRC: &str = "/data/saev/shards/x/metadata.json";

/// The keys of the 2.1 case-A fixture, values as JSON text.
const BASE_21: [(&str, &str); 13] = [
    ("family", r#""clip""#),
    (
        "ckpt",
        r#""hf-hub:hf-internal-testing/tiny-open-clip-model""#,
    ),
    ("layers", "[-2, -1]"),
    ("content_tokens_per_example", "4"),
    ("cls_token", "true"),
    ("d_model", "8"),
    ("n_examples", "7"),
    ("max_tokens_per_shard", "30"),
    ("data", r#""gASV""#),
    ("dataset", r#""fake""#),
    ("pixel_agg", r#""majority""#),
    ("dtype", r#""float32""#),
    ("protocol", r#""2.1""#),
];

/// The 2.1 case-A metadata with `set` replacing (or appending) keys and `remove` dropping keys.
fn md21(set: &[(&str, &str)], remove: &[&str]) -> String {
    let mut members: Vec<(String, String)> = BASE_21
        .iter()
        .filter(|(k, _)| !remove.contains(k))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    for (k, v) in set {
        match members.iter_mut().find(|m| m.0 == *k) {
            Some(m) => m.1 = v.to_string(),
            None => members.push((k.to_string(), v.to_string())),
        }
    }
    let body: Vec<String> = members
        .iter()
        .map(|(k, v)| format!("\"{k}\": {v}"))
        .collect();
    format!("{{{}}}", body.join(", "))
}

fn parse_md(text: &str) -> crate::Result<(Metadata, Vec<String>)> {
    Metadata::parse(text.as_bytes(), Path::new(SRC))
}

/// The metadata.json and shards.json files of every fixture.
fn fixture_jsons() -> &'static [Vec<u8>] {
    static FILES: OnceLock<Vec<Vec<u8>>> = OnceLock::new();
    FILES.get_or_init(|| {
        let mut v = Vec::new();
        for d in ALL_FIXTURES {
            for f in ["metadata.json", "shards.json"] {
                v.push(std::fs::read(fixtures().join(d).join(f)).unwrap());
            }
        }
        v
    })
}

#[path = "../../../tests/common/mutation.rs"]
mod mutation;
use mutation::{mutate, mutation};

/// A mutated fixture JSON file.
fn mutated_fixture() -> impl Strategy<Value = Vec<u8>> {
    (
        0..fixture_jsons().len(),
        proptest::collection::vec(mutation(), 1..4),
    )
        .prop_map(|(f, muts)| mutate(fixture_jsons()[f].clone(), &muts))
}
/// Metadata and shards.json parsing never panic; metadata that parses has a layout or a
/// Format error, and a layout whose arithmetic stays within bounds.
fn check_saev_parsers(bytes: &[u8]) -> Result<(), TestCaseError> {
    let src = Path::new(SRC);
    match Metadata::parse(bytes, src) {
        Ok((md, _)) => {
            if let Ok(layout) = Layout::new(&md, src) {
                check_layout_bounds(&layout)?;
            }
            if let Ok(v) = json::parse(bytes) {
                // Canonicalising for writing never panics; what it produces parses back.
                if let Ok(w) = Metadata::for_writing(&v) {
                    let (back, _) = Metadata::parse(&w.file_bytes(), src).unwrap();
                    prop_assert_eq!(back.n_examples(), md.n_examples());
                    prop_assert_eq!(back.layers(), md.layers());
                    prop_assert_eq!(back.dir_name(), w.dir_name());
                }
            }
        }
        Err(e) => prop_assert!(
            matches!(&e, Error::Format { path, .. } if path == src),
            "{:?}",
            e
        ),
    }
    if let Err(e) = parse_shards_json(bytes, src) {
        prop_assert!(
            matches!(&e, Error::Format { path, .. } if path == src),
            "{:?}",
            e
        );
    }
    Ok(())
}

/// Bounds that hold for any valid layout, computed in 128 bits so the test itself cannot
/// overflow.
fn check_layout_bounds(l: &Layout) -> Result<(), TestCaseError> {
    let (n, eps) = (l.n_examples as u128, l.examples_per_shard as u128);
    prop_assert!(eps >= 1);
    prop_assert_eq!(l.n_shards as u128, n.div_ceil(eps));
    let shard = eps * l.n_layers as u128 * l.tokens as u128 * l.d_model as u128 * 4;
    prop_assert!(shard <= i64::MAX as u128);
    prop_assert_eq!(l.shard_bytes() as u128, shard);
    let last = l.n_examples - 1;
    let (s, r) = l.locate(last);
    prop_assert_eq!(s + 1, l.n_shards);
    prop_assert!(r < l.shard_count(s));
    let end = l.offset(last, l.n_layers - 1, l.tokens - 1) as u128 + l.vector_bytes() as u128;
    prop_assert!(end <= shard);
    Ok(())
}

/// Numeric texts that probe signs, zero, fractions, exponents and 64-bit limits.
const TRICKY: &[&str] = &[
    "0",
    "1",
    "-1",
    "2",
    "3",
    "7",
    "30",
    "1e3",
    "1.0",
    "-0",
    "4294967296",
    "4611686018427387904",
    "9223372036854775807",
    "9223372036854775808",
    "-9223372036854775808",
    "18446744073709551615",
    "18446744073709551616",
    "\"4\"",
    "null",
    "true",
    "[]",
];

/// Mostly small valid counts, often a tricky one.
fn tricky() -> impl Strategy<Value = String> {
    prop_oneof![
        2 => (1u64..40).prop_map(|i| i.to_string()),
        1 => proptest::sample::select(TRICKY).prop_map(str::to_owned),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn saev_parsers_never_panic_on_arbitrary_bytes(
        bytes in proptest::collection::vec(any::<u8>(), 0..256)
    ) {
        check_saev_parsers(&bytes)?;
    }

    #[test]
    fn saev_parsers_never_panic_on_mutated_fixtures(bytes in mutated_fixture()) {
        check_saev_parsers(&bytes)?;
    }

    #[test]
    fn metadata_with_tricky_numbers_never_panics(
        p in tricky(), d in tricky(), n in tricky(), m in tricky(),
        layer in tricky(), n_layers in prop_oneof![1 => Just(0usize), 6 => 1usize..4],
        cls in any::<bool>(),
        v1 in any::<bool>(),
    ) {
        let layers = vec![layer.as_str(); n_layers].join(", ");
        let cls = if cls { "true" } else { "false" };
        let text = if v1 {
            format!(
                r#"{{"vit_family": "clip", "vit_ckpt": "c", "layers": [{layers}],
                "n_patches_per_img": {p}, "cls_token": {cls}, "d_vit": {d}, "n_imgs": {n},
                "max_patches_per_shard": {m}, "data": {{}}, "dtype": "float32",
                "protocol": "1.0.0"}}"#
            )
        } else {
            md21(
                &[
                    ("layers", &format!("[{layers}]")),
                    ("content_tokens_per_example", &p),
                    ("cls_token", cls),
                    ("d_model", &d),
                    ("n_examples", &n),
                    ("max_tokens_per_shard", &m),
                ],
                &[],
            )
        };
        check_saev_parsers(text.as_bytes())?;
    }

    #[test]
    fn layout_index_maths_is_consistent(
        n in 1u64..60,
        n_layers in 1u64..4,
        p in 1u64..6,
        cls in any::<bool>(),
        d in 1u64..6,
        extra in 0u64..40,
    ) {
        let t = p + u64::from(cls);
        let budget = t * n_layers + extra;
        let layers: Vec<String> = (0..n_layers).map(|i| (3 * i as i64 - 2).to_string()).collect();
        let text = md21(
            &[
                ("layers", &format!("[{}]", layers.join(", "))),
                ("content_tokens_per_example", &p.to_string()),
                ("cls_token", if cls { "true" } else { "false" }),
                ("d_model", &d.to_string()),
                ("n_examples", &n.to_string()),
                ("max_tokens_per_shard", &budget.to_string()),
            ],
            &[],
        );
        let (md, _) = parse_md(&text).unwrap();
        let l = Layout::new(&md, Path::new(SRC)).unwrap();
        let eps = budget / (t * n_layers);
        prop_assert_eq!(l.examples_per_shard, eps);
        prop_assert_eq!(l.n_shards, n.div_ceil(eps));
        prop_assert_eq!((l.tokens, l.n_layers, l.d_model), (t, n_layers, d));
        prop_assert_eq!(l.example_bytes(), n_layers * t * d * 4);
        prop_assert_eq!(l.shard_bytes(), eps * l.example_bytes());
        prop_assert_eq!(l.example_values() * 4, l.example_bytes());
        check_layout_bounds(&l)?;

        // Counts: eps for all but the last shard, which is non-empty; the sum is N.
        let counts: Vec<u64> = (0..l.n_shards).map(|s| l.shard_count(s)).collect();
        prop_assert_eq!(counts.iter().sum::<u64>(), n);
        prop_assert!(counts[..counts.len() - 1].iter().all(|&c| c == eps));
        prop_assert!((1..=eps).contains(counts.last().unwrap()));
        prop_assert_eq!(l.shard_count(l.n_shards), 0);

        // Every example lies inside its shard, rows in order, no two vectors overlap.
        let mut seen = std::collections::HashSet::new();
        for g in 0..n {
            let (s, r) = l.locate(g);
            prop_assert!(s < l.n_shards);
            prop_assert!(r < l.shard_count(s));
            prop_assert_eq!(s * eps + r, g);
            prop_assert_eq!(l.offset(g, 0, 0), r * l.example_bytes());
            prop_assert!(l.offset(g, 0, 0) + l.example_bytes() <= l.shard_bytes());
            for slot in 0..n_layers {
                prop_assert_eq!(
                    l.offset(g, slot, 0),
                    r * l.example_bytes() + slot * l.slab_bytes()
                );
                for tok in 0..t {
                    let off = l.offset(g, slot, tok);
                    prop_assert!(off + l.vector_bytes() <= l.shard_bytes());
                    prop_assert_eq!(off % l.vector_bytes(), 0);
                    prop_assert!(seen.insert((s, off)));
                }
            }
        }

        // shards.json written for this layout parses back to the same entries and checks out.
        let sj = shards_json_bytes(&counts, md.count_key());
        let entries = parse_shards_json(&sj, Path::new("/d/shards.json")).unwrap();
        prop_assert_eq!(entries.len() as u64, l.n_shards);
        for (i, e) in entries.iter().enumerate() {
            prop_assert_eq!(&e.name, &Layout::shard_name(i as u64));
            prop_assert_eq!(e.count, counts[i]);
        }
    }
}
