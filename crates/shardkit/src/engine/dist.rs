//! Which rank this process is: the one parser of `RANK` and `WORLD_SIZE` (as torchrun and
//! SLURM launchers set them) that every loader uses.

use crate::error::{Error, Result};

/// `(rank, world_size)`: the given values, else `$RANK` / `$WORLD_SIZE`, else `(0, 1)`.
/// A malformed variable, a world size of 0 and a rank not below the world size are errors.
pub(crate) fn rank_and_world(rank: Option<u64>, world_size: Option<u64>) -> Result<(u64, u64)> {
    let world = match world_size {
        Some(w) => w,
        None => crate::config::whole("WORLD_SIZE")?.unwrap_or(1),
    };
    let rank = match rank {
        Some(r) => r,
        None => crate::config::whole("RANK")?.unwrap_or(0),
    };
    if world == 0 || rank >= world {
        return Err(Error::Invalid(format!(
            "rank {rank} must be below world_size {world} (and world_size at least 1)"
        )));
    }
    Ok((rank, world))
}

/// Appends `key: state X, this loader Y` to `diff` when the state has `key` and it differs.
pub(crate) fn differ<T: PartialEq>(
    diff: &mut Vec<String>,
    key: &str,
    theirs: Option<&T>,
    mine: &T,
    show: impl Fn(&T) -> String,
) {
    if let Some(t) = theirs {
        if t != mine {
            diff.push(format!(
                "{key}: state {}, this loader {}",
                show(t),
                show(mine)
            ));
        }
    }
}

/// The error for a state whose parameters differ from the loader's (`diff` from [`differ`]), or Ok when none does.
pub(crate) fn refuse(diff: Vec<String>) -> Result<()> {
    if diff.is_empty() {
        return Ok(());
    }
    Err(Error::Invalid(format!(
        "the state was saved by a loader that serves other rows ({}); build the loader with the \
         state's parameters to resume it",
        diff.join("; ")
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn explicit_values_win_and_are_checked() {
        assert_eq!(rank_and_world(Some(2), Some(4)).unwrap(), (2, 4));
        for (rank, world) in [(4, 4), (0, 0)] {
            let err = rank_and_world(Some(rank), Some(world)).unwrap_err();
            let want = format!("rank {rank} must be below world_size {world}");
            assert!(
                matches!(&err, Error::Invalid(m) if m.starts_with(&want)),
                "{err:?}"
            );
        }
    }
}
