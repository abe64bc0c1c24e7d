//! The manifest: Java serialization of a `LinkedHashMap<String, Pair<Long, Long>>` mapping
//! each appended variable to its (absolute offset, length) (samediff.md §2, §9.4).
//!
//! The writer produces exactly the bytes OpenJDK's `ObjectOutputStream` writes for DL4J's map,
//! handles and `Long` cache back-references included. The reader is not a Java deserializer: it
//! accepts only that fixed grammar (or the same map as a plain `HashMap`), checks every class
//! descriptor byte for byte, and rejects anything else, so no class is ever named into
//! existence.

use std::collections::{HashMap, HashSet};
use std::path::Path;

use crate::error::{Error, Result};

/// One manifest entry: a variable's blob at an absolute file offset.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Entry {
    /// The variable name.
    pub name: String,
    /// Absolute offset in the file.
    pub offset: u64,
    /// Length in bytes.
    pub length: u64,
}

const MAGIC: [u8; 4] = [0xAC, 0xED, 0x00, 0x05];
const TC_NULL: u8 = 0x70;
const TC_REFERENCE: u8 = 0x71;
const TC_CLASSDESC: u8 = 0x72;
const TC_OBJECT: u8 = 0x73;
const TC_STRING: u8 = 0x74;
const TC_BLOCKDATA: u8 = 0x77;
const TC_ENDBLOCKDATA: u8 = 0x78;
const TC_LONGSTRING: u8 = 0x7C;
const BASE_HANDLE: u32 = 0x7E_0000;

/// The descriptor bytes after `72` of each class, up to and including its annotation end and
/// superclass (exactly what OpenJDK 17 writes; samediff.md §2.2).
fn desc_lhm() -> Vec<u8> {
    let mut v = utf(b"java.util.LinkedHashMap");
    v.extend([
        0x34, 0xC0, 0x4E, 0x5C, 0x10, 0x6C, 0xC0, 0xFB, 0x02, 0x00, 0x01,
    ]);
    v.push(b'Z');
    v.extend(utf(b"accessOrder"));
    v.push(TC_ENDBLOCKDATA);
    v
}
fn desc_hashmap() -> Vec<u8> {
    let mut v = utf(b"java.util.HashMap");
    v.extend([
        0x05, 0x07, 0xDA, 0xC1, 0xC3, 0x16, 0x60, 0xD1, 0x03, 0x00, 0x02,
    ]);
    v.push(b'F');
    v.extend(utf(b"loadFactor"));
    v.push(b'I');
    v.extend(utf(b"threshold"));
    v.push(TC_ENDBLOCKDATA);
    v.push(TC_NULL);
    v
}
const OBJECT_SIG: &[u8] = b"Ljava/lang/Object;";
/// Long's descriptor after its name, up to its annotation end.
fn long_rest() -> Vec<u8> {
    let mut v = vec![
        0x3B, 0x8B, 0xE4, 0x90, 0xCC, 0x8F, 0x23, 0xDF, 0x02, 0x00, 0x01,
    ];
    v.push(b'J');
    v.extend(utf(b"value"));
    v.push(TC_ENDBLOCKDATA);
    v
}
/// Number's descriptor from its name on, superclass end included.
fn number_desc() -> Vec<u8> {
    let mut v = utf(b"java.lang.Number");
    v.extend([
        0x86, 0xAC, 0x95, 0x1D, 0x0B, 0x94, 0xE0, 0x8B, 0x02, 0x00, 0x00,
    ]);
    v.push(TC_ENDBLOCKDATA);
    v.push(TC_NULL);
    v
}
fn desc_long_and_number() -> Vec<u8> {
    let mut v = utf(b"java.lang.Long");
    v.extend(long_rest());
    v.push(TC_CLASSDESC);
    v.extend(number_desc());
    v
}

fn utf(s: &[u8]) -> Vec<u8> {
    let mut v = (s.len() as u16).to_be_bytes().to_vec();
    v.extend_from_slice(s);
    v
}

/// Java's modified UTF-8 of `s` (per UTF-16 unit; NUL as `C0 80`, no 4-byte forms).
pub(crate) fn modified_utf8(s: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(s.len());
    for u in s.encode_utf16() {
        match u {
            0x0001..=0x007F => out.push(u as u8),
            0x0000 | 0x0080..=0x07FF => {
                out.push(0xC0 | (u >> 6) as u8);
                out.push(0x80 | (u & 0x3F) as u8);
            }
            _ => {
                out.push(0xE0 | (u >> 12) as u8);
                out.push(0x80 | ((u >> 6) & 0x3F) as u8);
                out.push(0x80 | (u & 0x3F) as u8);
            }
        }
    }
    out
}

