//! Shared by the integration tests: the saev reference fixtures and their coded values.
#![allow(dead_code)] // each test binary uses a different subset

use std::path::{Path, PathBuf};

/// `shared/fixtures/saev`, beside the repository.
pub fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/fixtures/saev")
}

pub const A_100: &str = "v1.0.0/bc87c00f08bd7bd69b6e64ca1b636ebf86e1ad452a520fa6032818b728a53b47";
pub const B_100: &str = "v1.0.0/abbe30ad92e85b5b2346422cd3fe5d77198b6eb50315ea9f9fac35305004416a";
pub const A_20: &str = "v2.0/eec1d7ba782d48ff23cf8e88b9a79fe637f800b9d56a9b16f2bd03bfcb7a8401";
pub const CRASHED_20: &str =
    "v2.0/36f76cd85cfb77f6ae191c8994a7e313994553017475db89e31564e3464623af";
pub const A_21: &str = "v2.1/aa57b80c";
pub const B_21: &str = "v2.1/1acdd127";
pub const C_21: &str = "v2.1/e64e5d2c";
