//! Parsing one safetensors header without mapping the file, and the rules
//! its tensors must obey (see the [`crate::source`] docs for the evidence
//! behind the tiling rule).

use std::path::Path;
use std::sync::Mutex;

use flashtier_format::text::{or_overflow, shape as shape_text};
use flashtier_io::{DirectMode, StoreFile};

use super::{CheckpointError, MAX_HEADER_BYTES, TensorInfo, WeightFile, dtype_size_bytes};

/// The tensors of one file, in header order.
pub(super) type Entries = Vec<(String, TensorInfo)>;

/// Open `dir/name`, the `index`-th file of the checkpoint, and parse and
/// validate its header.
pub(super) fn open_weight_file(
    dir: &Path,
    name: String,
    index: usize,
) -> Result<(WeightFile, Entries), CheckpointError> {
    let path = dir.join(&name);
    let file = StoreFile::open_read(&path, DirectMode::Off)?;
    let len_bytes = file.len_bytes()?;
    let mut len_word = [0u8; 8];
    file.read_exact_at(&mut len_word, 0)?;
    let header_len = u64::from_le_bytes(len_word);
    let bad = |why: String| CheckpointError::BadTensor {
        path: path.clone(),
        tensor: "<header>".into(),
        why,
    };
    if header_len > MAX_HEADER_BYTES || header_len.saturating_add(8) > len_bytes {
        return Err(bad(format!(
            "header length {header_len} exceeds the file ({len_bytes} bytes) or {MAX_HEADER_BYTES}"
        )));
    }
    // Bounded by MAX_HEADER_BYTES just above.
    let mut header = vec![0u8; 8 + header_len as usize];
    file.read_exact_at(&mut header, 0)?;
    let json: serde_json::Value =
        serde_json::from_slice(&header[8..]).map_err(|e| CheckpointError::Json {
            path: path.clone(),
            what: format!("safetensors header: {e}"),
        })?;
    let obj = json
        .as_object()
        .ok_or_else(|| bad("header is not a JSON object".into()))?;
    let data_start = 8 + header_len;
    let mut entries = Vec::with_capacity(obj.len());
    for (tname, v) in obj {
        if tname == "__metadata__" {
            continue;
        }
        let info = parse_entry(&path, tname, v, index, data_start, len_bytes)?;
        entries.push((tname.clone(), info));
    }
    check_tiling(&path, &entries, data_start, len_bytes - data_start)?;
    Ok((
        WeightFile {
            direct: Mutex::new(None),
            name,
            path,
            len_bytes,
            header,
            buffered: file,
        },
        entries,
    ))
}

fn parse_entry(
    path: &Path,
    tname: &str,
    v: &serde_json::Value,
    file: usize,
    data_start: u64,
    file_len: u64,
) -> Result<TensorInfo, CheckpointError> {
    let bad = |why: String| CheckpointError::BadTensor {
        path: path.to_path_buf(),
        tensor: tname.to_string(),
        why,
    };
    let dtype = v
        .get("dtype")
        .and_then(|d| d.as_str())
        .ok_or_else(|| bad("no dtype".into()))?;
    let shape: Vec<u64> = v
        .get("shape")
        .and_then(|s| s.as_array())
        .and_then(|a| a.iter().map(serde_json::Value::as_u64).collect())
        .ok_or_else(|| bad("shape is not a list of integers".into()))?;
    let offs: Vec<u64> = v
        .get("data_offsets")
        .and_then(|s| s.as_array())
        .and_then(|a| a.iter().map(serde_json::Value::as_u64).collect())
        .ok_or_else(|| bad("data_offsets is not a list of integers".into()))?;
    let [begin, end] = offs[..] else {
        return Err(bad(format!(
            "data_offsets has {} entries, not 2",
            offs.len()
        )));
    };
    let abs_end = data_start
        .checked_add(end)
        .filter(|&e| e <= file_len && begin <= end);
    if abs_end.is_none() {
        return Err(bad(format!(
            "data_offsets [{begin}, {end}] outside the file ({file_len} bytes, data from {data_start})"
        )));
    }
    let len_bytes = end - begin;
    if let Some(size) = dtype_size_bytes(dtype) {
        let want = shape.iter().try_fold(size, |acc, &d| acc.checked_mul(d));
        if want != Some(len_bytes) {
            let need = or_overflow(want);
            return Err(bad(format!(
                "{len_bytes} bytes, but shape {} of {dtype} needs {need}",
                shape_text(&shape)
            )));
        }
    }
    Ok(TensorInfo {
        file,
        dtype: dtype.to_string(),
        shape,
        offset: data_start + begin,
        len_bytes,
    })
}

/// The tensors of one file tile its data section (`data_len` bytes from
/// `data_start`) exactly: in offset order each starts where the previous one
/// ends, the first at 0, the last at `data_len`. Empty tensors sit at the
/// boundary between two others.
fn check_tiling(
    path: &Path,
    entries: &Entries,
    data_start: u64,
    data_len: u64,
) -> Result<(), CheckpointError> {
    let mut spans: Vec<(u64, u64, &str)> = entries
        .iter()
        .map(|(name, t)| {
            let begin = t.offset - data_start;
            (begin, begin + t.len_bytes, name.as_str())
        })
        .collect();
    spans.sort_unstable();
    // (end of the bytes covered so far, the tensor that ends there)
    let mut covered: Option<(u64, u64, &str)> = None;
    for &(begin, end, name) in &spans {
        let (prev_begin, prev_end, prev) = covered.unwrap_or((0, 0, ""));
        if begin < prev_end {
            return Err(CheckpointError::OverlappingTensors {
                path: path.to_path_buf(),
                first: prev.to_string(),
                first_begin: prev_begin,
                first_end: prev_end,
                second: name.to_string(),
                second_begin: begin,
                second_end: end,
            });
        }
        if begin > prev_end {
            return Err(CheckpointError::DataGap {
                path: path.to_path_buf(),
                before: covered.map_or_else(
                    || "the start of the data section".to_string(),
                    |_| format!("tensor {prev}"),
                ),
                after: name.to_string(),
                begin: prev_end,
                end: begin,
            });
        }
        covered = Some((begin, end, name));
    }
    let last_end = covered.map_or(0, |(_, end, _)| end);
    if last_end != data_len {
        return Err(CheckpointError::TrailingData {
            path: path.to_path_buf(),
            covered: last_end,
            data_len,
        });
    }
    Ok(())
}
