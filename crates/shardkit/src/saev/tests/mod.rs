//! Unit tests of the saev internals that integration tests cannot reach.

mod props;
mod recipes;
