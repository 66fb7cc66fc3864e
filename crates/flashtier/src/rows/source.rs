//! Where a table's rows come from before (or instead of) a packed shard.
//!
//! Two kinds of source, both describing a weight extent
//! (`rows * weight_bytes`, row-major) and a scale extent
//! (`rows * scale_bytes`) in one or two files:
//!
//! - **raw**: a file with the weights at `weight_offset` and the scales at
//!   `scale_offset` ([`TableSource::raw`]);
//! - **safetensors**: a tensor and its scale tensor in a checkpoint file or
//!   directory ([`TableSource::safetensors`]). Accepted:
//!
//!   | tensor | dtype | shape | scale format |
//!   | --- | --- | --- | --- |
//!   | weights | `F8_E4M3` (or `U8`/`I8` holding E4M3 codes) | `[rows, W]` | |
//!   | scales | `F32` | `[rows, S/4]` | [`ScaleFormat::F32Blocks`] |
//!   | scales | `F64` | `[rows]` or `[rows, 1]` | [`ScaleFormat::F64Row`] |
//!   | scales | `U8` | `[rows, S]` | [`ScaleFormat::F32Blocks`] (raw LE f32 bytes) |
//!
//!   `W` and `S` give the row geometry (256 and 8 for Engram). An
//!   unscaled table ([`TableSource::safetensors_unscaled`]: `BF16`, `F16`
//!   or `F32` `[rows, n]`, Qwen4-Exp's PLE shards) has rows of its `n`
//!   values as stored and no scale bytes. In a
//!   directory, `model.safetensors.index.json` names the file of each tensor
//!   when present; otherwise every `*.safetensors` header is searched. The
//!   8-byte length and JSON header are parsed by
//!   [`flashtier_format::safetensors`] (the checkpoint reader's parser too:
//!   headers over its `MAX_HEADER_BYTES` are refused, every entry's bytes
//!   must lie inside the file and match its shape and dtype).

use std::io::Read;
use std::path::{Path, PathBuf};

use flashtier_format::safetensors::{self, SafetensorsError};
use flashtier_format::text::{or_overflow, shape};

use crate::rows::{RowError, RowGeometry, ScaleFormat};

/// One extent of a source: a file and the offset of row 0.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SourceExtent {
    /// File holding the extent.
    pub path: PathBuf,
    /// Byte offset of row 0.
    pub offset: u64,
}

/// A table's rows in their source files.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TableSource {
    /// Rows in the table.
    pub rows: u64,
    /// Bytes per row.
    pub geometry: RowGeometry,
    /// The weights, `rows * weight_bytes` bytes.
    pub weights: SourceExtent,
    /// The scales, `rows * scale_bytes` bytes.
    pub scales: SourceExtent,
    /// How the scale bytes are read by [`crate::rows::fp8`].
    pub scale_format: ScaleFormat,
}

fn source_err(path: &Path, what: impl Into<String>) -> RowError {
    RowError::Source {
        path: path.to_path_buf(),
        what: what.into(),
    }
}

fn file_len(path: &Path) -> Result<u64, RowError> {
    std::fs::metadata(path)
        .map(|m| m.len())
        .map_err(|e| source_err(path, format!("cannot stat: {e}")))
}

fn check_extent(path: &Path, what: &str, offset: u64, bytes: Option<u64>) -> Result<(), RowError> {
    let len = file_len(path)?;
    let end = bytes.and_then(|b| offset.checked_add(b));
    match end {
        Some(end) if end <= len => Ok(()),
        _ => Err(source_err(
            path,
            format!(
                "{what} extent at offset {offset} of {} bytes runs past the file's {len} bytes",
                or_overflow(bytes)
            ),
        )),
    }
}

impl TableSource {
    /// A raw table file: `rows` weights at `weight_offset`, scales at
    /// `scale_offset`. Checks that both extents lie inside the file.
    pub fn raw(
        path: &Path,
        rows: u64,
        weight_offset: u64,
        scale_offset: u64,
        geometry: RowGeometry,
    ) -> Result<Self, RowError> {
        geometry.validate()?;
        let s = Self {
            rows,
            geometry,
            weights: SourceExtent {
                path: path.to_path_buf(),
                offset: weight_offset,
            },
            scales: SourceExtent {
                path: path.to_path_buf(),
                offset: scale_offset,
            },
            scale_format: ScaleFormat::F32Blocks,
        };
        s.validate()?;
        Ok(s)
    }

