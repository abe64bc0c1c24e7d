//! Unit tests of the format's internals.

#[cfg(feature = "zarr")]
mod io;
mod seqax;
