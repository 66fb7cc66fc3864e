//! The safetensors header, parsed without I/O: the one reader of it, for
//! the engine's checkpoint reader and the row store's table sources (each
//! reads the bytes through its own file type and adds its own rules).
//!
//! A file starts with an 8-byte little-endian length `n`, then `n` bytes of
//! JSON: an object naming each tensor's `dtype`, `shape` and `data_offsets`
//! (`[begin, end]`, relative to the data section at byte `8 + n`), plus an
//! optional `__metadata__` entry, which is skipped. Checked here:
//! - `n` is at most [`MAX_HEADER_BYTES`] and `8 + n` within the file;
//! - every tensor has a string `dtype`, a `shape` of integers and exactly two
//!   integer `data_offsets` with `begin <= end`, its bytes inside the file;
//! - its length is `product(shape) * element size` for every dtype whose
//!   element size is known ([`dtype_size_bytes`]).
//!
//! Every tensor is checked, not only the one a caller looks for: a header
//! with one malformed entry is a corrupt file, whichever tensor is read.

use std::fmt;
use std::path::{Path, PathBuf};

use crate::text::{or_overflow, shape as shape_text};

/// Bytes of the length word before the JSON.
pub const LEN_WORD_BYTES: u64 = 8;

/// Largest JSON header accepted: the reference reader's bound (`safetensors`
/// 0.8, `MAX_HEADER_SIZE`, the reader transformers loads checkpoints with),
/// so a header refused here is one that transformers cannot load either.
/// The JSON of a big checkpoint shard is a few MB. (The row store accepted
/// up to 100 MiB and the checkpoint reader up to 256 MiB before they shared
/// this reader.)
pub const MAX_HEADER_BYTES: u64 = 100_000_000;

/// One tensor of a safetensors header.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SafetensorsTensor {
    /// Its name in the header.
    pub name: String,
    /// safetensors dtype name (`BF16`, `F8_E4M3`, `I64`...).
    pub dtype: String,
    /// Shape, outermost first.
    pub shape: Vec<u64>,
    /// Absolute byte offset of its data in the file.
    pub offset: u64,
    /// Length in bytes.
    pub len_bytes: u64,
}

/// A safetensors header that breaks the format: the file, the tensor (none
/// for the header as a whole) and what is wrong.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SafetensorsError {
    /// File at fault.
    pub path: PathBuf,
    /// Tensor at fault; `None` for the length word or the JSON as a whole.
    pub tensor: Option<String>,
    /// What is wrong.
    pub fault: HeaderFault,
}

/// What is wrong with a safetensors header.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum HeaderFault {
    /// The length word exceeds the file or [`MAX_HEADER_BYTES`].
    #[error(
        "header length {header_len} exceeds the file ({file_bytes} bytes) or {MAX_HEADER_BYTES}"
    )]
    Length {
        /// The length word.
        header_len: u64,
        /// File length.
        file_bytes: u64,
    },
    /// The header is not valid JSON.
    #[error("safetensors header: {0}")]
    Json(String),
    /// The header is JSON but not an object.
    #[error("header is not a JSON object")]
    NotAnObject,
    /// A tensor has no string `dtype`.
    #[error("no dtype")]
    NoDtype,
    /// A tensor's `shape` is not a list of integers.
    #[error("shape is not a list of integers")]
    Shape,
    /// A tensor's `data_offsets` is not a list of integers.
    #[error("data_offsets is not a list of integers")]
    Offsets,
    /// A tensor's `data_offsets` does not have two entries.
    #[error("data_offsets has {0} entries, not 2")]
    OffsetCount(usize),
    /// A tensor's bytes are reversed or lie past the end of the file.
    #[error(
        "data_offsets [{begin}, {end}] outside the file ({file_bytes} bytes, data from {data_start})"
    )]
    OutsideFile {
        /// `data_offsets[0]`.
        begin: u64,
        /// `data_offsets[1]`.
        end: u64,
        /// File length.
        file_bytes: u64,
        /// Absolute offset of the data section.
        data_start: u64,
    },
    /// A tensor's length disagrees with its shape and dtype.
    #[error("{len_bytes} bytes, but shape {} of {dtype} needs {}", shape_text(shape), or_overflow(*need))]
    Size {
        /// Its length from `data_offsets`.
        len_bytes: u64,
        /// Its shape.
        shape: Vec<u64>,
        /// Its dtype.
        dtype: String,
        /// `product(shape) * element size`; `None` where that overflows.
        need: Option<u64>,
    },
}