    /// Check that both extents lie inside their files.
    pub fn validate(&self) -> Result<(), RowError> {
        self.geometry.validate()?;
        let wb = self.rows.checked_mul(u64::from(self.geometry.weight_bytes));
        let sb = self.rows.checked_mul(u64::from(self.geometry.scale_bytes));
        check_extent(&self.weights.path, "weight", self.weights.offset, wb)?;
        check_extent(&self.scales.path, "scale", self.scales.offset, sb)
    }

    /// A weight tensor and its scale tensor in a safetensors file or a
    /// checkpoint directory (see the module docs for accepted dtypes).
    pub fn safetensors(model: &Path, tensor: &str, scales: &str) -> Result<Self, RowError> {
        let w = find_tensor(model, tensor)?;
        let s = find_tensor(model, scales)?;
        let (rows, weight_bytes) = match (w.dtype.as_str(), w.shape.as_slice()) {
            ("F8_E4M3" | "U8" | "I8", [r, c]) => (*r, *c),
            (d, sh) => {
                return Err(source_err(
                    &w.path,
                    format!(
                        "tensor {tensor} is {d} {}; expected F8_E4M3 of rows x weight_bytes",
                        shape(sh)
                    ),
                ));
            }
        };
        let (scale_bytes, scale_format) = match (s.dtype.as_str(), s.shape.as_slice()) {
            ("F32", [r, n]) if *r == rows => (n * 4, ScaleFormat::F32Blocks),
            ("F64", [r]) | ("F64", [r, 1]) if *r == rows => (8, ScaleFormat::F64Row),
            ("U8", [r, n]) if *r == rows && n % 4 == 0 => (*n, ScaleFormat::F32Blocks),
            (d, sh) => {
                return Err(source_err(
                    &s.path,
                    format!(
                        "scale tensor {scales} is {d} {}; expected F32 {rows}xn, F64 {rows} (or {rows}x1) or U8 {rows}x4n",
                        shape(sh)
                    ),
                ));
            }
        };
        let geometry = RowGeometry {
            weight_bytes: u32::try_from(weight_bytes)
                .map_err(|_| source_err(&w.path, "row too wide"))?,
            scale_bytes: u32::try_from(scale_bytes)
                .map_err(|_| source_err(&s.path, "scale too wide"))?,
        };
        // Each tensor's length matches its shape and dtype (checked with the
        // header), so the extents hold `rows` rows of this geometry.
        geometry.validate()?;
        let src = Self {
            rows,
            geometry,
            weights: SourceExtent {
                path: w.path.clone(),
                offset: w.begin,
            },
            scales: SourceExtent {
                path: s.path.clone(),
                offset: s.begin,
            },
            scale_format,
        };
        src.validate()?;
        Ok(src)
    }
}

impl TableSource {
    /// An unscaled table: tensor `tensor` (`BF16`, `F16` or `F32`,
    /// `[rows, n]`) in a safetensors file or checkpoint directory, each row
    /// its `n` values as stored (Qwen4-Exp's PLE n-gram tables,
    /// `ngram_embedding.shard_K.weight`), with no scale bytes (the scale
    /// extent is empty).
    pub fn safetensors_unscaled(model: &Path, tensor: &str) -> Result<Self, RowError> {
        let w = find_tensor(model, tensor)?;
        let (rows, weight_bytes) = match (w.dtype.as_str(), w.shape.as_slice()) {
            ("BF16" | "F16", [r, c]) => (*r, c.checked_mul(2)),
            ("F32", [r, c]) => (*r, c.checked_mul(4)),
            (d, sh) => {
                return Err(source_err(
                    &w.path,
                    format!(
                        "tensor {tensor} is {d} {}; an unscaled table is BF16, F16 or F32 of rows x values (give --scales for an FP8 table)",
                        shape(sh)
                    ),
                ));
            }
        };
        let geometry = RowGeometry {
            weight_bytes: weight_bytes
                .and_then(|b| u32::try_from(b).ok())
                .ok_or_else(|| source_err(&w.path, "row too wide"))?,
            scale_bytes: 0,
        };
        geometry.validate()?;
        let extent = SourceExtent {
            path: w.path.clone(),
            offset: w.begin,
        };
        let src = Self {
            rows,
            geometry,
            weights: extent.clone(),
            scales: extent,
            scale_format: ScaleFormat::F32Blocks,
        };
        src.validate()?;
        Ok(src)
    }
}

/// A tensor located in a safetensors file.
#[derive(Clone, Debug)]
struct TensorInfo {
    path: PathBuf,
    dtype: String,
    shape: Vec<u64>,
    /// Absolute file offset of the tensor's bytes.
    begin: u64,
}

