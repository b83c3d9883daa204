//! An answer as a person reads it: objects as `key  value` lines, lists of objects as tables,
//! addresses in hex and byte counts with their unit.

use std::fmt::Write as _;

use serde_json::{Map, Value};

/// Fields besides addresses whose numbers read best in hex: an instruction pointer, the
/// patterns a verify found and expected.
const HEX_FIELDS: [&str; 3] = ["rip", "found", "expected"];

/// Fields whose numbers are bytes, shown with a binary unit.
const BYTE_FIELDS: [&str; 12] = [
    "size",
    "slot_size",
    "max_guest_memory",
    "max_region_size",
    "max_metadata",
    "guest_memory",
    "metadata",
    "bytes_sent",
    "guest_memory_bytes",
    "done_bytes",
    "page_size",
    "throughput_bytes_per_second",
];

/// `bytes` in the largest binary unit that divides it, else with two decimals.
fn human_bytes(bytes: u64) -> String {
    const UNITS: [(u64, &str); 4] = [
        (1 << 40, "TiB"),
        (1 << 30, "GiB"),
        (1 << 20, "MiB"),
        (1 << 10, "KiB"),
    ];
    for (size, unit) in UNITS {
        if bytes >= size {
            return if bytes.is_multiple_of(size) {
                format!("{} {unit}", bytes / size)
            } else {
                format!("{:.2} {unit}", bytes as f64 / size as f64)
            };
        }
    }
    format!("{bytes} B")
}

/// One value as a table cell: addresses in hex, byte counts with their unit, ranges as
/// `[start, end)`.
fn cell(key: &str, value: &Value) -> String {
    match value {
        Value::Null => "-".to_owned(),
        Value::String(text) => text.clone(),
        Value::Number(n) if key.contains("address") || HEX_FIELDS.contains(&key) => n
            .as_u64()
            .map_or_else(|| n.to_string(), |a| format!("{a:#x}")),
        Value::Number(n) if BYTE_FIELDS.contains(&key) => {
            let bytes = n.as_u64().or_else(|| n.as_f64().map(|b| b as u64));
            let per = if key.ends_with("_per_second") {
                "/s"
            } else {
                ""
            };
            bytes.map_or_else(|| n.to_string(), |b| human_bytes(b) + per)
        }
        Value::Number(n) => match n.as_f64() {
            Some(f) if n.is_f64() => format!("{f:.1}"),
            _ => n.to_string(),
        },
        Value::Array(items)
            if items
                .iter()
                .all(|i| i.as_array().is_some_and(|r| r.len() == 2)) =>
        {
            let ranges: Vec<String> = items
                .iter()
                .filter_map(Value::as_array)
                .map(|r| format!("[{}, {})", cell("address", &r[0]), cell("address", &r[1])))
                .collect();
            if ranges.is_empty() {
                "-".to_owned()
            } else {
                ranges.join(" ")
            }
        }
        Value::Array(items) => {
            let cells: Vec<String> = items.iter().map(|i| cell(key, i)).collect();
            if cells.is_empty() {
                "-".to_owned()
            } else {
                cells.join(", ")
            }
        }
        other => other.to_string(),
    }
}

/// A list of objects as a table with a header row, columns aligned, `id` first.
fn table(out: &mut String, indent: &str, rows: &[Map<String, Value>]) {
    let mut columns: Vec<&str> = Vec::new();
    for row in rows {
        for key in row.keys() {
            if !columns.contains(&key.as_str()) {
                columns.push(key);
            }
        }
    }
    columns.sort_by_key(|c| *c != "id");
    let cells: Vec<Vec<String>> = rows
        .iter()
        .map(|row| {
            columns
                .iter()
                .map(|c| row.get(*c).map_or_else(|| "-".to_owned(), |v| cell(c, v)))
                .collect()
        })
        .collect();
    let widths: Vec<usize> = columns
        .iter()
        .enumerate()
        .map(|(i, c)| {
            cells
                .iter()
                .map(|r| r[i].len())
                .chain([c.len()])
                .max()
                .unwrap_or(0)
        })
        .collect();
    let line = |out: &mut String, values: Vec<&str>| {
        let padded: Vec<String> = values
            .iter()
            .zip(&widths)
            .map(|(v, w)| format!("{v:<w$}"))
            .collect();
        let _ = writeln!(out, "{indent}{}", padded.join("  ").trim_end());
    };
    line(out, columns.clone());
    for row in &cells {
        line(out, row.iter().map(String::as_str).collect());
    }
}

/// An object's fields as `name  value` lines, nested objects indented under their name and
/// lists of objects as tables.
fn fields(out: &mut String, indent: &str, object: &Map<String, Value>) {
    let width = object.keys().map(String::len).max().unwrap_or(0);
    for (key, value) in object {
        match value {
            Value::Object(inner) if !inner.is_empty() => {
                let _ = writeln!(out, "{indent}{key}:");
                fields(out, &format!("{indent}  "), inner);
            }
            Value::Array(items) if !items.is_empty() && items.iter().all(Value::is_object) => {
                let _ = writeln!(out, "{indent}{key}:");
                let rows: Vec<Map<String, Value>> =
                    items.iter().filter_map(Value::as_object).cloned().collect();
                table(out, &format!("{indent}  "), &rows);
            }
            _ => {
                let _ = writeln!(out, "{indent}{key:<width$}  {}", cell(key, value));
            }
        }
    }
}

/// An answer as a person reads it: `done` for an answer without a body, a refusal's message,
/// or the body's fields and tables.
pub(super) fn render(status: u16, body: &Value) -> String {
    let mut out = String::new();
    match body {
        Value::Null => {
            let _ = writeln!(out, "done ({status})");
        }
        Value::Object(object) => match object.get("fault_message").and_then(Value::as_str) {
            Some(message) => {
                let _ = writeln!(out, "{status}: {message}");
            }
            None => fields(&mut out, "", object),
        },
        Value::String(text) => out.push_str(text),
        other => {
            let _ = writeln!(out, "{other}");
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::jobs::client::exit_status;

    #[test]
    fn answers_read_as_tables_with_units() {
        let memory = json!({
            "slots": {"used": 2, "free": 32762, "max": 32764},
            "regions": [
                {"id": 0, "guest_address": 0, "size": 2097152, "read_only": false},
                {"id": 1, "guest_address": 268435456, "size": 268435456, "read_only": true},
            ],
        });
        let text = render(200, &memory);
        assert!(text.contains("slots:\n  free  32762\n"), "{text}");
        assert!(
            text.contains("  id  guest_address  read_only  size\n"),
            "{text}"
        );
        assert!(
            text.contains("  1   0x10000000     true       256 MiB\n"),
            "{text}"
        );
        assert_eq!(render(204, &Value::Null), "done (204)\n");
        assert_eq!(
            render(404, &json!({"fault_message": "region 7 does not exist"})),
            "404: region 7 does not exist\n"
        );
        assert_eq!(exit_status(201), 0);
        assert_eq!(exit_status(409), 4);
        assert_eq!(exit_status(503), 5);
    }
}
