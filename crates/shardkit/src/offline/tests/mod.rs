//! Unit tests that need the crate's own hooks: the writer without its value checks
//! ([`super::Writer::add_unchecked`]) and the sum tolerance of the value rules.

mod reference;
mod writer_inputs;