fn find_tensor(model: &Path, name: &str) -> Result<TensorInfo, RowError> {
    if model.is_file() {
        return read_tensor(model, name)?
            .ok_or_else(|| source_err(model, format!("no tensor named {name}")));
    }
    let index = model.join("model.safetensors.index.json");
    if index.is_file() {
        let text =
            std::fs::read_to_string(&index).map_err(|e| source_err(&index, e.to_string()))?;
        let v: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| source_err(&index, format!("bad JSON: {e}")))?;
        if let Some(file) = v
            .get("weight_map")
            .and_then(|m| m.get(name))
            .and_then(|f| f.as_str())
        {
            let path = model.join(file);
            return read_tensor(&path, name)?.ok_or_else(|| {
                source_err(
                    &path,
                    format!("index names this file for {name}, but it lacks it"),
                )
            });
        }
    }
    let entries = std::fs::read_dir(model).map_err(|e| source_err(model, e.to_string()))?;
    let mut files: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    files.sort();
    for f in &files {
        if let Some(t) = read_tensor(f, name)? {
            return Ok(t);
        }
    }
    Err(source_err(
        model,
        format!(
            "no tensor named {name} in {} safetensors files",
            files.len()
        ),
    ))
}

/// Parse the header of `path` ([`flashtier_format::safetensors`]: every
/// entry checked) and return `name`'s entry, if present.
fn read_tensor(path: &Path, name: &str) -> Result<Option<TensorInfo>, RowError> {
    let err = |w: String| source_err(path, w);
    // A FIFO or device is refused before it is opened (never blocks).
    let mut f = flashtier_format::open_regular_read(path).map_err(|e| err(e.reason()))?;
    let file_bytes = f.metadata().map_err(|e| err(e.to_string()))?.len();
    let mut len_word = [0u8; 8];
    f.read_exact(&mut len_word)
        .map_err(|e| err(format!("no safetensors header: {e}")))?;
    let n = safetensors::header_len(path, len_word, file_bytes).map_err(header_err)?;
    // Bounded by MAX_HEADER_BYTES in `header_len`.
    let mut json = vec![0u8; n as usize];
    f.read_exact(&mut json)
        .map_err(|e| err(format!("read header: {e}")))?;
    let tensors = safetensors::parse_header(path, &json, file_bytes).map_err(header_err)?;
    Ok(tensors
        .into_iter()
        .find(|t| t.name == name)
        .map(|t| TensorInfo {
            path: path.to_path_buf(),
            dtype: t.dtype,
            shape: t.shape,
            begin: t.offset,
        }))
}

/// A header the shared parser refused, as this tier's error.
fn header_err(e: SafetensorsError) -> RowError {
    let what = match &e.tensor {
        Some(t) => format!("tensor {t}: {}", e.fault),
        None => e.fault.to_string(),
    };
    RowError::Source { path: e.path, what }
}

