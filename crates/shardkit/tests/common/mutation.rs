//! Byte mutations of JSON documents for property tests: flips, overwrites, digit changes and
//! inserted snippets that keep most files valid JSON, so the checks behind the parser run.
//! Shared by tests/saev_robustness.rs and the crate's own saev property tests
//! (src/saev/tests/props.rs), which include this file by path.
#![allow(dead_code)] // each includer uses a different subset

use proptest::prelude::*;

#[derive(Debug, Clone)]
pub(crate) enum Mutation {
    /// XOR one byte.
    Flip(usize, u8),
    /// Overwrite one byte.
    Set(usize, u8),
    /// Replace the i-th ASCII digit of the text by another digit (keeps most files valid JSON,
    /// so the semantic checks behind the parser get exercised).
    Digit(usize, u8),
    /// Insert a JSON-ish snippet.
    Splice(usize, &'static str),
    /// Delete one byte.
    Remove(usize),
    /// Cut the text.
    Truncate(usize),
}

const SNIPPETS: &[&str] = &[
    "-",
    "0",
    "9",
    "99999999999999999999",
    "9223372036854775",
    ".5",
    "e9",
    "\"",
    ",",
    ":",
    "null",
    "[",
    "]",
    "{}",
    "\\u0000",
    "\\ud800",
    "\u{e9}",
    "../",
];

const JSON_BYTES: &[u8] = b"{}[]\":,.-+eE0123456789\\/ubfnrtal \n\x01\xc3\xa9\xed\xa0\x80";

pub(crate) fn json_byte() -> impl Strategy<Value = u8> {
    prop_oneof![any::<u8>(), proptest::sample::select(JSON_BYTES)]
}

pub(crate) fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        1 => (any::<usize>(), 1..=255u8).prop_map(|(i, b)| Mutation::Flip(i, b)),
        1 => (any::<usize>(), json_byte()).prop_map(|(i, b)| Mutation::Set(i, b)),
        4 => (any::<usize>(), b'0'..=b'9').prop_map(|(i, d)| Mutation::Digit(i, d)),
        2 => (any::<usize>(), proptest::sample::select(SNIPPETS))
            .prop_map(|(i, t)| Mutation::Splice(i, t)),
        1 => any::<usize>().prop_map(Mutation::Remove),
        1 => any::<usize>().prop_map(Mutation::Truncate),
    ]
}

pub(crate) fn mutate(mut bytes: Vec<u8>, muts: &[Mutation]) -> Vec<u8> {
    for m in muts {
        let len = bytes.len();
        match *m {
            Mutation::Flip(i, b) if len > 0 => bytes[i % len] ^= b,
            Mutation::Set(i, b) if len > 0 => bytes[i % len] = b,
            Mutation::Digit(i, d) => {
                let digits: Vec<usize> = (0..len).filter(|&j| bytes[j].is_ascii_digit()).collect();
                if !digits.is_empty() {
                    bytes[digits[i % digits.len()]] = d;
                }
            }
            Mutation::Splice(i, t) => {
                let at = i % (len + 1);
                bytes.splice(at..at, t.bytes());
            }
            Mutation::Remove(i) if len > 0 => {
                bytes.remove(i % len);
            }
            Mutation::Truncate(i) => bytes.truncate(i % (len + 1)),
            _ => {}
        }
    }
    bytes
}
