//! Unit tests of the format's internals.

mod fixture;
mod io;
mod seqax;
