//! Plain-text spellings of values in messages: shapes as `2x3`, lists as
//! `2, 3`, overflowed sizes as `more than 2^64`, bytes as space-separated
//! hex. Every user-facing message of the workspace spells
//! these the same way, and none shows Rust debug text (`[2, 3]`, `Some(8)`).

use std::fmt::Display;

/// A tensor shape as `2x3x4`; `scalar` for the empty shape.
#[must_use]
pub fn shape<T: Display>(dims: &[T]) -> String {
    if dims.is_empty() {
        return "scalar".into();
    }
    let parts: Vec<String> = dims.iter().map(ToString::to_string).collect();
    parts.join("x")
}

/// Items as `2, 3, 5`; `none` when empty.
#[must_use]
pub fn list<T: Display>(items: &[T]) -> String {
    if items.is_empty() {
        return "none".into();
    }
    let parts: Vec<String> = items.iter().map(ToString::to_string).collect();
    parts.join(", ")
}

/// A size computed with checked arithmetic: the number, or `more than 2^64`
/// where it overflowed (`None`).
#[must_use]
pub fn or_overflow(v: Option<u64>) -> String {
    v.map_or_else(|| "more than 2^64".to_string(), |v| v.to_string())
}

/// Bytes as space-separated lower-case hex (`46 54 53`); `none` when empty.
#[must_use]
pub fn hex_bytes(bytes: &[u8]) -> String {
    if bytes.is_empty() {
        return "none".into();
    }
    let parts: Vec<String> = bytes.iter().map(|b| format!("{b:02x}")).collect();
    parts.join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_and_bytes_read_as_plain_text() {
        assert_eq!(shape(&[2u64, 3]), "2x3");
        assert_eq!(shape(&[7usize]), "7");
        assert_eq!(shape::<u64>(&[]), "scalar");
        assert_eq!(hex_bytes(&[0x46, 0x00, 0xff]), "46 00 ff");
        assert_eq!(hex_bytes(&[]), "none");
        assert_eq!(list(&[2, 3, 5]), "2, 3, 5");
        assert_eq!(list::<u8>(&[]), "none");
        assert_eq!(or_overflow(Some(8)), "8");
        assert_eq!(or_overflow(None), "more than 2^64");
    }
}
