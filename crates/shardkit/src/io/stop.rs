//! Stopping reads: a stopped read gives up with [`stopped_error`], checked every [`STOP_POLL`]
//! while it waits.

use crate::error::Error;

/// How often a preparation waiting on something slow (a read from a store, a shuffle buffer
/// read ahead) checks whether its stream was stopped.
pub(crate) const STOP_POLL: std::time::Duration = std::time::Duration::from_millis(50);

/// What a preparation that gave up because its stream was stopped returns (nobody sees it: the
/// stream's consumer is gone).
pub(crate) fn stopped_error() -> Error {
    Error::Invalid("the loader was stopped".into())
}