/// HashMap's (threshold, buckets) after `n` successive puts into a default map.
fn sizing(n: usize) -> (i32, i32) {
    if n == 0 {
        return (0, 16);
    }
    let mut buckets: u64 = 16;
    while (n as u64) * 4 > buckets * 3 {
        buckets *= 2;
    }
    let b = buckets.min(1 << 30) as i32;
    (b / 4 * 3, b)
}

/// The manifest bytes for `entries`, in their order.
pub(crate) fn encode(entries: &[Entry]) -> Vec<u8> {
    let mut out = MAGIC.to_vec();
    out.push(TC_OBJECT);
    out.push(TC_CLASSDESC);
    out.extend(desc_lhm());
    out.push(TC_CLASSDESC);
    out.extend(desc_hashmap());
    // Handles so far: LinkedHashMap desc, HashMap desc, the map.
    let mut next = BASE_HANDLE + 3;
    let (threshold, buckets) = sizing(entries.len());
    out.extend(0.75f32.to_be_bytes());
    out.extend(threshold.to_be_bytes());
    out.extend([TC_BLOCKDATA, 8]);
    out.extend(buckets.to_be_bytes());
    out.extend((entries.len() as i32).to_be_bytes());
    let mut pair_desc: Option<u32> = None;
    let mut long_desc: Option<u32> = None;
    // Long.valueOf caches -128..=127: the same object, so a back-reference, on reuse.
    let mut cached: HashMap<i64, u32> = HashMap::new();
    for e in entries {
        let key = modified_utf8(&e.name);
        if key.len() > 0xFFFF {
            out.push(TC_LONGSTRING);
            out.extend((key.len() as i64).to_be_bytes());
        } else {
            out.push(TC_STRING);
            out.extend((key.len() as u16).to_be_bytes());
        }
        out.extend(&key);
        next += 1;
        out.push(TC_OBJECT);
        match pair_desc {
            Some(h) => {
                out.push(TC_REFERENCE);
                out.extend(h.to_be_bytes());
            }
            None => {
                pair_desc = Some(next);
                next += 1;
                out.push(TC_CLASSDESC);
                out.extend(utf(b"org.nd4j.common.primitives.Pair"));
                out.extend([0, 0, 0, 0, 0, 0, 0, 0x77, 0x02, 0x00, 0x02]);
                out.push(b'L');
                out.extend(utf(b"key"));
                out.push(TC_STRING);
                out.extend(utf(OBJECT_SIG));
                let sig = next;
                next += 1;
                out.push(b'L');
                out.extend(utf(b"value"));
                out.push(TC_REFERENCE);
                out.extend(sig.to_be_bytes());
                out.extend([TC_ENDBLOCKDATA, TC_NULL]);
            }
        }
        next += 1; // the Pair
        for v in [e.offset as i64, e.length as i64] {
            if let Some(&h) = cached.get(&v) {
                out.push(TC_REFERENCE);
                out.extend(h.to_be_bytes());
                continue;
            }
            out.push(TC_OBJECT);
            match long_desc {
                Some(h) => {
                    out.push(TC_REFERENCE);
                    out.extend(h.to_be_bytes());
                }
                None => {
                    long_desc = Some(next);
                    next += 2; // Long and Number descriptors
                    out.push(TC_CLASSDESC);
                    out.extend(desc_long_and_number());
                }
            }
            if (-128..=127).contains(&v) {
                cached.insert(v, next);
            }
            next += 1;
            out.extend(v.to_be_bytes());
        }
    }
    out.push(TC_ENDBLOCKDATA);
    out.push(0); // accessOrder = false
    out
}

/// What a handle names (only what the grammar can refer back to).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Handle {
    Desc(Class),
    ObjectSig,
    Key,
    Map,
    Pair,
    Long(i64),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Class {
    LinkedHashMap,
    HashMap,
    Pair,
    Long,
    Number,
}

struct Reader<'a> {
    b: &'a [u8],
    at: usize,
    handles: Vec<Handle>,
    path: &'a Path,
}

