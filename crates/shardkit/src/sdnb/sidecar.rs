//! What checksums need to know of a container: its files and how they are named
//! ([`crate::checksum::Container`]).

use std::path::{Path, PathBuf};

use super::read::{base_name, Container, Kind};
use super::sdz::parse_shard_name;
use crate::checksum;
use crate::error::Result;

/// SDNB's file naming: `BASE.sdnb`, `BASE.sdz`, and the shard set `BASE.shard<i>-of-<N>.sdnb`.
pub(crate) struct Naming;

impl checksum::Naming for Naming {
    fn is_shard(&self, name: &str) -> bool {
        parse_shard_name(name).is_some()
    }

    fn base<'a>(&self, name: &'a str) -> &'a str {
        match parse_shard_name(name) {
            Some((b, _, _)) => b,
            None => base_name(name),
        }
    }
}

impl checksum::Container for Container {
    fn path(&self) -> &Path {
        Container::path(self)
    }

    fn files(&self) -> Vec<PathBuf> {
        Container::files(self)
    }

    fn sharded(&self) -> bool {
        matches!(self.kind(), Kind::Sharded { .. })
    }

    fn naming(&self) -> &'static dyn checksum::Naming {
        &Naming
    }
}

/// The container at `path` (local or in a store), as checksums see it.
pub(crate) fn open(path: &Path) -> Result<Box<dyn checksum::Container>> {
    Ok(Box::new(super::open(path)?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checksum::{
        container_sidecar_names, legacy_bytes_cover, Checksums, FileSums, Journal,
    };

    #[test]
    fn container_sidecars_are_named_per_container_and_old_names_are_read() {
        assert_eq!(
            container_sidecar_names(&Naming, "m.sdnb", false),
            ("m.sdnb.checksums.json".into(), "m.checksums.json".into())
        );
        assert_eq!(
            container_sidecar_names(&Naming, "m.sdz", false),
            ("m.sdz.checksums.json".into(), "m.checksums.json".into())
        );
        for name in ["m.sdnb", "m.shard0-of-3.sdnb", "m"] {
            assert_eq!(
                container_sidecar_names(&Naming, name, true),
                (
                    "m.shard-set.checksums.json".into(),
                    "m.checksums.json".into()
                )
            );
        }
        let doc = |names: &[&str]| {
            let mut c = Checksums::default();
            for n in names {
                c.files.insert(n.to_string(), FileSums::of_bytes(b"x"));
            }
            // A journal without facts is a sidecar document.
            Journal {
                files: c,
                facts: Vec::new(),
            }
            .to_bytes()
        };
        let at = Path::new("m.checksums.json");
        assert!(legacy_bytes_cover(
            &Naming,
            &doc(&["m.sdnb"]),
            at,
            "m.sdnb",
            false
        ));
        assert!(!legacy_bytes_cover(
            &Naming,
            &doc(&["m.sdnb"]),
            at,
            "m.sdz",
            false
        ));
        let set = doc(&["m.shard0-of-2.sdnb", "m.shard1-of-2.sdnb"]);
        assert!(legacy_bytes_cover(&Naming, &set, at, "m.sdnb", true));
        assert!(legacy_bytes_cover(
            &Naming,
            &set,
            at,
            "m.shard1-of-2.sdnb",
            true
        ));
        assert!(!legacy_bytes_cover(&Naming, &set, at, "m.sdnb", false));
        assert!(!legacy_bytes_cover(&Naming, &doc(&[]), at, "m.sdnb", false));
    }
}
