//! The engine's view of a checkpoint: [`crate::checkpoint::files`] parses and
//! validates `config.json`, the index and every safetensors header (offsets
//! inside the file, byte length = element count x dtype width); this layer
//! adds what the forward pass needs: dtype and shape checks against the
//! config with errors naming the tensor, and tensor reads through a
//! [`StorageBackend`] (the one I/O seam; buffered, since tensor offsets in a
//! safetensors file are not 4 KiB aligned).
//!
//! Only headers are held; tensor bytes are read on demand into page-aligned
//! buffers, so nothing but the resident weights is ever in memory.

pub mod files;

use std::path::Path;
use std::sync::Arc;

use flashtier_format::Dtype;
use flashtier_format::widen::to_f32;
use flashtier_io::{AlignedBuf, Landing, PosixBackend, ReadReq, StorageBackend, StoreFile};

use crate::checkpoint::files::{CheckpointFiles, TensorInfo};
use crate::error::EngineError;

/// Reader threads of the default backend for weight loads.
const LOAD_READERS: usize = 4;

/// One range to read: tensor name, its info, start in the tensor, length.
type TensorRange<'a> = (&'a str, &'a TensorInfo, u64, usize);

/// The error of a range outside its tensor (or that did not land).
fn range_error(&(name, info, start, len): &TensorRange<'_>) -> EngineError {
    EngineError::TensorRange {
        name: name.to_string(),
        start,
        len: len as u64,
        tensor_bytes: info.len_bytes,
    }
}

/// The tensors of a checkpoint directory, by name.
pub struct Checkpoint {
    source: CheckpointFiles,
    /// One read handle per safetensors file, in `source.files()` order.
    files: Vec<Arc<StoreFile>>,
    backend: Arc<dyn StorageBackend>,
}

impl std::fmt::Debug for Checkpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Checkpoint")
            .field("dir", &self.source.dir())
            .field("backend", &self.backend.name())
            .finish()
    }
}

/// The dtype of a tensor as the engine computes with it.
fn parse_dtype(name: &str) -> Option<Dtype> {
    match name {
        "BF16" => Some(Dtype::Bf16),
        "F16" => Some(Dtype::F16),
        "F32" => Some(Dtype::F32),
        "F8_E4M3" => Some(Dtype::F8E4M3),
        _ => None,
    }
}

impl Checkpoint {
    /// Open `config.json` and the safetensors of `dir` (single file or the
    /// shards of `model.safetensors.index.json`), reading with a posix
    /// backend.
    pub fn open(dir: &Path) -> Result<Self, EngineError> {
        let backend: Arc<dyn StorageBackend> = Arc::new(PosixBackend::new(LOAD_READERS)?);
        Self::open_with(dir, backend)
    }

    /// [`Checkpoint::open`] reading through `backend`.
    pub fn open_with(dir: &Path, backend: Arc<dyn StorageBackend>) -> Result<Self, EngineError> {
        let source = CheckpointFiles::open(dir)?;
        // The handles the headers were read through: the tensors come from
        // the same files.
        let files = source
            .files()
            .iter()
            .map(|f| f.buffered().clone())
            .collect();
        Ok(Self {
            source,
            files,
            backend,
        })
    }

    /// The parsed checkpoint (files, headers, config) underneath.
    pub fn source(&self) -> &CheckpointFiles {
        &self.source
    }

    /// Is `name` in the checkpoint?
    pub fn contains(&self, name: &str) -> bool {
        self.source.tensors().contains_key(name)
    }

    /// Where `name` lives (any dtype).
    fn tensor(&self, name: &str) -> Result<&TensorInfo, EngineError> {
        self.source
            .tensors()
            .get(name)
            .ok_or_else(|| EngineError::MissingTensor {
                name: name.to_string(),
            })
    }

    /// Where `name` lives, with its dtype checked.
    pub fn info(&self, name: &str) -> Result<(&TensorInfo, Dtype), EngineError> {
        let info = self.tensor(name)?;
        let dtype = parse_dtype(&info.dtype).ok_or_else(|| EngineError::TensorDtype {
            name: name.to_string(),
            dtype: info.dtype.clone(),
        })?;
        Ok((info, dtype))
    }

