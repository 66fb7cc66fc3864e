//! Safetensors checkpoints, single-file or sharded (`model.safetensors.index.json`).
//!
//! Only headers are read at open; tensor bytes are read on demand with
//! positioned reads, so the experts of a checkpoint bigger than memory are
//! never all resident. Every header is validated (offsets inside the file,
//! byte length = element count x dtype width, no overlaps past the end)
//! before any tensor is served.

use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use serde_json::Value;

use super::error::EngineError;

/// Longest header accepted (the format allows 100 MB; real ones are far smaller).
const MAX_HEADER_BYTES: u64 = 100 << 20;

/// Element types the engine computes with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum DType {
    /// bfloat16.
    Bf16,
    /// IEEE half.
    F16,
    /// IEEE single.
    F32,
}

impl DType {
    /// Bytes per element.
    pub fn size_bytes(self) -> usize {
        match self {
            DType::Bf16 | DType::F16 => 2,
            DType::F32 => 4,
        }
    }

    /// The safetensors spelling.
    pub fn name(self) -> &'static str {
        match self {
            DType::Bf16 => "BF16",
            DType::F16 => "F16",
            DType::F32 => "F32",
        }
    }
}

/// Where one tensor lives.
#[derive(Clone, Debug)]
pub struct TensorInfo {
    /// Index of the file in [`Checkpoint::files`].
    pub file: usize,
    /// Element type, or the unsupported dtype's name.
    pub dtype: Result<DType, String>,
    /// Shape, outermost first.
    pub shape: Vec<usize>,
    /// Absolute byte offset in the file.
    pub offset: u64,
    /// Length in bytes.
    pub len_bytes: u64,
}

/// One open safetensors file.
#[derive(Debug)]
pub struct ShardFile {
    /// Path of the file.
    pub path: PathBuf,
    file: File,
}

/// The tensors of a checkpoint directory, by name.
#[derive(Debug)]
pub struct Checkpoint {
    files: Vec<ShardFile>,
    tensors: HashMap<String, TensorInfo>,
}

impl Checkpoint {
    /// Open the safetensors of `dir`: the files named by
    /// `model.safetensors.index.json` when present, else every `*.safetensors`.
    pub fn open(dir: &Path) -> Result<Self, EngineError> {
        let mut paths = shard_paths(dir)?;
        paths.sort();
        if paths.is_empty() {
            return Err(EngineError::Io {
                path: dir.to_path_buf(),
                source: std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    "no *.safetensors file in the model directory",
                ),
            });
        }
        let mut files = Vec::with_capacity(paths.len());
        let mut tensors = HashMap::new();
        for (idx, path) in paths.into_iter().enumerate() {
            let file = File::open(&path).map_err(|source| EngineError::Io {
                path: path.clone(),
                source,
            })?;
            for (name, info) in read_header(&path, &file, idx)? {
                if tensors.insert(name.clone(), info).is_some() {
                    return Err(EngineError::Safetensors {
                        path,
                        reason: format!("tensor `{name}` appears in more than one file"),
                    });
                }
            }
            files.push(ShardFile { path, file });
        }
        Ok(Self { files, tensors })
    }

    /// The files, in the order [`TensorInfo::file`] indexes them.
    pub fn files(&self) -> &[ShardFile] {
        &self.files
    }

    /// Is `name` in the checkpoint?
    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// Where `name` lives, with its dtype checked.
    pub fn info(&self, name: &str) -> Result<(&TensorInfo, DType), EngineError> {
        let info = self
            .tensors
            .get(name)
            .ok_or_else(|| EngineError::MissingTensor {
                name: name.to_string(),
            })?;
        let dtype = info
            .dtype
            .clone()
            .map_err(|dtype| EngineError::TensorDtype {
                name: name.to_string(),
                dtype,
            })?;
        Ok((info, dtype))
    }

    /// Check that `name` has shape `want`; returns its dtype.
    pub fn expect_shape(&self, name: &str, want: &[usize]) -> Result<DType, EngineError> {
        let (info, dtype) = self.info(name)?;
        if info.shape != want {
            return Err(EngineError::TensorShape {
                name: name.to_string(),
                got: info.shape.clone(),
                want: want.to_vec(),
            });
        }
        Ok(dtype)
    }

    /// `len` bytes of tensor `name` starting `start` bytes into it.
    pub fn read_range(&self, name: &str, start: u64, len: usize) -> Result<Vec<u8>, EngineError> {
        let (info, _) = self.info(name)?;
        let end = start
            .checked_add(len as u64)
            .filter(|e| *e <= info.len_bytes);
        if end.is_none() {
            return Err(EngineError::Safetensors {
                path: self.files[info.file].path.clone(),
                reason: format!(
                    "range {start}+{len} is outside tensor `{name}` of {} bytes",
                    info.len_bytes
                ),
            });
        }
        let shard = &self.files[info.file];
        let mut buf = vec![0u8; len];
        shard
            .file
            .read_exact_at(&mut buf, info.offset + start)
            .map_err(|source| EngineError::Io {
                path: shard.path.clone(),
                source,
            })?;
        Ok(buf)
    }

    /// Tensor `name`, checked against `want`, converted to f32.
    pub fn load_f32(&self, name: &str, want: &[usize]) -> Result<Vec<f32>, EngineError> {
        let dtype = self.expect_shape(name, want)?;
        let (info, _) = self.info(name)?;
        let len = usize::try_from(info.len_bytes).map_err(|_| EngineError::Safetensors {
            path: self.files[info.file].path.clone(),
            reason: format!("tensor `{name}` is too large for this machine"),
        })?;
        let bytes = self.read_range(name, 0, len)?;
        Ok(to_f32(&bytes, dtype))
    }
}

