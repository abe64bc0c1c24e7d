//! JSON exactly as the reference implementations write it, and the content-hash recipes.
//!
//! Formats hash their metadata files, so "equivalent JSON" is not enough: key order, indentation,
//! escaping and number text must match Python's `json` module (and orjson, which agrees for the
//! values these formats hold) byte for byte. [`Value`] therefore keeps object keys in file order
//! and numbers as their original text, and the emitters reproduce Python's layout:
//!
//! * [`to_pretty`]: `json.dumps(v, indent=n, ensure_ascii=...)` — one member per line, `": "`
//!   between key and value, `,` at line end, `{}`/`[]` for empty containers, no trailing newline.
//! * [`to_compact`]: `json.dumps(v, separators=(",", ":"), sort_keys=...)`.
//! * [`to_python_default`]: `json.dumps(v, sort_keys=True)` with the default `", "`/`": "`.
//!
//! The parser is strict RFC 8259 (no NaN, no trailing commas), refuses duplicate keys and limits
//! nesting depth, so no input can make it panic or exhaust the stack.

use std::fmt::Write as _;

use sha2::{Digest, Sha256};

/// A JSON value that remembers key order and the text of numbers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Value {
    /// `null`
    Null,
    /// `true` / `false`
    Bool(bool),
    /// A number, kept as its source text (always valid JSON number syntax).
    Number(String),
    /// A string.
    String(String),
    /// An array.
    Array(Vec<Value>),
    /// An object; keys are unique and kept in insertion order.
    Object(Vec<(String, Value)>),
}

impl Value {
    /// A number value from an integer.
    pub fn int(i: impl Into<i128>) -> Value {
        Value::Number(i.into().to_string())
    }

    /// A number value from a float, with `digits` digits after the point; NaN and the
    /// infinities (which JSON cannot hold) become `0`.
    pub fn float(x: f64, digits: usize) -> Value {
        Value::Number(if x.is_finite() {
            format!("{x:.digits$}")
        } else {
            "0".into()
        })
    }

    /// The member `key` of an object.
    pub fn get(&self, key: &str) -> Option<&Value> {
        match self {
            Value::Object(m) => m.iter().find(|(k, _)| k == key).map(|(_, v)| v),
            _ => None,
        }
    }

    /// The value as an integer, if it is a number written without fraction or exponent.
    pub fn as_i64(&self) -> Option<i64> {
        match self {
            Value::Number(s) if !s.contains(['.', 'e', 'E']) => s.parse().ok(),
            _ => None,
        }
    }

    /// The value as a non-negative integer, if it is one written without fraction or exponent.
    pub(crate) fn as_u64(&self) -> Option<u64> {
        match self {
            Value::Number(s) if !s.contains(['.', 'e', 'E']) => s.parse().ok(),
            _ => None,
        }
    }

    /// The value as a float, if it is a number.
    pub fn as_f64(&self) -> Option<f64> {
        match self {
            Value::Number(s) => s.parse().ok(),
            _ => None,
        }
    }

    /// The value as a string slice.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }

    /// The same value with every object's keys sorted, as Python's `sort_keys=True` orders them
    /// (by code point, which is UTF-8 byte order).
    pub(crate) fn sorted(&self) -> Value {
        match self {
            Value::Array(items) => Value::Array(items.iter().map(Value::sorted).collect()),
            Value::Object(members) => {
                let mut m: Vec<(String, Value)> = members
                    .iter()
                    .map(|(k, v)| (k.clone(), v.sorted()))
                    .collect();
                m.sort_by(|a, b| a.0.cmp(&b.0));
                Value::Object(m)
            }
            v => v.clone(),
        }
    }

    /// Sets member `key` of an object (replacing it in place, or appending it); a no-op on
    /// other values.
    pub fn set(&mut self, key: &str, value: Value) {
        if let Value::Object(m) = self {
            match m.iter_mut().find(|(k, _)| k == key) {
                Some((_, v)) => *v = value,
                None => m.push((key.to_string(), value)),
            }
        }
    }

    /// A short name of the value's type, for error messages.
    pub(crate) fn type_name(&self) -> &'static str {
        match self {
            Value::Null => "null",
            Value::Bool(_) => "a boolean",
            Value::Number(_) => "a number",
            Value::String(_) => "a string",
            Value::Array(_) => "an array",
            Value::Object(_) => "an object",
        }
    }
}

