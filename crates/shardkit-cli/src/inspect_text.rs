//! The human-readable form of `shardkit <format> inspect` (the default; `--json` prints the
//! same summary as JSON): one aligned `key  value` line per value, nested objects as indented
//! sections, lists of objects as numbered entries.

use shardkit::json::{self, Escape, Value};

/// Width of the key column at the top level (nested keys keep the values aligned).
const KEY_WIDTH: usize = 28;

/// `v` (an object) as text, every line ending in a newline.
pub fn render(v: &Value) -> String {
    let mut out = String::new();
    match v {
        Value::Object(members) => members.iter().for_each(|(k, x)| member(k, x, 0, &mut out)),
        other => {
            out.push_str(&scalar(other));
            out.push('\n');
        }
    }
    out
}

/// Prints [`render`]'s text for `v` to stdout.
pub fn print(v: &Value) {
    print!("{}", render(v));
}

fn scalar(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Null => "-".into(),
        Value::Array(items) => {
            let items: Vec<String> = items
                .iter()
                .map(|i| json::to_compact(i, false, Escape::Utf8))
                .collect();
            format!("[{}]", items.join(", "))
        }
        other => json::to_compact(other, false, Escape::Utf8),
    }
}

fn nested(v: &Value) -> bool {
    match v {
        Value::Object(m) => !m.is_empty(),
        Value::Array(items) => items
            .iter()
            .any(|i| matches!(i, Value::Object(_) | Value::Array(_))),
        _ => false,
    }
}

fn member(key: &str, v: &Value, indent: usize, out: &mut String) {
    let pad = " ".repeat(indent);
    if !nested(v) {
        let width = KEY_WIDTH.saturating_sub(indent).max(1);
        out.push_str(&format!("{pad}{key:<width$} {}\n", scalar(v)));
        return;
    }
    out.push_str(&format!("{pad}{key}\n"));
    match v {
        Value::Object(members) => members
            .iter()
            .for_each(|(k, x)| member(k, x, indent + 2, out)),
        Value::Array(items) => {
            for (i, item) in items.iter().enumerate() {
                match item {
                    Value::Object(members) => {
                        out.push_str(&format!("{pad}  [{i}]\n"));
                        members
                            .iter()
                            .for_each(|(k, x)| member(k, x, indent + 4, out));
                    }
                    other => member(&format!("[{i}]"), other, indent + 2, out),
                }
            }
        }
        _ => unreachable!("nested() holds only for objects and arrays"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scalars_align_and_nested_objects_indent() {
        let v = json::parse(
            br#"{"path": "/d", "complete": true, "n": 3, "none": null, "layers": [1, 2],
                 "train": {"format": "v3", "lengths": {"min": 1}},
                 "shards": [{"name": "a", "bytes": 4}]}"#,
        )
        .unwrap();
        let text = render(&v);
        let want = format!(
            "{:<28} /d\n{:<28} true\n{:<28} 3\n{:<28} -\n{:<28} [1, 2]\ntrain\n  {:<26} v3\n  lengths\n    {:<24} 1\nshards\n  [0]\n    {:<24} a\n    {:<24} 4\n",
            "path", "complete", "n", "none", "layers", "format", "min", "name", "bytes"
        );
        assert_eq!(text, want);
    }

    #[test]
    fn empty_containers_are_values() {
        let v = json::parse(br#"{"notes": [], "extra": {}}"#).unwrap();
        assert_eq!(
            render(&v),
            format!("{:<28} []\n{:<28} {{}}\n", "notes", "extra")
        );
    }
}