impl<'a> Reader<'a> {
    fn err(&self, what: impl std::fmt::Display) -> Error {
        Error::format(
            self.path,
            format!("manifest (Java serialization) at byte {}: {what}", self.at),
        )
    }
    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        let end = self
            .at
            .checked_add(n)
            .filter(|&e| e <= self.b.len())
            .ok_or_else(|| self.err(format!("truncated: {n} more bytes needed")))?;
        let s = &self.b[self.at..end];
        self.at = end;
        Ok(s)
    }
    fn u8(&mut self) -> Result<u8> {
        Ok(self.take(1)?[0])
    }
    fn expect(&mut self, want: &[u8], what: &str) -> Result<()> {
        let got = self.take(want.len())?;
        if got != want {
            self.at -= want.len();
            return Err(self.err(format!("expected {what}")));
        }
        Ok(())
    }
    fn i32(&mut self) -> Result<i32> {
        Ok(i32::from_be_bytes(self.take(4)?.try_into().expect("4")))
    }
    fn i64(&mut self) -> Result<i64> {
        Ok(i64::from_be_bytes(self.take(8)?.try_into().expect("8")))
    }
    fn new_handle(&mut self, h: Handle) -> u32 {
        self.handles.push(h);
        BASE_HANDLE + self.handles.len() as u32 - 1
    }
    fn reference(&mut self) -> Result<Handle> {
        let h = self.i32()? as u32;
        h.checked_sub(BASE_HANDLE)
            .and_then(|i| self.handles.get(i as usize))
            .copied()
            .ok_or_else(|| self.err(format!("reference {h:#x} to no earlier object")))
    }
    /// A class descriptor after its `72`: the name, then exactly one of the known layouts.
    fn class_desc(&mut self, allowed: &[Class]) -> Result<Class> {
        let len = u16::from_be_bytes(self.take(2)?.try_into().expect("2")) as usize;
        let name = self.take(len)?;
        let (class, rest): (Class, Vec<u8>) = match name {
            b"java.util.LinkedHashMap" => (Class::LinkedHashMap, desc_lhm()[25..].to_vec()),
            b"java.util.HashMap" => (Class::HashMap, desc_hashmap()[19..].to_vec()),
            b"org.nd4j.common.primitives.Pair" => (Class::Pair, Vec::new()),
            b"java.lang.Long" => (Class::Long, Vec::new()),
            other => {
                return Err(self.err(format!(
                    "class {:?} is not allowed (only LinkedHashMap/HashMap of String to \
                     org.nd4j.common.primitives.Pair of Long)",
                    String::from_utf8_lossy(other)
                )))
            }
        };
        if !allowed.contains(&class) {
            return Err(self.err(format!("a {class:?} descriptor is not allowed here")));
        }
        if self.handles.contains(&Handle::Desc(class)) {
            return Err(self.err(format!("the {class:?} descriptor is defined twice")));
        }
        let h = self.new_handle(Handle::Desc(class));
        match class {
            Class::Pair => {
                self.expect(
                    &[0, 0, 0, 0, 0, 0, 0, 0x77, 0x02, 0x00, 0x02],
                    "Pair's serialVersionUID 119, flags and 2 fields",
                )?;
                self.expect(b"L\x00\x03key", "field `key`")?;
                let sig = match self.u8()? {
                    TC_STRING => {
                        self.expect(&utf(OBJECT_SIG), "signature Ljava/lang/Object;")?;
                        self.new_handle(Handle::ObjectSig);
                        true
                    }
                    TC_REFERENCE => self.reference()? == Handle::ObjectSig,
                    _ => false,
                };
                if !sig {
                    return Err(self.err("field `key` must be Ljava/lang/Object;"));
                }
                self.expect(b"L\x00\x05value", "field `value`")?;
                let ok = match self.u8()? {
                    TC_REFERENCE => self.reference()? == Handle::ObjectSig,
                    TC_STRING => {
                        self.expect(&utf(OBJECT_SIG), "signature Ljava/lang/Object;")?;
                        self.new_handle(Handle::ObjectSig);
                        true
                    }
                    _ => false,
                };
                if !ok {
                    return Err(self.err("field `value` must be Ljava/lang/Object;"));
                }
                self.expect(
                    &[TC_ENDBLOCKDATA, TC_NULL],
                    "an empty annotation, no superclass",
                )?;
            }
            Class::Long => {
                // Long's fields and annotation, then its superclass Number (its own handle).
                self.expect(&long_rest(), "java.lang.Long's exact descriptor")?;
                self.expect(&[TC_CLASSDESC], "java.lang.Number as Long's superclass")?;
                self.new_handle(Handle::Desc(Class::Number));
                self.expect(&number_desc(), "java.lang.Number's exact descriptor")?;
            }
            Class::LinkedHashMap => {
                self.expect(&rest, "LinkedHashMap's exact descriptor")?;
                self.expect(&[TC_CLASSDESC], "HashMap as LinkedHashMap's superclass")?;
                self.class_desc(&[Class::HashMap])?;
            }
            Class::HashMap => self.expect(&rest, "HashMap's exact descriptor")?,
            Class::Number => unreachable!("named only as Long's superclass"),
        }
        let _ = h;
        Ok(class)
    }
    fn key(&mut self) -> Result<String> {
        let len = match self.u8()? {
            TC_STRING => u16::from_be_bytes(self.take(2)?.try_into().expect("2")) as usize,
            TC_LONGSTRING => {
                let n = self.i64()?;
                usize::try_from(n).map_err(|_| self.err(format!("string length {n}")))?
            }
            t => return Err(self.err(format!("a key must be a string, found tag {t:#04x}"))),
        };
        let bytes = self.take(len)?;
        self.new_handle(Handle::Key);
        decode_modified_utf8(bytes).ok_or_else(|| self.err("a key is not valid modified UTF-8"))
    }
    fn long(&mut self) -> Result<i64> {
        match self.u8()? {
            TC_REFERENCE => match self.reference()? {
                Handle::Long(v) => Ok(v),
                other => Err(self.err(format!("reference to a {other:?}, not a Long"))),
            },
            TC_OBJECT => {
                match self.u8()? {
                    TC_CLASSDESC => {
                        self.class_desc(&[Class::Long])?;
                    }
                    TC_REFERENCE => {
                        if self.reference()? != Handle::Desc(Class::Long) {
                            return Err(self.err("a Pair field must be a java.lang.Long"));
                        }
                    }
                    t => return Err(self.err(format!("unexpected tag {t:#04x}"))),
                }
                let idx = self.handles.len();
                self.new_handle(Handle::Long(0));
                let v = self.i64()?;
                self.handles[idx] = Handle::Long(v);
                Ok(v)
            }
            TC_NULL => Err(self.err("a null offset or length")),
            t => Err(self.err(format!("a Pair field must be a Long, found tag {t:#04x}"))),
        }
    }
}

