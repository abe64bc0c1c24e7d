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