/// Why a text is not acceptable JSON.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid JSON at byte {offset}: {message}")]
pub struct ParseError {
    /// Byte offset of the problem.
    pub offset: usize,
    /// What is wrong there.
    pub message: String,
}

const MAX_DEPTH: usize = 128;

/// Objects up to this many keys check duplicates by scanning; larger ones use a hash set.
const SCAN_KEYS: usize = 16;

#[cfg(test)]
thread_local! {
    /// Keys compared by the duplicate scan on this thread (tests count the work).
    static SCANNED: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// Parses one JSON document (surrounding whitespace allowed).
pub fn parse(text: &[u8]) -> Result<Value, ParseError> {
    let mut p = Parser { s: text, i: 0 };
    p.ws();
    let v = p.value(0)?;
    p.ws();
    if p.i != p.s.len() {
        return Err(p.err("unexpected data after the JSON value"));
    }
    Ok(v)
}

struct Parser<'a> {
    s: &'a [u8],
    i: usize,
}

impl Parser<'_> {
    fn err(&self, m: &str) -> ParseError {
        ParseError {
            offset: self.i,
            message: m.to_string(),
        }
    }
    fn ws(&mut self) {
        while let Some(b' ' | b'\t' | b'\n' | b'\r') = self.s.get(self.i) {
            self.i += 1;
        }
    }
    fn eat(&mut self, lit: &str) -> Result<(), ParseError> {
        if self.s[self.i..].starts_with(lit.as_bytes()) {
            self.i += lit.len();
            Ok(())
        } else {
            Err(self.err(&format!("expected `{lit}`")))
        }
    }
    fn value(&mut self, depth: usize) -> Result<Value, ParseError> {
        if depth > MAX_DEPTH {
            return Err(self.err("nesting deeper than 128 levels"));
        }
        match self.s.get(self.i) {
            None => Err(self.err("unexpected end of input")),
            Some(b'n') => self.eat("null").map(|_| Value::Null),
            Some(b't') => self.eat("true").map(|_| Value::Bool(true)),
            Some(b'f') => self.eat("false").map(|_| Value::Bool(false)),
            Some(b'"') => self.string().map(Value::String),
            Some(b'-' | b'0'..=b'9') => self.number(),
            Some(b'[') => {
                self.i += 1;
                let mut items = Vec::new();
                self.ws();
                if self.s.get(self.i) == Some(&b']') {
                    self.i += 1;
                    return Ok(Value::Array(items));
                }
                loop {
                    self.ws();
                    items.push(self.value(depth + 1)?);
                    self.ws();
                    match self.s.get(self.i) {
                        Some(b',') => self.i += 1,
                        Some(b']') => {
                            self.i += 1;
                            return Ok(Value::Array(items));
                        }
                        _ => return Err(self.err("expected `,` or `]`")),
                    }
                }
            }
            Some(b'{') => {
                self.i += 1;
                let mut members: Vec<(String, Value)> = Vec::new();
                // Duplicate keys are found by scanning while objects are small, and through a
                // set once they are not: a million-key object stays linear.
                let mut seen: Option<std::collections::HashSet<String>> = None;
                self.ws();
                if self.s.get(self.i) == Some(&b'}') {
                    self.i += 1;
                    return Ok(Value::Object(members));
                }
                loop {
                    self.ws();
                    if self.s.get(self.i) != Some(&b'"') {
                        return Err(self.err("expected a string key"));
                    }
                    let at = self.i;
                    let k = self.string()?;
                    let duplicate = match &mut seen {
                        Some(set) => !set.insert(k.clone()),
                        None => {
                            #[cfg(test)]
                            SCANNED.with(|c| c.set(c.get() + members.len()));
                            let d = members.iter().any(|(m, _)| *m == k);
                            if members.len() >= SCAN_KEYS {
                                let mut set: std::collections::HashSet<String> =
                                    members.iter().map(|(m, _)| m.clone()).collect();
                                set.insert(k.clone());
                                seen = Some(set);
                            }
                            d
                        }
                    };
                    if duplicate {
                        return Err(ParseError {
                            offset: at,
                            message: format!("duplicate key {k:?}"),
                        });
                    }
                    self.ws();
                    self.eat(":")?;
                    self.ws();
                    let v = self.value(depth + 1)?;
                    members.push((k, v));
                    self.ws();
                    match self.s.get(self.i) {
                        Some(b',') => self.i += 1,
                        Some(b'}') => {
                            self.i += 1;
                            return Ok(Value::Object(members));
                        }
                        _ => return Err(self.err("expected `,` or `}`")),
                    }
                }
            }
            Some(_) => Err(self.err("expected a JSON value")),
        }
    }
    fn number(&mut self) -> Result<Value, ParseError> {
        let start = self.i;
        let digits = |p: &mut Self| {
            let s = p.i;
            while let Some(b'0'..=b'9') = p.s.get(p.i) {
                p.i += 1;
            }
            p.i - s
        };
        if self.s.get(self.i) == Some(&b'-') {
            self.i += 1;
        }
        let int_start = self.i;
        let n = digits(self);
        if n == 0 || (n > 1 && self.s[int_start] == b'0') {
            return Err(self.err("invalid number"));
        }
        if self.s.get(self.i) == Some(&b'.') {
            self.i += 1;
            if digits(self) == 0 {
                return Err(self.err("invalid number: no digits after `.`"));
            }
        }
        if let Some(b'e' | b'E') = self.s.get(self.i) {
            self.i += 1;
            if let Some(b'+' | b'-') = self.s.get(self.i) {
                self.i += 1;
            }
            if digits(self) == 0 {
                return Err(self.err("invalid number: no digits in exponent"));
            }
        }
        // The slice is ASCII digits and signs, so it is valid UTF-8.
        Ok(Value::Number(
            String::from_utf8_lossy(&self.s[start..self.i]).into_owned(),
        ))
    }
    fn hex4(&mut self) -> Result<u32, ParseError> {
        // Exactly four hex digits (from_str_radix alone would also take a sign).
        let h = self
            .s
            .get(self.i..self.i + 4)
            .filter(|h| h.iter().all(u8::is_ascii_hexdigit))
            .and_then(|h| std::str::from_utf8(h).ok())
            .and_then(|h| u32::from_str_radix(h, 16).ok())
            .ok_or_else(|| self.err("invalid \\u escape: expected four hex digits"))?;
        self.i += 4;
        Ok(h)
    }
    fn string(&mut self) -> Result<String, ParseError> {
        self.i += 1; // opening quote
        let mut out = Vec::new();
        loop {
            let Some(&b) = self.s.get(self.i) else {
                return Err(self.err("unterminated string"));
            };
            match b {
                b'"' => {
                    self.i += 1;
                    return String::from_utf8(out).map_err(|_| self.err("invalid UTF-8 in string"));
                }
                b'\\' => {
                    self.i += 1;
                    let Some(&e) = self.s.get(self.i) else {
                        return Err(self.err("unterminated escape"));
                    };
                    self.i += 1;
                    let c = match e {
                        b'"' => '"',
                        b'\\' => '\\',
                        b'/' => '/',
                        b'b' => '\u{8}',
                        b'f' => '\u{c}',
                        b'n' => '\n',
                        b'r' => '\r',
                        b't' => '\t',
                        b'u' => {
                            let hi = self.hex4()?;
                            let cp = if (0xD800..0xDC00).contains(&hi)
                                && self.s[self.i..].starts_with(b"\\u")
                            {
                                let save = self.i;
                                self.i += 2;
                                let lo = self.hex4()?;
                                if (0xDC00..0xE000).contains(&lo) {
                                    0x10000 + ((hi - 0xD800) << 10) + (lo - 0xDC00)
                                } else {
                                    self.i = save;
                                    hi
                                }
                            } else {
                                hi
                            };
                            // Lone surrogates cannot be represented in a Rust string.
                            char::from_u32(cp)
                                .ok_or_else(|| self.err("lone surrogate in \\u escape"))?
                        }
                        _ => return Err(self.err("invalid escape")),
                    };
                    let mut buf = [0u8; 4];
                    out.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
                }
                0..=0x1f => return Err(self.err("control character in string")),
                _ => {
                    out.push(b);
                    self.i += 1;
                }
            }
        }
    }
}

