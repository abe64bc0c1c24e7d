//! Resolved metadata fields (moved from tests/saev_robustness.rs: the accessors are internal).

use std::path::Path;

use crate::saev::Metadata;

/// The 2.1 case-A fixture's metadata.json with `from` replaced by `to`.
fn md21(from: &str, to: &str) -> String {
    let text = r#"{"family": "clip", "ckpt": "hf-hub:hf-internal-testing/tiny-open-clip-model",
        "layers": [-2, -1], "content_tokens_per_example": 4, "cls_token": true, "d_model": 8,
        "n_examples": 7, "max_tokens_per_shard": 30, "data": "gASV", "dataset": "fake",
        "pixel_agg": "majority", "dtype": "float32", "protocol": "2.1"}"#;
    assert!(text.contains(from));
    text.replace(from, to)
}

fn parse(text: &str) -> Metadata {
    Metadata::parse(text.as_bytes(), Path::new("/d/metadata.json"))
        .unwrap()
        .0
}

#[test]
fn an_unknown_minor_version_keeps_its_major() {
    let md = parse(&md21(r#""protocol": "2.1""#, r#""protocol": "2.2""#));
    assert_eq!((md.protocol(), md.major()), ("2.2", 2));
}

#[test]
fn a_key_of_the_other_major_is_read() {
    let md = parse(&md21(r#""family": "clip""#, r#""vit_family": "siglip""#));
    assert_eq!(md.family(), "siglip");
    assert_eq!(md.pixel_agg(), Some("majority"));
}

#[test]
fn the_text_dialect_names_a_language_models_family_and_is_only_2_1() {
    use crate::json::parse;
    let base = r#""ckpt": "tiny-llama", "layers": [2], "content_tokens_per_example": 8,
        "cls_token": false, "d_model": 16, "n_examples": 4, "max_tokens_per_shard": 64,
        "data": "corpus", "dataset": "corpus.jsonl""#;
    let with = |extra: &str| parse(format!("{{{base}, {extra}}}").as_bytes()).unwrap();
    // A language model's family is refused without the dialect, written with it.
    let e = Metadata::for_writing(&with(r#""family": "llama""#)).unwrap_err();
    assert!(e.to_string().contains("`family` must be one of"), "{e}");
    let md =
        Metadata::for_writing(&with(r#""family": "llama", "shardkit_dialect": "text""#)).unwrap();
    assert_eq!(md.dialect(), Some("text"));
    let crate::json::Value::Object(raw) = md.raw() else {
        panic!("metadata is an object")
    };
    assert_eq!(raw.last().unwrap().0, "shardkit_dialect");
    let f = md.saev_findings();
    assert!(f.errors.is_empty() && !f.saev_loads(), "{f:?}");
    assert!(
        f.warnings.iter().any(|w| w.contains("text dialect")),
        "{f:?}"
    );
    // Read back from its bytes: the same, no unknown-key warning.
    let text = crate::json::to_pretty(md.raw(), 2, crate::json::Escape::Ascii);
    let (back, warnings) =
        Metadata::from_value(parse(text.as_bytes()).unwrap(), Path::new("m")).unwrap();
    assert_eq!(back.dialect(), Some("text"));
    assert!(warnings.is_empty(), "{warnings:?}");
    // Another dialect, or the dialect in another protocol, is refused naming the key.
    for extra in [
        r#""family": "llama", "shardkit_dialect": "audio""#,
        r#""family": "clip", "shardkit_dialect": "text", "protocol": "2.0", "pixel_agg": null"#,
    ] {
        let e = Metadata::for_writing(&with(extra)).unwrap_err().to_string();
        assert!(
            e.contains("`shardkit_dialect` must be \"text\""),
            "{extra}: {e}"
        );
    }
    // A vision dataset is untouched: saev loads it.
    let vision = Metadata::for_writing(&with(r#""family": "clip""#)).unwrap();
    assert!(vision.dialect().is_none() && vision.saev_findings().saev_loads());
}
