//! Unit tests of the saev internals that integration tests cannot reach.

mod metadata;
mod props;
mod recipes;