/// How strings are escaped on output.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Escape {
    /// Python `ensure_ascii=True`: every code point ≥ U+007F as `\uxxxx` (surrogate pairs above
    /// U+FFFF).
    Ascii,
    /// Python `ensure_ascii=False` / orjson: raw UTF-8, only `"`, `\` and controls escaped.
    Utf8,
}

fn write_str(out: &mut String, s: &str, esc: Escape) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\u{8}' => out.push_str("\\b"),
            '\t' => out.push_str("\\t"),
            '\n' => out.push_str("\\n"),
            '\u{c}' => out.push_str("\\f"),
            '\r' => out.push_str("\\r"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c if esc == Escape::Ascii && (c as u32) >= 0x7f => {
                let mut units = [0u16; 2];
                for u in c.encode_utf16(&mut units) {
                    let _ = write!(out, "\\u{:04x}", u);
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Python `json.dumps(v, indent=indent, ensure_ascii=(esc == Ascii))`, no trailing newline.
pub fn to_pretty(v: &Value, indent: usize, esc: Escape) -> String {
    let mut out = String::new();
    pretty(&mut out, v, indent, 0, esc);
    out
}

fn pretty(out: &mut String, v: &Value, indent: usize, level: usize, esc: Escape) {
    let pad = |out: &mut String, level: usize| {
        out.push('\n');
        out.extend(std::iter::repeat_n(' ', indent * level));
    };
    match v {
        Value::Array(items) if !items.is_empty() => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                pad(out, level + 1);
                pretty(out, item, indent, level + 1, esc);
            }
            pad(out, level);
            out.push(']');
        }
        Value::Object(members) if !members.is_empty() => {
            out.push('{');
            for (i, (k, item)) in members.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                pad(out, level + 1);
                write_str(out, k, esc);
                out.push_str(": ");
                pretty(out, item, indent, level + 1, esc);
            }
            pad(out, level);
            out.push('}');
        }
        _ => scalar(out, v, esc),
    }
}

