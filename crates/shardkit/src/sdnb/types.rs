//! The enums of the FlatGraph schema shardkit interprets (samediff.md §3.1).

use crate::error::{Error, Result};

/// A tensor's element type (the schema's `DType`, an i8 code).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    /// 0: no type of its own; never written.
    Inherit,
    /// 1, one byte per element (0/1).
    Bool,
    /// 2, FP8 e4m3, one byte.
    Float8,
    /// 3, IEEE half.
    Half,
    /// 4: declared by the schema, no fixed width here.
    Half2,
    /// 5, float32.
    Float,
    /// 6, float64.
    Double,
    /// 7.
    Int8,
    /// 8.
    Int16,
    /// 9.
    Int32,
    /// 10.
    Int64,
    /// 11.
    Uint8,
    /// 12.
    Uint16,
    /// 13.
    Uint32,
    /// 14.
    Uint64,
    /// 15: no fixed width here.
    QInt8,
    /// 16: no fixed width here.
    QInt16,
    /// 17, bfloat16.
    Bfloat16,
    /// 50: variable-width strings; cannot carry tensor bytes in this format.
    Utf8,
    /// 51: as Utf8.
    Utf16,
    /// 52: as Utf8.
    Utf32,
}

impl DType {
    /// The type of a schema code; unknown codes are an error (FLOAT8_E5M2's code is not in
    /// any schema copy, samediff.md §3.1).
    pub(crate) fn from_code(code: i8) -> Result<DType> {
        use DType::*;
        Ok(match code {
            0 => Inherit,
            1 => Bool,
            2 => Float8,
            3 => Half,
            4 => Half2,
            5 => Float,
            6 => Double,
            7 => Int8,
            8 => Int16,
            9 => Int32,
            10 => Int64,
            11 => Uint8,
            12 => Uint16,
            13 => Uint32,
            14 => Uint64,
            15 => QInt8,
            16 => QInt16,
            17 => Bfloat16,
            50 => Utf8,
            51 => Utf16,
            52 => Utf32,
            other => {
                return Err(Error::Invalid(format!(
                    "unknown DType code {other} (known: 0-17, 50-52)"
                )))
            }
        })
    }
    /// The schema code.
    pub(crate) fn code(self) -> i8 {
        use DType::*;
        match self {
            Inherit => 0,
            Bool => 1,
            Float8 => 2,
            Half => 3,
            Half2 => 4,
            Float => 5,
            Double => 6,
            Int8 => 7,
            Int16 => 8,
            Int32 => 9,
            Int64 => 10,
            Uint8 => 11,
            Uint16 => 12,
            Uint32 => 13,
            Uint64 => 14,
            QInt8 => 15,
            QInt16 => 16,
            Bfloat16 => 17,
            Utf8 => 50,
            Utf16 => 51,
            Utf32 => 52,
        }
    }
    /// Bytes per element, for the types that can carry tensor bytes.
    pub(crate) fn width(self) -> Option<usize> {
        use DType::*;
        match self {
            Bool | Float8 | Int8 | Uint8 => Some(1),
            Half | Int16 | Uint16 | Bfloat16 => Some(2),
            Float | Int32 | Uint32 => Some(4),
            Double | Int64 | Uint64 => Some(8),
            _ => None,
        }
    }
    /// The schema's name ("FLOAT", "BFLOAT16", ...).
    pub(crate) fn name(self) -> &'static str {
        use DType::*;
        match self {
            Inherit => "INHERIT",
            Bool => "BOOL",
            Float8 => "FLOAT8",
            Half => "HALF",
            Half2 => "HALF2",
            Float => "FLOAT",
            Double => "DOUBLE",
            Int8 => "INT8",
            Int16 => "INT16",
            Int32 => "INT32",
            Int64 => "INT64",
            Uint8 => "UINT8",
            Uint16 => "UINT16",
            Uint32 => "UINT32",
            Uint64 => "UINT64",
            QInt8 => "QINT8",
            QInt16 => "QINT16",
            Bfloat16 => "BFLOAT16",
            Utf8 => "UTF8",
            Utf16 => "UTF16",
            Utf32 => "UTF32",
        }
    }
}

/// The schema's name ("FLOAT", "BFLOAT16", ...), as `FromStr` reads it.
impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.pad(self.name())
    }
}

impl std::str::FromStr for DType {
    type Err = Error;
    fn from_str(s: &str) -> Result<DType> {
        (0..=52i8)
            .filter_map(|c| DType::from_code(c).ok())
            .find(|d| d.name().eq_ignore_ascii_case(s))
            .ok_or_else(|| Error::Invalid(format!("unknown dtype {s:?}")))
    }
}

/// How a variable is used (the schema's `VarType`, an i8 code).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum VarType {
    /// 0: a trainable parameter.
    Variable,
    /// 1: a constant.
    Constant,
    /// 2: an op's output (no stored data).
    Array,
    /// 3: an input fed at run time (no stored data).
    Placeholder,
    /// 4: a sequence (DL4J skips them when writing).
    Sequence,
}

impl VarType {
    /// The type of a schema code; unknown codes are an error.
    pub(crate) fn from_code(code: i8) -> Result<VarType> {
        Ok(match code {
            0 => VarType::Variable,
            1 => VarType::Constant,
            2 => VarType::Array,
            3 => VarType::Placeholder,
            4 => VarType::Sequence,
            other => {
                return Err(Error::Invalid(format!(
                    "unknown VarType code {other} (known: 0-4)"
                )))
            }
        })
    }
    /// The schema code.
    pub(crate) fn code(self) -> i8 {
        match self {
            VarType::Variable => 0,
            VarType::Constant => 1,
            VarType::Array => 2,
            VarType::Placeholder => 3,
            VarType::Sequence => 4,
        }
    }
    /// "VARIABLE", "CONSTANT", ...
    pub(crate) fn name(self) -> &'static str {
        match self {
            VarType::Variable => "VARIABLE",
            VarType::Constant => "CONSTANT",
            VarType::Array => "ARRAY",
            VarType::Placeholder => "PLACEHOLDER",
            VarType::Sequence => "SEQUENCE",
        }
    }
    /// Whether variables of this type carry stored arrays.
    pub(crate) fn has_data(self) -> bool {
        matches!(self, VarType::Variable | VarType::Constant)
    }
}

/// The element order of stored bytes (`FlatArray.byteOrder`, reused by SDNB for c/f).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Order {
    /// 0: row-major.
    C,
    /// 1: column-major.
    F,
}

impl std::str::FromStr for VarType {
    type Err = Error;
    fn from_str(s: &str) -> Result<VarType> {
        (0..=4i8)
            .filter_map(|c| VarType::from_code(c).ok())
            .find(|v| v.name().eq_ignore_ascii_case(s))
            .ok_or_else(|| Error::Invalid(format!("unknown variable type {s:?}")))
    }
}

/// "VARIABLE", "CONSTANT", ..., as `FromStr` reads it.
impl std::fmt::Display for VarType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.pad(self.name())
    }
}