/// Decodes Java's modified UTF-8 strictly (no raw NUL, no overlong forms but `C0 80`, no
/// 4-byte forms, surrogates paired).
pub(crate) fn decode_modified_utf8(b: &[u8]) -> Option<String> {
    let mut units: Vec<u16> = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        let (u, n) = match c {
            0x01..=0x7F => (u16::from(c), 1),
            0xC0..=0xDF => {
                let c2 = *b.get(i + 1)?;
                if c2 & 0xC0 != 0x80 {
                    return None;
                }
                let u = (u16::from(c & 0x1F) << 6) | u16::from(c2 & 0x3F);
                if u != 0 && u < 0x80 {
                    return None; // overlong (C0 80 for NUL is the one allowed)
                }
                (u, 2)
            }
            0xE0..=0xEF => {
                let (c2, c3) = (*b.get(i + 1)?, *b.get(i + 2)?);
                if c2 & 0xC0 != 0x80 || c3 & 0xC0 != 0x80 {
                    return None;
                }
                let u = (u16::from(c & 0x0F) << 12)
                    | (u16::from(c2 & 0x3F) << 6)
                    | u16::from(c3 & 0x3F);
                if u < 0x800 {
                    return None;
                }
                (u, 3)
            }
            _ => return None,
        };
        units.push(u);
        i += n;
    }
    // Surrogates must pair; decode_utf16 rejects lone ones.
    char::decode_utf16(units.iter().copied())
        .collect::<std::result::Result<String, _>>()
        .ok()
}