fn scalar(out: &mut String, v: &Value, esc: Escape) {
    match v {
        Value::Null => out.push_str("null"),
        Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Value::Number(n) => out.push_str(n),
        Value::String(s) => write_str(out, s, esc),
        Value::Array(_) => out.push_str("[]"),
        Value::Object(_) => out.push_str("{}"),
    }
}

/// Python `json.dumps(v, separators=(",", ":"), sort_keys=sort_keys, ensure_ascii=...)`.
pub fn to_compact(v: &Value, sort_keys: bool, esc: Escape) -> String {
    let mut out = String::new();
    flat(&mut out, v, sort_keys, esc, (",", ":"));
    out
}

/// Python `json.dumps(v, sort_keys=True)`: default separators `", "` and `": "`, ASCII-escaped.
pub fn to_python_default(v: &Value) -> String {
    let mut out = String::new();
    flat(&mut out, v, true, Escape::Ascii, (", ", ": "));
    out
}

fn flat(out: &mut String, v: &Value, sort: bool, esc: Escape, sep: (&str, &str)) {
    match v {
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(sep.0);
                }
                flat(out, item, sort, esc, sep);
            }
            out.push(']');
        }
        Value::Object(members) => {
            let mut refs: Vec<&(String, Value)> = members.iter().collect();
            if sort {
                // Python sorts str by code point, which is UTF-8 byte order.
                refs.sort_by(|a, b| a.0.cmp(&b.0));
            }
            out.push('{');
            for (i, (k, item)) in refs.into_iter().enumerate() {
                if i > 0 {
                    out.push_str(sep.0);
                }
                write_str(out, k, esc);
                out.push_str(sep.1);
                flat(out, item, sort, esc, sep);
            }
            out.push('}');
        }
        _ => scalar(out, v, esc),
    }
}

/// The top-level keys of two objects whose values differ (a key in one only counts), sorted:
/// what a refusal to mix two configurations names. Numbers compare by value (`1` equals `1.0`),
/// as in Python. Empty when both are equal by value, or when either is not an object.
pub(crate) fn differing_keys(ours: &Value, theirs: &Value) -> Vec<String> {
    let (Value::Object(a), Value::Object(b)) = (ours, theirs) else {
        return Vec::new();
    };
    let mut keys: Vec<&String> = a.iter().chain(b.iter()).map(|(k, _)| k).collect();
    keys.sort();
    keys.dedup();
    keys.into_iter()
        .filter(|k| match (ours.get(k), theirs.get(k)) {
            (Some(x), Some(y)) => !same_value(x, y),
            _ => true,
        })
        .cloned()
        .collect()
}

/// JSON equality with numbers compared by value.
fn same_value(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Number(x), Value::Number(y)) => {
            x == y
                || match (x.parse::<i128>(), y.parse::<i128>()) {
                    (Ok(p), Ok(q)) => p == q,
                    _ => matches!((x.parse::<f64>(), y.parse::<f64>()), (Ok(p), Ok(q)) if p == q),
                }
        }
        (Value::Array(x), Value::Array(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(p, q)| same_value(p, q))
        }
        (Value::Object(x), Value::Object(y)) => {
            x.len() == y.len()
                && x.iter()
                    .all(|(k, v)| b.get(k).is_some_and(|w| same_value(v, w)))
        }
        _ => a == b,
    }
}

