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

/// A read's stop token, passed explicitly: once its flag is set, the read sends no further
/// request and gives up with [`stopped_error`]. [`Stop::never`] for reads nobody cancels.
#[derive(Debug, Clone, Default)]
pub struct Stop(Option<std::sync::Arc<std::sync::atomic::AtomicBool>>);

impl Stop {
    /// A stop that is never set.
    pub fn never() -> Stop {
        Stop(None)
    }

    /// The stop set by `flag`.
    pub fn new(flag: std::sync::Arc<std::sync::atomic::AtomicBool>) -> Stop {
        Stop(Some(flag))
    }

    /// Whether this is [`Stop::never`].
    pub(crate) fn is_never(&self) -> bool {
        self.0.is_none()
    }

    /// Whether the stop is set.
    pub(crate) fn is_set(&self) -> bool {
        self.0
            .as_ref()
            .is_some_and(|s| s.load(std::sync::atomic::Ordering::Relaxed))
    }

    /// An error ([`stopped_error`]) once the stop is set.
    pub(crate) fn check(&self) -> crate::error::Result<()> {
        match self.is_set() {
            true => Err(stopped_error()),
            false => Ok(()),
        }
    }

    /// The flag, if any.
    pub(crate) fn flag(&self) -> Option<std::sync::Arc<std::sync::atomic::AtomicBool>> {
        self.0.clone()
    }
}
