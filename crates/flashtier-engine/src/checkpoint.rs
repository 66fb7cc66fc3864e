//! The engine's view of a checkpoint: [`crate::source`] parses and
//! validates `config.json`, the index and every safetensors header (offsets
//! inside the file, byte length = element count x dtype width); this layer
//! adds what the forward pass needs: dtype and shape checks against the
//! config with errors naming the tensor, sub-range reads (one expert out of
//! a fused `experts.gate_up_proj`), and widening to f32.
//!
//! Only headers are held; tensor bytes are read on demand with positioned
//! reads, so the experts of a checkpoint bigger than memory are never all
//! resident.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;

use crate::error::EngineError;
use crate::source::{Checkpoint as Source, TensorInfo};

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
    /// 8-bit float E4M3 (e4m3fn): with a block scale tensor, DeepSeek-V3's
    /// FP8 matrices (see [`crate::kernels::MatRef::F8Block`]).
    F8E4M3,
}

impl DType {
    /// Bytes per element.
    pub fn size_bytes(self) -> usize {
        match self {
            DType::F8E4M3 => 1,
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
            DType::F8E4M3 => "F8_E4M3",
        }
    }

    fn parse(name: &str) -> Option<Self> {
        match name {
            "BF16" => Some(DType::Bf16),
            "F16" => Some(DType::F16),
            "F32" => Some(DType::F32),
            "F8_E4M3" => Some(DType::F8E4M3),
            _ => None,
        }
    }
}

/// The tensors of a checkpoint directory, by name.
#[derive(Debug)]
pub struct Checkpoint {
    source: Source,
    /// One read handle per safetensors file, in `source.files()` order.
    handles: Vec<File>,
}

impl Checkpoint {
    /// Open `config.json` and the safetensors of `dir` (single file or the
    /// shards of `model.safetensors.index.json`).
    pub fn open(dir: &Path) -> Result<Self, EngineError> {
        let source = Source::open(dir)?;
        let handles = source
            .files()
            .iter()
            .map(|f| {
                File::open(&f.path).map_err(|e| EngineError::Io {
                    path: f.path.clone(),
                    source: e,
                })
            })
            .collect::<Result<_, _>>()?;
        Ok(Self { source, handles })
    }

    /// The parsed checkpoint (files, headers, config) underneath.
    pub fn source(&self) -> &Source {
        &self.source
    }

    /// Is `name` in the checkpoint?
    pub fn contains(&self, name: &str) -> bool {
        self.source.tensors().contains_key(name)
    }

    /// Where `name` lives, with its dtype checked.
    pub fn info(&self, name: &str) -> Result<(&TensorInfo, DType), EngineError> {
        let info = self
            .source
            .tensors()
            .get(name)
            .ok_or_else(|| EngineError::MissingTensor {
                name: name.to_string(),
            })?;
        let dtype = DType::parse(&info.dtype).ok_or_else(|| EngineError::TensorDtype {
            name: name.to_string(),
            dtype: info.dtype.clone(),
        })?;
        Ok((info, dtype))
    }

    /// Check that `name` has shape `want`; returns its dtype.
    pub fn expect_shape(&self, name: &str, want: &[usize]) -> Result<DType, EngineError> {
        let (info, dtype) = self.info(name)?;
        if info.shape.len() != want.len()
            || info.shape.iter().zip(want).any(|(g, w)| *g != *w as u64)
        {
            return Err(EngineError::TensorShape {
                name: name.to_string(),
                got: info
                    .shape
                    .iter()
                    .map(|d| usize::try_from(*d).unwrap_or(usize::MAX))
                    .collect(),
                want: want.to_vec(),
            });
        }
        Ok(dtype)
    }

    /// `len` bytes of tensor `name` starting `start` bytes into it.
    pub fn read_range(&self, name: &str, start: u64, len: usize) -> Result<Vec<u8>, EngineError> {
        let (info, _) = self.info(name)?;
        let path = self
            .source
            .files()
            .get(info.file)
            .map(|f| f.path.clone())
            .unwrap_or_default();
        let end = start
            .checked_add(len as u64)
            .filter(|e| *e <= info.len_bytes);
        let handle = self.handles.get(info.file);
        let (Some(_), Some(handle)) = (end, handle) else {
            return Err(EngineError::Safetensors {
                path,
                reason: format!(
                    "range {start}+{len} is outside tensor `{name}` of {} bytes",
                    info.len_bytes
                ),
            });
        };
        let mut buf = vec![0u8; len];
        handle
            .read_exact_at(&mut buf, info.offset + start)
            .map_err(|source| EngineError::Io { path, source })?;
        Ok(buf)
    }

    /// Tensor `name`, checked against `want`, converted to f32.
    /// FP8 tensors need their block scales and are refused here
    /// ([`crate::ModelWeights`] dequantizes them).
    pub fn load_f32(&self, name: &str, want: &[usize]) -> Result<Vec<f32>, EngineError> {
        let dtype = self.expect_shape(name, want)?;
        if dtype == DType::F8E4M3 {
            return Err(EngineError::TensorDtype {
                name: name.to_string(),
                dtype: "F8_E4M3 (without its block scales)".into(),
            });
        }
        let (info, _) = self.info(name)?;
        let len = usize::try_from(info.len_bytes).map_err(|_| EngineError::Safetensors {
            path: self.source.dir().to_path_buf(),
            reason: format!("tensor `{name}` is too large for this machine"),
        })?;
        let bytes = self.read_range(name, 0, len)?;
        Ok(to_f32(&bytes, dtype))
    }
}

/// Decode little-endian `dtype` elements to f32 (exact for BF16, F16 and
/// FP8 codes, unscaled).
pub fn to_f32(bytes: &[u8], dtype: DType) -> Vec<f32> {
    match dtype {
        DType::F8E4M3 => bytes
            .iter()
            .map(|&c| flashtier::rows::fp8::e4m3_to_f32(c))
            .collect(),
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
