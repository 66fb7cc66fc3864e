//! Values printed the way Python prints them, because transformers renders
//! chat templates with Jinja2 on Python objects:
//! - `{{ value }}` is `str(value)`: `None`, `True`, `1e+16`, `['a', 1]`,
//!   `{'k': 'v'}` (see [`python_str`]);
//! - `tojson` is `json.dumps(x, ensure_ascii=False, indent=..., separators=...,
//!   sort_keys=...)` (see [`json_dumps`]).
//!
//! Bounds: nesting deeper than [`MAX_DEPTH`] is an error (values from JSON
//! and templates are trees, so the work is linear in their size).
//! `repr` of a string escapes the characters Python's `str.isprintable()`
//! refuses in the ranges listed in [`is_printable`]; unassigned code points
//! (which Python also escapes) are printed as they are.

use std::fmt::Write as _;

use minijinja::value::ValueKind;
use minijinja::{Error, ErrorKind, Value};

/// How deep lists and dicts may nest before printing gives up.
pub(crate) const MAX_DEPTH: usize = 256;

fn too_deep() -> Error {
    Error::new(
        ErrorKind::InvalidOperation,
        format!("value nests deeper than {MAX_DEPTH} levels"),
    )
}

fn not_serializable(value: &Value) -> Error {
    let type_name = match value.kind() {
        ValueKind::Undefined => "Undefined",
        ValueKind::Bytes => "bytes",
        _ => "object",
    };
    Error::new(
        ErrorKind::InvalidOperation,
        format!("Object of type {type_name} is not JSON serializable"),
    )
}

/// Python's `repr(float)` (`json.dumps` writes the same digits): the
/// shortest round-trip digits, fixed notation for decimal exponents in
/// `-4..16` with at least one fractional digit, else `d.ddde+XX`.
pub(crate) fn float_repr(x: f64, out: &mut String) {
    if x.is_nan() {
        out.push_str("nan");
        return;
    }
    if x.is_infinite() {
        out.push_str(if x > 0.0 { "inf" } else { "-inf" });
        return;
    }
    if x == 0.0 {
        out.push_str(if x.is_sign_negative() { "-0.0" } else { "0.0" });
        return;
    }
    // `{:e}` gives the shortest round-trip digits as `-d.ddde-N`.
    let sci = format!("{x:e}");
    let (mantissa, exp) = sci.split_once('e').unwrap_or((sci.as_str(), "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let (negative, mantissa) = match mantissa.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, mantissa),
    };
    let digits: String = mantissa.chars().filter(char::is_ascii_digit).collect();
    if negative {
        out.push('-');
    }
    if (-4..16).contains(&exp) {
        if exp >= 0 {
            let int_len = usize::try_from(exp).unwrap_or(0) + 1;
            if digits.len() <= int_len {
                out.push_str(&digits);
                out.extend(std::iter::repeat_n('0', int_len - digits.len()));
                out.push_str(".0");
            } else {
                let (int_part, frac) = digits.split_at(int_len);
                let _ = write!(out, "{int_part}.{frac}");
            }
        } else {
            out.push_str("0.");
            out.extend(std::iter::repeat_n(
                '0',
                usize::try_from(-exp - 1).unwrap_or(0),
            ));
            out.push_str(&digits);
        }
    } else {
        let (first, rest) = digits.split_at(digits.len().min(1));
        out.push_str(first);
        if !rest.is_empty() {
            out.push('.');
            out.push_str(rest);
        }
        let sign = if exp < 0 { '-' } else { '+' };
        let _ = write!(out, "e{sign}{:02}", exp.unsigned_abs());
    }
}

/// Writes a number as Python prints it (ints in full, floats by repr).
fn number(value: &Value, out: &mut String) {
    if value.is_integer() {
        // Display of an integer value is its decimal digits.
        let _ = write!(out, "{value}");
    } else if let Ok(x) = f64::try_from(value.clone()) {
        float_repr(x, out);
    } else {
        let _ = write!(out, "{value}");
    }
}

/// Python's `str.isprintable()` for the ranges that matter in chat text:
/// controls, the C1 block, separators other than the space, and the format
/// characters (zero-width joiners, bidi marks, BOM, soft hyphen).
fn is_printable(c: char) -> bool {
    !matches!(c as u32,
        0x00..=0x1f | 0x7f..=0xa0 | 0xad
        | 0x600..=0x605 | 0x61c | 0x6dd | 0x70f | 0x890..=0x891 | 0x8e2
        | 0x1680 | 0x180e | 0x2000..=0x200f | 0x2028..=0x202f | 0x205f..=0x2064
        | 0x2066..=0x206f | 0x3000 | 0xd800..=0xf8ff | 0xfeff | 0xfff9..=0xfffb
        | 0x110bd | 0x110cd | 0x13430..=0x1343f | 0x1bca0..=0x1bca3 | 0x1d173..=0x1d17a
        | 0xe0001 | 0xe0020..=0xe007f | 0xf0000..)
}

/// Python's `repr(str)`.
fn string_repr(s: &str, out: &mut String) {
    let quote = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if is_printable(c) => out.push(c),
            c if (c as u32) < 0x100 => {
                let _ = write!(out, "\\x{:02x}", c as u32);
            }
            c if (c as u32) < 0x10000 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => {
                let _ = write!(out, "\\U{:08x}", c as u32);
            }
        }
    }
    out.push(quote);
}

