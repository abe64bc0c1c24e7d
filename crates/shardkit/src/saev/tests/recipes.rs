//! The directory-name recipes against the saev reference fixtures (moved from
//! tests/saev_fixtures.rs: `Recipe` is internal).

use std::path::{Path, PathBuf};

use crate::saev::metadata::Recipe;
use crate::saev::Metadata;

/// The saev reference fixtures (as tests/common/mod.rs finds them).
fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/fixtures/saev")
}

const A_100: &str = "v1.0.0/bc87c00f08bd7bd69b6e64ca1b636ebf86e1ad452a520fa6032818b728a53b47";
const A_21: &str = "v2.1/aa57b80c";

#[test]
fn each_recipe_hashes_the_text_saev_hashes() {
    let (a21, _) = Metadata::read(&fixtures().join(A_21)).unwrap();
    assert_eq!(
        Recipe::R1.name(a21.raw()),
        "824f7461b7a944f8227fac3108a519ca370d92a9a2a72944c2fbb0ec7a341099"
    );
    assert_eq!(
        Recipe::R2Full.name(a21.raw()),
        "aa57b80c954143ca251aa03a0b9bc58a2f12ca96d7419f04db501a97df3ab3fd"
    );
    assert_eq!(Recipe::R2.hashed_text(a21.raw()).len(), 369);
    let (a100, _) = Metadata::read(&fixtures().join(A_100)).unwrap();
    assert_eq!(
        Recipe::R1.hashed_text(a100.raw()),
        r#"{"cls_token":true,"d_vit":8,"data":{"__class__":"Fake","n_imgs":7},"dtype":"float32","layers":[-2,-1],"max_patches_per_shard":30,"n_imgs":7,"n_patches_per_img":4,"protocol":"1.0.0","vit_ckpt":"hf-hub:hf-internal-testing/tiny-open-clip-model","vit_family":"clip"}"#
    );
}