/// Write a safetensors file of the given tensors (`name`, dtype, shape,
/// bytes), in order. For fixtures and the synthetic checkpoints of tests and
/// benchmarks.
pub fn write_safetensors(
    path: &Path,
    tensors: &[(&str, &str, Vec<u64>, &[u8])],
) -> Result<(), RowError> {
    let mut header = serde_json::Map::new();
    let mut at = 0u64;
    for (name, dtype, shape, bytes) in tensors {
        let end = at + bytes.len() as u64;
        header.insert(
            (*name).to_string(),
            serde_json::json!({ "dtype": dtype, "shape": shape, "data_offsets": [at, end] }),
        );
        at = end;
    }
    let mut json = serde_json::Value::Object(header).to_string().into_bytes();
    json.resize(json.len().div_ceil(8) * 8, b' ');
    let mut out = Vec::with_capacity(8 + json.len() + at as usize);
    out.extend_from_slice(&(json.len() as u64).to_le_bytes());
    out.extend_from_slice(&json);
    for (_, _, _, bytes) in tensors {
        out.extend_from_slice(bytes);
    }
    std::fs::write(path, out).map_err(|e| source_err(path, format!("write: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An Engram table of 10 rows (`e.w`, `e.s`) and `more` tensors.
    fn write_table(p: &Path, more: &[(&str, &str, Vec<u64>, &[u8])]) {
        let w = vec![1u8; 10 * 256];
        let s32 = [2u8; 10 * 8];
        let mut tensors = vec![
            ("e.w", "F8_E4M3", vec![10, 256], &w[..]),
            ("e.s", "F32", vec![10, 2], &s32[..]),
        ];
        tensors.extend(more.iter().cloned());
        write_safetensors(p, &tensors).expect("write");
    }

    #[test]
    fn safetensors_shapes_and_dtypes() {
        let dir = tempfile::tempdir().expect("tempdir");
        let p = dir.path().join("m.safetensors");
        let s32 = vec![2u8; 10 * 8];
        write_table(
            &p,
            &[
                ("e.d", "F64", vec![10], &s32),
                ("e.u", "U8", vec![10, 8], &s32),
                ("e.bad", "F32", vec![9, 2], &s32[..72]),
            ],
        );
        let t = TableSource::safetensors(&p, "e.w", "e.s").expect("f32 scales");
        assert_eq!(
            (t.rows, t.geometry, t.scale_format),
            (10, RowGeometry::ENGRAM, ScaleFormat::F32Blocks)
        );
        let t = TableSource::safetensors(dir.path(), "e.w", "e.d").expect("f64 scales, dir scan");
        assert_eq!(t.scale_format, ScaleFormat::F64Row);
        assert_eq!(
            TableSource::safetensors(&p, "e.w", "e.u")
                .expect("u8")
                .geometry,
            RowGeometry::ENGRAM
        );
        let e = TableSource::safetensors(&p, "e.w", "e.bad").expect_err("row mismatch");
        assert!(e.to_string().contains("e.bad"), "{e}");
        let e = TableSource::safetensors(&p, "e.w", "nope").expect_err("missing");
        assert!(e.to_string().contains("nope"), "{e}");
        let e = TableSource::safetensors(&p, "e.s", "e.s").expect_err("wrong dtype");
        assert!(e.to_string().contains("F8_E4M3"), "{e}");
        // Shapes as plain text, not Rust's `[10, 2]`.
        assert!(e.to_string().contains("is F32 10x2; expected"), "{e}");
    }

    #[test]
    fn corrupt_headers_are_errors() {
        let dir = tempfile::tempdir().expect("tempdir");
        let p = dir.path().join("bad.safetensors");
        std::fs::write(&p, [255u8; 16]).expect("write");
        assert!(TableSource::safetensors(&p, "a", "b").is_err());
        std::fs::write(&p, [4u8, 0, 0, 0, 0, 0, 0, 0, b'{', b'x', b'}', b' ']).expect("write");
        assert!(TableSource::safetensors(&p, "a", "b").is_err());
        // Bytes that disagree with the shape, in a tensor other than the
        // ones asked for: the whole header is checked, the culprit named.
        write_table(&p, &[("other", "F32", vec![3], &[0u8; 8])]);
        let e = TableSource::safetensors(&p, "e.w", "e.s").expect_err("bad entry");
        assert!(
            e.to_string()
                .contains("tensor other: 8 bytes, but shape 3 of F32 needs 12"),
            "{e}"
        );
    }

    /// A FIFO among a directory's safetensors files is refused at once
    /// (the header scan opened it and waited for a writer).
    #[test]
    fn a_fifo_in_the_scanned_folder_is_refused_at_once() {
        let dir = tempfile::tempdir().expect("tempdir");
        let fifo = dir.path().join("a.safetensors");
        rustix::fs::mkfifoat(
            rustix::fs::CWD,
            &fifo,
            rustix::fs::Mode::from_raw_mode(0o600),
        )
        .expect("mkfifo");
        let (tx, rx) = std::sync::mpsc::channel();
        let d = dir.path().to_path_buf();
        std::thread::spawn(move || {
            let _ = tx.send(TableSource::safetensors(&d, "e.w", "e.s").map(|_| ()));
        });
        let err = rx
            .recv_timeout(std::time::Duration::from_secs(5))
            .expect("the scan blocked on a FIFO")
            .expect_err("a FIFO");
        let msg = err.to_string();
        assert!(
            msg.contains("a.safetensors: a FIFO (named pipe), not a regular file"),
            "{msg}"
        );
    }

    #[test]
    fn raw_extent_must_fit() {
        let dir = tempfile::tempdir().expect("tempdir");
        let p = dir.path().join("t.bin");
        std::fs::write(&p, vec![0u8; 264 * 4]).expect("write");
        TableSource::raw(&p, 4, 0, 1024, RowGeometry::ENGRAM).expect("fits");
        assert!(TableSource::raw(&p, 5, 0, 1024, RowGeometry::ENGRAM).is_err());
        assert!(TableSource::raw(&p, u64::MAX, 0, 0, RowGeometry::ENGRAM).is_err());
    }
}