    /// Check that `name` has shape `want`; returns its dtype.
    pub fn expect_shape(&self, name: &str, want: &[usize]) -> Result<Dtype, EngineError> {
        let (info, dtype) = self.info(name)?;
        if info.shape.len() != want.len()
            || info.shape.iter().zip(want).any(|(g, w)| *g != *w as u64)
        {
            return Err(EngineError::TensorShape {
                name: name.to_string(),
                got: info.shape.clone(),
                want: want.iter().map(|&w| w as u64).collect(),
            });
        }
        Ok(dtype)
    }

    /// `len` bytes of tensor `name` starting `start` bytes into it, read
    /// through the backend.
    pub fn read_range(
        &self,
        name: &str,
        start: u64,
        len: usize,
    ) -> Result<AlignedBuf, EngineError> {
        let (info, _) = self.info(name)?;
        self.read_one((name, info, start, len))
    }

    /// The `I64` vector `name` of `len` elements (integer buffers such as
    /// Qwen4-Exp's n-gram hash parameters), little-endian.
    pub fn load_i64(&self, name: &str, len: usize) -> Result<Vec<i64>, EngineError> {
        let info = self.tensor(name)?;
        if info.dtype != "I64" {
            return Err(EngineError::TensorDtype {
                name: name.to_string(),
                dtype: format!("{} (an I64 vector is expected)", info.dtype),
            });
        }
        if info.shape != [len as u64] {
            return Err(EngineError::TensorShape {
                name: name.to_string(),
                got: info.shape.clone(),
                want: vec![len as u64],
            });
        }
        let bytes = self.read_one((name, info, 0, len * 8))?;
        Ok(bytes
            .chunks_exact(8)
            .map(|b| i64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]))
            .collect())
    }

    /// One range, read through the backend.
    fn read_one(&self, range: TensorRange<'_>) -> Result<AlignedBuf, EngineError> {
        let mut bufs = self.read_batch(&[range])?;
        bufs.pop().ok_or_else(|| range_error(&range))
    }

    /// The byte ranges `(tensor, start, len)`, read through the backend as
    /// one batch (every read started before the first is waited on), in
    /// the order given.
    pub fn read_ranges(
        &self,
        ranges: &[(&str, u64, usize)],
    ) -> Result<Vec<AlignedBuf>, EngineError> {
        let mut batch = Vec::with_capacity(ranges.len());
        for &(name, start, len) in ranges {
            let (info, _) = self.info(name)?;
            batch.push((name, info, start, len));
        }
        self.read_batch(&batch)
    }

    fn read_batch(&self, ranges: &[TensorRange<'_>]) -> Result<Vec<AlignedBuf>, EngineError> {
        let mut reqs = Vec::with_capacity(ranges.len());
        for (tag, r) in ranges.iter().enumerate() {
            let &(_, info, start, len) = r;
            let end = start
                .checked_add(len as u64)
                .filter(|e| *e <= info.len_bytes);
            let (Some(_), Some(file)) = (end, self.files.get(info.file)) else {
                return Err(range_error(r));
            };
            reqs.push(ReadReq {
                file: file.clone(),
                offset: info.offset + start,
                len,
                landing: Landing::Host(AlignedBuf::zeroed(len)),
                tag: tag as u64,
            });
        }
        let mut landed = self.backend.read(reqs)?.into_iter();
        ranges
            .iter()
            .map(|r| {
                let mut buf = landed
                    .next()
                    .and_then(|l| l.buf)
                    .ok_or_else(|| range_error(r))?;
                buf.set_len(r.3);
                Ok(buf)
            })
            .collect()
    }

    /// Tensor `name`, checked against `want`, converted to f32. FP8
    /// tensors need their block scales and are refused here (the loader
    /// keeps them as block-scaled matrices).
    pub fn load_f32(&self, name: &str, want: &[usize]) -> Result<Vec<f32>, EngineError> {
        let dtype = self.expect_shape(name, want)?;
        if dtype == Dtype::F8E4M3 {
            return Err(EngineError::TensorDtype {
                name: name.to_string(),
                dtype: "F8_E4M3 (without its block scales)".into(),
            });
        }
        let (info, _) = self.info(name)?;
        let len = usize::try_from(info.len_bytes).map_err(|_| EngineError::TensorRange {
            name: name.to_string(),
            start: 0,
            len: info.len_bytes,
            tensor_bytes: info.len_bytes,
        })?;
        let bytes = self.read_range(name, 0, len)?;
        Ok(to_f32(&bytes, dtype))
    }
}