impl fmt::Display for SafetensorsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.tensor {
            Some(t) => write!(f, "{}: tensor {t}: {}", self.path.display(), self.fault),
            None => write!(f, "{}: {}", self.path.display(), self.fault),
        }
    }
}

impl std::error::Error for SafetensorsError {}

/// Element size in bytes of a safetensors dtype name; `None` for a name
/// this reader does not know (its tensors' lengths are then not checked).
#[must_use]
pub fn dtype_size_bytes(dtype: &str) -> Option<u64> {
    Some(match dtype {
        "BOOL" | "U8" | "I8" | "F8_E4M3" | "F8_E5M2" | "F8_E8M0" => 1,
        "BF16" | "F16" | "I16" | "U16" => 2,
        "F32" | "I32" | "U32" => 4,
        "F64" | "I64" | "U64" => 8,
        _ => return None,
    })
}

/// The JSON length announced by `len_word`, the first [`LEN_WORD_BYTES`] of
/// `path`, a `file_bytes`-byte file, checked against the file and
/// [`MAX_HEADER_BYTES`].
pub fn header_len(
    path: &Path,
    len_word: [u8; 8],
    file_bytes: u64,
) -> Result<u64, SafetensorsError> {
    let header_len = u64::from_le_bytes(len_word);
    if header_len > MAX_HEADER_BYTES || header_len.saturating_add(LEN_WORD_BYTES) > file_bytes {
        return Err(SafetensorsError {
            path: path.to_path_buf(),
            tensor: None,
            fault: HeaderFault::Length {
                header_len,
                file_bytes,
            },
        });
    }
    Ok(header_len)
}

/// Every tensor of the JSON header `json` (the bytes after the length word)
/// of `path`, a `file_bytes`-byte file, each checked (see the module docs).
pub fn parse_header(
    path: &Path,
    json: &[u8],
    file_bytes: u64,
) -> Result<Vec<SafetensorsTensor>, SafetensorsError> {
    let whole = |fault| SafetensorsError {
        path: path.to_path_buf(),
        tensor: None,
        fault,
    };
    let value: serde_json::Value =
        serde_json::from_slice(json).map_err(|e| whole(HeaderFault::Json(e.to_string())))?;
    let obj = value
        .as_object()
        .ok_or_else(|| whole(HeaderFault::NotAnObject))?;
    let data_start = LEN_WORD_BYTES + json.len() as u64;
    let mut tensors = Vec::with_capacity(obj.len());
    for (name, entry) in obj {
        if name == "__metadata__" {
            continue;
        }
        let t = parse_tensor(name, entry, data_start, file_bytes).map_err(|fault| {
            SafetensorsError {
                path: path.to_path_buf(),
                tensor: Some(name.clone()),
                fault,
            }
        })?;
        tensors.push(t);
    }
    Ok(tensors)
}

fn integers(v: &serde_json::Value, key: &str) -> Option<Vec<u64>> {
    v.get(key)?
        .as_array()?
        .iter()
        .map(serde_json::Value::as_u64)
        .collect()
}