/// Python's `str(value)`: strings as they are, everything else by repr.
/// Undefined prints as nothing (Jinja2's default `Undefined`).
pub(crate) fn python_str(value: &Value, out: &mut String) -> Result<(), Error> {
    match value.kind() {
        ValueKind::Undefined => Ok(()),
        ValueKind::String => {
            out.push_str(value.as_str().unwrap_or_default());
            Ok(())
        }
        _ => python_repr(value, out, 0),
    }
}

/// Python's `repr(value)` for the types a template sees.
fn python_repr(value: &Value, out: &mut String, depth: usize) -> Result<(), Error> {
    if depth > MAX_DEPTH {
        return Err(too_deep());
    }
    match value.kind() {
        ValueKind::Undefined => {}
        ValueKind::None => out.push_str("None"),
        ValueKind::Bool => out.push_str(if value.is_true() { "True" } else { "False" }),
        ValueKind::Number => number(value, out),
        ValueKind::String => string_repr(value.as_str().unwrap_or_default(), out),
        ValueKind::Seq | ValueKind::Iterable => {
            let (open, close) = if value.is_tuple() {
                ('(', ')')
            } else {
                ('[', ']')
            };
            out.push(open);
            let mut count = 0usize;
            for (i, item) in value.try_iter()?.enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                python_repr(&item, out, depth + 1)?;
                count += 1;
            }
            if value.is_tuple() && count == 1 {
                out.push(',');
            }
            out.push(close);
        }
        ValueKind::Map => {
            out.push('{');
            for (i, key) in value.try_iter()?.enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                python_repr(&key, out, depth + 1)?;
                out.push_str(": ");
                python_repr(&value.get_item(&key)?, out, depth + 1)?;
            }
            out.push('}');
        }
        _ => {
            let _ = write!(out, "{value}");
        }
    }
    Ok(())
}

/// `json.dumps`' options, as transformers' `tojson` filter passes them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct JsonStyle {
    pub ensure_ascii: bool,
    /// The indent unit; `None` for one line.
    pub indent: Option<String>,
    pub item_separator: String,
    pub key_separator: String,
    pub sort_keys: bool,
}

impl JsonStyle {
    /// Python's defaults for these options: `', '` between items on one
    /// line, `','` when indenting, `': '` after keys.
    pub(crate) fn new(
        ensure_ascii: bool,
        indent: Option<String>,
        separators: Option<(String, String)>,
        sort_keys: bool,
    ) -> JsonStyle {
        let (item_separator, key_separator) = separators.unwrap_or_else(|| {
            let item = if indent.is_some() { "," } else { ", " };
            (item.to_owned(), ": ".to_owned())
        });
        JsonStyle {
            ensure_ascii,
            indent,
            item_separator,
            key_separator,
            sort_keys,
        }
    }
}

/// A JSON string literal as Python's encoder writes it.
fn json_string(s: &str, ensure_ascii: bool, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 || (ensure_ascii && !(' '..='~').contains(&c)) => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// A dict key as `json.dumps` converts it.
fn json_key(key: &Value) -> Result<String, Error> {
    let mut text = String::new();
    match key.kind() {
        ValueKind::String => text.push_str(key.as_str().unwrap_or_default()),
        ValueKind::Bool => text.push_str(if key.is_true() { "true" } else { "false" }),
        ValueKind::None => text.push_str("null"),
        ValueKind::Number => number(key, &mut text),
        _ => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                "keys must be str, int, float, bool or None",
            ));
        }
    }
    Ok(text)
}