/// Parses manifest bytes, accepting only DL4J's map grammar; at most `max_entries` entries.
pub(crate) fn decode(bytes: &[u8], path: &Path, max_entries: usize) -> Result<Vec<Entry>> {
    let mut r = Reader {
        b: bytes,
        at: 0,
        handles: Vec::new(),
        path,
    };
    r.expect(&MAGIC, "the Java serialization magic AC ED 00 05")?;
    r.expect(&[TC_OBJECT], "an object (the map)")?;
    r.expect(&[TC_CLASSDESC], "the map's class descriptor")?;
    let class = r.class_desc(&[Class::LinkedHashMap, Class::HashMap])?;
    r.new_handle(Handle::Map);
    let load_factor = f32::from_be_bytes(r.take(4)?.try_into().expect("4"));
    if !(load_factor.is_finite() && load_factor > 0.0) {
        return Err(r.err(format!(
            "loadFactor {load_factor} must be finite and positive"
        )));
    }
    let _threshold = r.i32()?;
    r.expect(&[TC_BLOCKDATA, 8], "HashMap's 8 bytes of block data")?;
    let _buckets = r.i32()?;
    let size = r.i32()?;
    let remaining = bytes.len() - r.at;
    if size < 0 || size as usize > max_entries || size as usize > remaining / 19 {
        return Err(r.err(format!(
            "{size} entries (at most {max_entries}, and {} fit the remaining bytes)",
            remaining / 19
        )));
    }
    let mut out = Vec::with_capacity(size as usize);
    let mut seen = HashSet::new();
    for _ in 0..size {
        let name = r.key()?;
        if !seen.insert(name.clone()) {
            return Err(r.err(format!("the key {name:?} appears twice")));
        }
        r.expect(&[TC_OBJECT], "a Pair object")?;
        match r.u8()? {
            TC_CLASSDESC => {
                r.class_desc(&[Class::Pair])?;
            }
            TC_REFERENCE => {
                if r.reference()? != Handle::Desc(Class::Pair) {
                    return Err(r.err("a value must be an org.nd4j.common.primitives.Pair"));
                }
            }
            TC_NULL => return Err(r.err(format!("the value of {name:?} is null"))),
            t => return Err(r.err(format!("unexpected tag {t:#04x} for a value"))),
        }
        r.new_handle(Handle::Pair);
        let (offset, length) = (r.long()?, r.long()?);
        let (Ok(offset), Ok(length)) = (u64::try_from(offset), u64::try_from(length)) else {
            return Err(r.err(format!(
                "{name:?}: negative offset {offset} or length {length}"
            )));
        };
        out.push(Entry {
            name,
            offset,
            length,
        });
    }
    r.expect(&[TC_ENDBLOCKDATA], "the end of HashMap's data (78)")?;
    if class == Class::LinkedHashMap {
        match r.u8()? {
            0 | 1 => {}
            b => return Err(r.err(format!("accessOrder byte {b}"))),
        }
    }
    if r.at != bytes.len() {
        return Err(r.err(format!("{} bytes follow the map", bytes.len() - r.at)));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::json::sha256_hex;

    fn e(name: &str, offset: u64, length: u64) -> Entry {
        Entry {
            name: name.into(),
            offset,
            length,
        }
    }

    /// samediff.md §10.4–10.9: OpenJDK 17's bytes.
    #[test]
    fn the_reference_vectors() {
        let empty = encode(&[]);
        assert_eq!(empty.len(), 135);
        assert_eq!(
            sha256_hex(&empty),
            "81ef2a06029f9529646d324413d0cde061a330d940a2a641473bdcf1bc37ba08"
        );
        let one = encode(&[e("w", 1088, 4_194_304)]);
        assert_eq!(one.len(), 319);
        assert_eq!(
            sha256_hex(&one),
            "24e3ed233c00019803c53d4d2b53eb9c0d46b8bdafda140309e7f5471c0baef1"
        );
        let cached = encode(&[e("e1", 4096, 0), e("e2", 4096, 0)]);
        assert_eq!(cached.len(), 350);
        assert_eq!(
            sha256_hex(&cached),
            "ea588bfd7a453b1991728fa2f0686d814b3216f4d86458f763306c0322065dfa"
        );
        let two = encode(&[e("w1", 66_624, 4_194_304), e("w2", 4_260_928, 1_048_580)]);
        assert_eq!(two.len(), 359);
        assert_eq!(
            sha256_hex(&two),
            "21866d7668c914f2a6650b86531b53cc522d987ef3b4c92c41daccf2b2be06d0"
        );
        for (bytes, want) in [
            (&empty, vec![]),
            (&one, vec![e("w", 1088, 4_194_304)]),
            (&cached, vec![e("e1", 4096, 0), e("e2", 4096, 0)]),
        ] {
            assert_eq!(decode(bytes, Path::new("m"), 1 << 20).unwrap(), want);
        }
    }

    #[test]
    fn sizing_keys_and_long_strings() {
        for (n, t, b) in [
            (0, 0, 16),
            (1, 12, 16),
            (12, 12, 16),
            (13, 24, 32),
            (24, 24, 32),
            (25, 48, 64),
            (48, 48, 64),
            (49, 96, 128),
            (96, 96, 128),
            (97, 192, 256),
        ] {
            assert_eq!(sizing(n), (t, b), "{n}");
        }
        assert_eq!(
            modified_utf8("a\u{0}bé€😀"),
            [
                0x61, 0xc0, 0x80, 0x62, 0xc3, 0xa9, 0xe2, 0x82, 0xac, 0xed, 0xa0, 0xbd, 0xed, 0xb8,
                0x80
            ]
        );
        let m = encode(&[e("a\u{0}bé€😀", 64, 8)]);
        assert_eq!(
            m[133..135 + 16],
            [
                0x74, 0x00, 0x0f, 0x61, 0xc0, 0x80, 0x62, 0xc3, 0xa9, 0xe2, 0x82, 0xac, 0xed, 0xa0,
                0xbd, 0xed, 0xb8, 0x80
            ]
        );
        assert_eq!(
            decode(&m, Path::new("m"), 10).unwrap()[0].name,
            "a\u{0}bé€😀"
        );
        let long = "x".repeat(70_000);
        let m = encode(&[e(&long, 1 << 20, 1 << 20)]);
        assert_eq!(m.len(), 70_324);
        assert_eq!(m[133..142], [0x7c, 0, 0, 0, 0, 0, 1, 0x11, 0x70]);
        assert_eq!(decode(&m, Path::new("m"), 10).unwrap()[0].name, long);
        // Many entries with small values: every cached Long after its first use is a reference.
        let many: Vec<Entry> = (0..200)
            .map(|i| e(&format!("v{i}"), 100 + i % 3, i % 5))
            .collect();
        assert_eq!(decode(&encode(&many), Path::new("m"), 1000).unwrap(), many);
    }

    #[test]
    fn only_the_grammar_is_accepted() {
        let good = encode(&[e("w", 1088, 4_194_304), e("v", 4096, 0)]);
        let bad = |b: &[u8]| decode(b, Path::new("m"), 100).unwrap_err().to_string();
        assert!(bad(&good[..good.len() - 1]).contains("truncated"));
        assert!(bad(&[&good[..], &[0]].concat()).contains("follow the map"));
        let mut other = good.clone();
        other[8..31].copy_from_slice(b"java.util.TreeMapXXXXXX");
        assert!(bad(&other).contains("not allowed"));
        let mut suid = good.clone();
        suid[31] ^= 1;
        assert!(bad(&suid).contains("exact descriptor"));
        let mut dup = encode(&[e("w", 64, 8), e("w", 72, 8)]);
        assert!(bad(&dup).contains("twice"));
        dup[4] = 0x7B; // TC_EXCEPTION instead of the map object
        assert!(bad(&dup).contains("expected"));
        assert!(bad(&encode(&[e("w", 1, 1)])[..134]).contains("fit the remaining bytes"));
        // A second Pair descriptor where Java writes a back-reference.
        let twice = encode(&[e("a", 64, 8), e("b", 72, 8)]);
        let first_desc = &twice[138..222];
        let at = twice
            .windows(6)
            .rposition(|w| w == [0x73, 0x71, 0x00, 0x7e, 0x00, 0x04])
            .unwrap();
        let redefined = [&twice[..at + 1], first_desc, &twice[at + 6..]].concat();
        assert!(
            bad(&redefined).contains("defined twice"),
            "{}",
            bad(&redefined)
        );
        // Fewer entries allowed than claimed.
        let many: Vec<Entry> = (0..10).map(|i| e(&format!("v{i}"), 64, i)).collect();
        assert!(decode(&encode(&many), Path::new("m"), 9)
            .unwrap_err()
            .to_string()
            .contains("at most 9"));
        // A bad modified UTF-8 key (a raw 4-byte form).
        let mut utf = encode(&[e("abcd", 64, 8)]);
        utf[136..140].copy_from_slice(&[0xf0, 0x9f, 0x98, 0x80]);
        assert!(bad(&utf).contains("modified UTF-8"));
    }
}
