//! The outcome of validating a dataset, shared by the formats that report problems and notes.

use crate::json::Value;

/// Every problem found (empty when valid), and facts worth knowing that are not problems.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Validation {
    /// Violations, each naming the file or part it concerns.
    pub errors: Vec<String>,
    /// Facts that are not violations (an absent optional part, leftover temporaries).
    pub notes: Vec<String>,
}

impl Validation {
    /// Whether nothing is wrong.
    pub fn is_valid(&self) -> bool {
        self.errors.is_empty()
    }
    /// `{"valid": bool, "errors": [...], "notes": [...]}`.
    pub fn to_json(&self) -> Value {
        let strings = |v: &[String]| Value::Array(v.iter().cloned().map(Value::String).collect());
        Value::Object(vec![
            ("valid".into(), Value::Bool(self.is_valid())),
            ("errors".into(), strings(&self.errors)),
            ("notes".into(), strings(&self.notes)),
        ])
    }
}