fn newline_indent(style: &JsonStyle, level: usize, out: &mut String) {
    if let Some(unit) = &style.indent {
        out.push('\n');
        for _ in 0..level {
            out.push_str(unit);
        }
    }
}

/// `json.dumps(value, ...)` with `style`.
pub(crate) fn json_dumps(value: &Value, style: &JsonStyle, out: &mut String) -> Result<(), Error> {
    json_value(value, style, 0, out)
}

fn json_value(
    value: &Value,
    style: &JsonStyle,
    level: usize,
    out: &mut String,
) -> Result<(), Error> {
    if level > MAX_DEPTH {
        return Err(too_deep());
    }
    match value.kind() {
        ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number => match f64::try_from(value.clone()) {
            Ok(x) if !value.is_integer() && x.is_nan() => out.push_str("NaN"),
            Ok(x) if !value.is_integer() && x.is_infinite() => {
                out.push_str(if x > 0.0 { "Infinity" } else { "-Infinity" });
            }
            _ => number(value, out),
        },
        ValueKind::String => {
            json_string(value.as_str().unwrap_or_default(), style.ensure_ascii, out)
        }
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = value.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&style.item_separator);
                }
                newline_indent(style, level + 1, out);
                json_value(item, style, level + 1, out)?;
            }
            newline_indent(style, level, out);
            out.push(']');
        }
        ValueKind::Map => {
            let mut entries = Vec::new();
            for key in value.try_iter()? {
                let item = value.get_item(&key)?;
                entries.push((json_key(&key)?, item));
            }
            if entries.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            if style.sort_keys {
                entries.sort_by(|a, b| a.0.cmp(&b.0));
            }
            out.push('{');
            for (i, (key, item)) in entries.iter().enumerate() {
                if i > 0 {
                    out.push_str(&style.item_separator);
                }
                newline_indent(style, level + 1, out);
                json_string(key, style.ensure_ascii, out);
                out.push_str(&style.key_separator);
                json_value(item, style, level + 1, out)?;
            }
            newline_indent(style, level, out);
            out.push('}');
        }
        _ => return Err(not_serializable(value)),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn repr(x: f64) -> String {
        let mut s = String::new();
        float_repr(x, &mut s);
        s
    }

    #[test]
    fn floats_print_as_python_repr() {
        // Each pair checked against CPython 3.11's repr().
        let cases = [
            (1.0, "1.0"),
            (0.1, "0.1"),
            (-2.5, "-2.5"),
            (1e16, "1e+16"),
            (1.5e16, "1.5e+16"),
            (1e15, "1000000000000000.0"),
            (123456789.125, "123456789.125"),
            (1e-4, "0.0001"),
            (1e-5, "1e-05"),
            (2.5e-7, "2.5e-07"),
            (-0.0, "-0.0"),
            (1.7976931348623157e308, "1.7976931348623157e+308"),
            (5e-324, "5e-324"),
            (f64::INFINITY, "inf"),
        ];
        for (x, want) in cases {
            assert_eq!(repr(x), want, "repr({x:e})");
        }
    }

    #[test]
    fn strings_repr_with_python_quoting() {
        let mut out = String::new();
        for s in [
            "plain",
            "it's",
            "say \"hi\"",
            "both ' and \"",
            "tab\tnl\n\u{7}",
            "zwj\u{200d}é",
        ] {
            string_repr(s, &mut out);
            out.push(' ');
        }
        assert_eq!(
            out,
            r#"'plain' "it's" 'say "hi"' 'both \' and "' 'tab\tnl\n\x07' 'zwj\u200dé' "#
        );
    }

    #[test]
    fn json_escapes_like_python() {
        let mut out = String::new();
        json_string("é😀\n\"\\\u{1}\u{7f}", true, &mut out);
        assert_eq!(out, r#""\u00e9\ud83d\ude00\n\"\\\u0001\u007f""#);
        out.clear();
        json_string("é😀\u{7f}", false, &mut out);
        assert_eq!(out, "\"é😀\u{7f}\"");
    }
}