/// Decode little-endian `dtype` elements to f32 (exact for BF16 and F16).
pub fn to_f32(bytes: &[u8], dtype: DType) -> Vec<f32> {
    match dtype {
        DType::Bf16 => bytes
            .chunks_exact(2)
            .map(|b| f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16))
            .collect(),
        DType::F16 => bytes
            .chunks_exact(2)
            .map(|b| half::f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32())
            .collect(),
        DType::F32 => bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
    }
}

fn shard_paths(dir: &Path) -> Result<Vec<PathBuf>, EngineError> {
    let index = dir.join("model.safetensors.index.json");
    if index.exists() {
        let text = std::fs::read_to_string(&index).map_err(|source| EngineError::Io {
            path: index.clone(),
            source,
        })?;
        let value: Value = serde_json::from_str(&text).map_err(|source| EngineError::Json {
            path: index.clone(),
            source,
        })?;
        let map = value
            .get("weight_map")
            .and_then(Value::as_object)
            .ok_or_else(|| EngineError::Safetensors {
                path: index.clone(),
                reason: "no `weight_map` object".into(),
            })?;
        let mut names: Vec<&str> = map.values().filter_map(Value::as_str).collect();
        names.sort_unstable();
        names.dedup();
        return names
            .into_iter()
            .map(|n| {
                if n.contains('/') || n.contains("..") {
                    return Err(EngineError::Safetensors {
                        path: index.clone(),
                        reason: format!("shard name `{n}` leaves the model directory"),
                    });
                }
                Ok(dir.join(n))
            })
            .collect();
    }
    let entries = std::fs::read_dir(dir).map_err(|source| EngineError::Io {
        path: dir.to_path_buf(),
        source,
    })?;
    let mut paths = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|source| EngineError::Io {
            path: dir.to_path_buf(),
            source,
        })?;
        let path = entry.path();
        if path.extension().is_some_and(|e| e == "safetensors") {
            paths.push(path);
        }
    }
    Ok(paths)
}

fn read_header(
    path: &Path,
    file: &File,
    idx: usize,
) -> Result<Vec<(String, TensorInfo)>, EngineError> {
    let bad = |reason: String| EngineError::Safetensors {
        path: path.to_path_buf(),
        reason,
    };
    let io = |source| EngineError::Io {
        path: path.to_path_buf(),
        source,
    };
    let file_len = file.metadata().map_err(io)?.len();
    let mut len8 = [0u8; 8];
    file.read_exact_at(&mut len8, 0).map_err(io)?;
    let header_len = u64::from_le_bytes(len8);
    if header_len > MAX_HEADER_BYTES || 8 + header_len > file_len {
        return Err(bad(format!(
            "header length {header_len} does not fit a {file_len}-byte file"
        )));
    }
    let mut header = vec![0u8; header_len as usize];
    file.read_exact_at(&mut header, 8).map_err(io)?;
    let value: Value =
        serde_json::from_slice(&header).map_err(|e| bad(format!("header is not JSON: {e}")))?;
    let obj = value
        .as_object()
        .ok_or_else(|| bad("header is not a JSON object".into()))?;
    let data_start = 8 + header_len;
    let mut out = Vec::with_capacity(obj.len());
    for (name, entry) in obj {
        if name == "__metadata__" {
            continue;
        }
        let info = tensor_entry(entry, data_start, file_len, idx)
            .map_err(|reason| bad(format!("tensor `{name}`: {reason}")))?;
        out.push((name.clone(), info));
    }
    Ok(out)
}

fn tensor_entry(
    entry: &Value,
    data_start: u64,
    file_len: u64,
    idx: usize,
) -> Result<TensorInfo, String> {
    let dtype_name = entry
        .get("dtype")
        .and_then(Value::as_str)
        .ok_or("no dtype")?;
    let dtype = match dtype_name {
        "BF16" => Ok(DType::Bf16),
        "F16" => Ok(DType::F16),
        "F32" => Ok(DType::F32),
        other => Err(other.to_string()),
    };
    let shape: Vec<usize> = entry
        .get("shape")
        .and_then(Value::as_array)
        .ok_or("no shape")?
        .iter()
        .map(|d| {
            d.as_u64()
                .and_then(|d| usize::try_from(d).ok())
                .ok_or("bad shape entry")
        })
        .collect::<Result<_, _>>()?;
    let offs = entry
        .get("data_offsets")
        .and_then(Value::as_array)
        .ok_or("no data_offsets")?;
    let (begin, end) = match offs.as_slice() {
        [a, b] => (
            a.as_u64().ok_or("bad offset")?,
            b.as_u64().ok_or("bad offset")?,
        ),
        _ => return Err("data_offsets is not a pair".into()),
    };
    if end < begin || data_start + end > file_len {
        return Err(format!("data_offsets [{begin}, {end}] leave the file"));
    }
    if let Ok(dt) = dtype {
        let numel = shape
            .iter()
            .try_fold(1u64, |acc, d| acc.checked_mul(*d as u64));
        let want = numel.and_then(|n| n.checked_mul(dt.size_bytes() as u64));
        if want != Some(end - begin) {
            return Err(format!(
                "{} bytes do not hold shape {shape:?} of {dtype_name}",
                end - begin
            ));
        }
    }
    Ok(TensorInfo {
        file: idx,
        dtype,
        shape,
        offset: data_start + begin,
        len_bytes: end - begin,
    })
}