/// Lowercase hex SHA-256 of `bytes`.
pub fn sha256_hex(bytes: &[u8]) -> String {
    let digest = Sha256::digest(bytes);
    let mut s = String::with_capacity(64);
    for b in digest {
        let _ = write!(s, "{b:02x}");
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn duplicate_keys_are_found_in_linear_time() {
        // 200,000 keys: a scan per key would take minutes; a duplicate at the end is still found.
        let n = 200_000;
        let mut text = String::from("{");
        for i in 0..n {
            text.push_str(&format!("\"k{i}\": {i}, "));
        }
        let ok = format!("{}\"last\": 0}}", text);
        SCANNED.with(|c| c.set(0));
        match parse(ok.as_bytes()).unwrap() {
            Value::Object(m) => assert_eq!(m.len(), n + 1),
            other => panic!("{other:?}"),
        }
        // The work counted, not timed: the scan compares only the first SCAN_KEYS + 1 keys
        // (at most 0 + 1 + ... + SCAN_KEYS compares), then the hash set takes over; a scan
        // per key would be ~2 * 10^10 compares.
        let scanned = SCANNED.with(|c| c.get());
        assert!(
            scanned <= SCAN_KEYS * (SCAN_KEYS + 1) / 2,
            "{scanned} keys compared by scanning"
        );
        let dup = format!("{}\"k{}\": 0}}", text, n - 7);
        let e = parse(dup.as_bytes()).unwrap_err();
        assert!(
            e.to_string()
                .contains(&format!("duplicate key \"k{}\"", n - 7)),
            "{e}"
        );
        // And in small objects, by the scan.
        let e = parse(br#"{"a": 1, "b": 2, "a": 3}"#).unwrap_err();
        assert!(e.to_string().contains("duplicate key \"a\""), "{e}");
    }

    #[test]
    fn round_trips_key_order_and_number_text() {
        let text = r#"{"b": 1, "a": [1.50, -0, 1e5], "c": {"z": null, "y": true}}"#;
        let v = parse(text.as_bytes()).unwrap();
        assert_eq!(
            to_compact(&v, false, Escape::Utf8),
            r#"{"b":1,"a":[1.50,-0,1e5],"c":{"z":null,"y":true}}"#
        );
        assert_eq!(
            to_compact(&v, true, Escape::Utf8),
            r#"{"a":[1.50,-0,1e5],"b":1,"c":{"y":true,"z":null}}"#
        );
    }

    #[test]
    fn pretty_matches_python_layout() {
        let v = parse(br#"{"a": [], "b": {}, "c": [1, {"d": "x"}]}"#).unwrap();
        assert_eq!(
            to_pretty(&v, 2, Escape::Utf8),
            "{\n  \"a\": [],\n  \"b\": {},\n  \"c\": [\n    1,\n    {\n      \"d\": \"x\"\n    }\n  ]\n}"
        );
        assert_eq!(
            to_python_default(&v),
            r#"{"a": [], "b": {}, "c": [1, {"d": "x"}]}"#
        );
    }

    #[test]
    fn escaping_follows_python() {
        let v = Value::String("é\u{7f}\u{2028}😀\"\\/\u{1}\n".into());
        assert_eq!(
            to_compact(&v, false, Escape::Ascii),
            r#""\u00e9\u007f\u2028\ud83d\ude00\"\\/\u0001\n""#
        );
        assert_eq!(
            to_compact(&v, false, Escape::Utf8),
            "\"é\u{7f}\u{2028}😀\\\"\\\\/\\u0001\\n\""
        );
        let back = parse(to_compact(&v, false, Escape::Ascii).as_bytes()).unwrap();
        assert_eq!(back, v);
    }

    #[test]
    fn rejects_bad_input() {
        for bad in [
            &b"{\"a\":1,\"a\":2}"[..],
            b"[1,]",
            b"01",
            b"NaN",
            b"\"\\ud800\"",
            b"\"abc",
            b"{\"a\" 1}",
            b"[1] x",
            b"",
            b"\"\x01\"",
        ] {
            assert!(parse(bad).is_err(), "{:?}", String::from_utf8_lossy(bad));
        }
        let deep = "[".repeat(10_000);
        assert!(parse(deep.as_bytes()).is_err());
    }
}