fn parse_tensor(
    name: &str,
    v: &serde_json::Value,
    data_start: u64,
    file_bytes: u64,
) -> Result<SafetensorsTensor, HeaderFault> {
    let dtype = v
        .get("dtype")
        .and_then(serde_json::Value::as_str)
        .ok_or(HeaderFault::NoDtype)?;
    let shape = integers(v, "shape").ok_or(HeaderFault::Shape)?;
    let offsets = integers(v, "data_offsets").ok_or(HeaderFault::Offsets)?;
    let [begin, end] = offsets[..] else {
        return Err(HeaderFault::OffsetCount(offsets.len()));
    };
    let inside = data_start
        .checked_add(end)
        .is_some_and(|e| e <= file_bytes && begin <= end);
    if !inside {
        return Err(HeaderFault::OutsideFile {
            begin,
            end,
            file_bytes,
            data_start,
        });
    }
    let len_bytes = end - begin;
    if let Some(size) = dtype_size_bytes(dtype) {
        let need = shape.iter().try_fold(size, |acc, &d| acc.checked_mul(d));
        if need != Some(len_bytes) {
            return Err(HeaderFault::Size {
                len_bytes,
                shape,
                dtype: dtype.to_string(),
                need,
            });
        }
    }
    Ok(SafetensorsTensor {
        name: name.to_string(),
        dtype: dtype.to_string(),
        shape,
        offset: data_start + begin,
        len_bytes,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p() -> &'static Path {
        Path::new("m.safetensors")
    }

    /// A file image of `json` followed by `data` zero bytes.
    fn image(json: &str, data: usize) -> Vec<u8> {
        let mut b = (json.len() as u64).to_le_bytes().to_vec();
        b.extend_from_slice(json.as_bytes());
        b.resize(b.len() + data, 0);
        b
    }

    fn parse(file: &[u8]) -> Result<Vec<SafetensorsTensor>, SafetensorsError> {
        let word = file[..8].try_into().expect("8 bytes");
        let n = header_len(p(), word, file.len() as u64)?;
        let json = &file[8..8 + n as usize];
        parse_header(p(), json, file.len() as u64)
    }

    fn fault(json: &str, data: usize) -> HeaderFault {
        parse(&image(json, data)).expect_err(json).fault
    }

    #[test]
    fn tensors_come_with_absolute_offsets() {
        let json = r#"{"a":{"dtype":"BF16","shape":[2,2],"data_offsets":[0,8]},"b":{"dtype":"X9","shape":[3],"data_offsets":[8,11]},"__metadata__":{"format":"pt"}}"#;
        let got = parse(&image(json, 11)).expect("valid");
        let data = 8 + json.len() as u64;
        assert_eq!(got.len(), 2, "metadata skipped");
        assert_eq!(
            got[0],
            SafetensorsTensor {
                name: "a".into(),
                dtype: "BF16".into(),
                shape: vec![2, 2],
                offset: data,
                len_bytes: 8,
            }
        );
        // An unknown dtype's length is not checked.
        assert_eq!((got[1].offset, got[1].len_bytes), (data + 8, 3));
    }

    #[test]
    fn the_length_word_is_bounded_by_the_file_and_the_cap() {
        let len = 16u64.to_le_bytes();
        assert!(header_len(p(), len, 24).is_ok());
        let e = header_len(p(), len, 23).expect_err("past the end");
        assert_eq!(
            e.to_string(),
            "m.safetensors: header length 16 exceeds the file (23 bytes) or 100000000"
        );
        let cap = MAX_HEADER_BYTES.to_le_bytes();
        assert!(header_len(p(), cap, u64::MAX).is_ok());
        let over = (MAX_HEADER_BYTES + 1).to_le_bytes();
        assert!(header_len(p(), over, u64::MAX).is_err());
        assert!(header_len(p(), u64::MAX.to_le_bytes(), u64::MAX).is_err());
        // No room for the JSON after the word.
        assert!(header_len(p(), 1u64.to_le_bytes(), 8).is_err());
    }

    #[test]
    fn every_malformed_entry_is_refused_by_name() {
        assert!(matches!(fault("{x}", 0), HeaderFault::Json(_)));
        assert_eq!(fault("[1]", 0), HeaderFault::NotAnObject);
        let t = |body: &str| {
            format!(r#"{{"ok":{{"dtype":"U8","shape":[1],"data_offsets":[0,1]}},"t":{body}}}"#)
        };
        assert_eq!(
            fault(&t(r#"{"shape":[1],"data_offsets":[0,1]}"#), 1),
            HeaderFault::NoDtype
        );
        assert_eq!(
            fault(
                &t(r#"{"dtype":"U8","shape":[1.5],"data_offsets":[0,1]}"#),
                1
            ),
            HeaderFault::Shape
        );
        assert_eq!(
            fault(&t(r#"{"dtype":"U8","shape":[1],"data_offsets":[0,-1]}"#), 1),
            HeaderFault::Offsets
        );
        assert_eq!(
            fault(&t(r#"{"dtype":"U8","shape":[1],"data_offsets":[0]}"#), 1),
            HeaderFault::OffsetCount(1)
        );
        assert!(matches!(
            fault(&t(r#"{"dtype":"U8","shape":[0],"data_offsets":[1,0]}"#), 1),
            HeaderFault::OutsideFile {
                begin: 1,
                end: 0,
                ..
            }
        ));
        assert!(matches!(
            fault(&t(r#"{"dtype":"U8","shape":[2],"data_offsets":[0,2]}"#), 1),
            HeaderFault::OutsideFile { end: 2, .. }
        ));
        let e = parse(&image(
            &t(r#"{"dtype":"F32","shape":[2],"data_offsets":[0,1]}"#),
            1,
        ))
        .expect_err("size");
        assert_eq!(e.tensor.as_deref(), Some("t"));
        assert!(
            e.to_string()
                .ends_with("tensor t: 1 bytes, but shape 2 of F32 needs 8"),
            "{e}"
        );
        let huge = t(r#"{"dtype":"F64","shape":[4294967296,4294967296],"data_offsets":[0,1]}"#);
        assert!(matches!(
            fault(&huge, 1),
            HeaderFault::Size { need: None, .. }
        ));
        assert!(fault(&huge, 1).to_string().contains("more than 2^64"));
    }
}
