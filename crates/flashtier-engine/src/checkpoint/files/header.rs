//! Reading one safetensors header without mapping the file (parsed by
//! [`flashtier_format::safetensors`]), and the tiling rule its tensors must
//! obey here (see the [`crate::checkpoint::files`] docs for the evidence behind it).

use std::path::Path;
use std::sync::Mutex;

use flashtier_format::safetensors::{LEN_WORD_BYTES, header_len, parse_header};
use flashtier_io::{DirectMode, StoreFile};

use super::{CheckpointError, TensorInfo, WeightFile};

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
    let json_len = header_len(&path, len_word, len_bytes)?;
    // Bounded by MAX_HEADER_BYTES in `header_len`.
    let mut header = vec![0u8; (LEN_WORD_BYTES + json_len) as usize];
    file.read_exact_at(&mut header, 0)?;
    let entries: Entries = parse_header(&path, &header[LEN_WORD_BYTES as usize..], len_bytes)?
        .into_iter()
        .map(|t| {
            let info = TensorInfo {
                file: index,
                dtype: t.dtype,
                shape: t.shape,
                offset: t.offset,
                len_bytes: t.len_bytes,
            };
            (t.name, info)
        })
        .collect();
    let data_start = LEN_WORD_BYTES + json_len;
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
