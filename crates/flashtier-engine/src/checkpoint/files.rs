//! Reading Hugging Face checkpoints: `config.json` plus `model.safetensors`
//! or shards listed by `model.safetensors.index.json`.
//!
//! Each safetensors header (an 8-byte little-endian length, then that many
//! bytes of JSON) is read here, without mapping the file, and parsed by
//! [`flashtier_format::safetensors`] (the parser the row store's table
//! sources share): header length at most its `MAX_HEADER_BYTES` (the
//! reference reader's bound), every tensor's `data_offsets` inside the file,
//! its length equal to shape times element size for the dtypes whose size is
//! known. Here ([`header`]) the tensors must also tile the data section
//! exactly (below). Tensor bytes are then read with positional reads into
//! the caller's buffer, so the reader holds no more than the headers in
//! memory: buffered ([`CheckpointFiles::read_tensor`]) or direct, bypassing the
//! page cache so packing a checkpoint larger than memory does not evict
//! everything else ([`CheckpointFiles::read_tensor_part_direct`]). Every read of
//! a safetensors file, header or tensor, goes through a `flashtier-io`
//! [`StoreFile`] (exact, retried, errors naming path, offset and length);
//! only `config.json` and the index are read here directly.
//!
//! Every file is opened as a regular file: a FIFO or a device given as
//! `config.json`, the index or a safetensors file is refused before it is
//! opened, so opening a checkpoint never blocks on a pipe.
//!
//! # Tiling: no overlap, no gap, no trailing bytes
//! Sorted by offset, the first tensor starts at byte 0 of the data section,
//! each next one where the previous ends, and the last ends at the end of the
//! file; empty tensors sit on a boundary. Anything else is refused:
//! [`CheckpointError::OverlappingTensors`] (an expert aliasing `lm_head`),
//! [`CheckpointError::DataGap`], [`CheckpointError::TrailingData`]. The
//! evidence that real files never need slack:
//! - the `safetensors` 0.8 writer (`tensor.rs`, `prepare`) assigns
//!   `data_offsets` back to back from 0 and pads only the JSON header, with
//!   spaces, to a multiple of 8 bytes, so the data section starts 8-aligned
//!   and needs no padding of its own; the Python `safetensors.torch.save_file`
//!   that transformers calls is this same Rust writer;
//! - its reader (`Metadata::validate`, `SafeTensors::read_metadata`) refuses
//!   any tensor that does not start where the previous one ended
//!   (`InvalidOffset`) and any file longer than its tensors
//!   (`MetadataIncompleteBuffer`), so a file with a gap, an overlap or
//!   trailing bytes is one that transformers itself cannot load;
//! - every checkpoint under `tests/fixtures/engine/` (written by transformers
//!   5.17 with torch 2.11, one of them sharded) and every synthetic one
//!   (`flashtier_pack::synth`) tiles exactly, with its header padded to 8 bytes.
//!
//! The padding the format does have lives inside the header's length, so it
//! needs no allowance here.
//!
//! A multimodal wrapper's text model is seen through
//! [`CheckpointFiles::text_part`] (its `text_config`, its tensors under
//! `model.language_model.` renamed to `model.`), which the expert packer
//! uses; the files and the raw config bytes are the wrapper's own.

use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};

use flashtier_format::open_regular_read;
use flashtier_io::{AlignedBuf, DirectMode, StoreFile};

mod error;
mod header;
mod text_part;
pub use text_part::{WRAPPER_TEXT_PREFIX, WRAPPER_TEXT_SCOPE};

pub use error::CheckpointError;
use header::open_weight_file;

/// One tensor of a checkpoint.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorInfo {
    /// Index of its file in [`CheckpointFiles::files`].
    pub file: usize,
    /// safetensors dtype name (`BF16`, `F8_E4M3`, `I64`...).
    pub dtype: String,
    /// Shape, outermost first.
    pub shape: Vec<u64>,
    /// Absolute byte offset of the data in the file.
    pub offset: u64,
    /// Length in bytes.
    pub len_bytes: u64,
}

/// One safetensors file of a checkpoint.
#[derive(Debug)]
pub struct WeightFile {
    /// File name relative to the checkpoint folder.
    pub name: String,
    /// Full path.
    pub path: PathBuf,
    /// File length in bytes.
    pub len_bytes: u64,
    /// The raw header (8-byte length + JSON), for pairing checksums.
    pub header: Vec<u8>,
    /// The file opened for buffered reads: its header was parsed through
    /// this handle, and buffered tensor reads use it.
    buffered: Arc<StoreFile>,
    /// The same file opened for direct reads (O_DIRECT where allowed), on
    /// first use, so buffered users never see an O_DIRECT warning.
    direct: Mutex<Option<Arc<StoreFile>>>,
}

impl WeightFile {
    /// The buffered read handle (the one its header was read through), for
    /// reads through a [`flashtier_io::StorageBackend`].
    #[must_use]
    pub fn buffered(&self) -> &Arc<StoreFile> {
        &self.buffered
    }

    fn direct_handle(&self) -> Result<Arc<StoreFile>, CheckpointError> {
        let mut slot = self.direct.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(f) = slot.as_ref() {
            return Ok(f.clone());
        }
        let f = StoreFile::open_read(&self.path, DirectMode::Prefer)?;
        *slot = Some(f.clone());
        Ok(f)
    }
}

/// The files of a checkpoint folder, opened and validated: `config.json`,
/// every safetensors file with its parsed header, and every tensor's place
/// (file, offset, length, dtype, shape), with raw-byte reads. The packer and
/// the pairing check work on this; the forward pass works on
/// [`crate::checkpoint::Checkpoint`], which wraps it with dtype and shape
/// checks and reads through a `StorageBackend`.
#[derive(Debug)]
pub struct CheckpointFiles {
    dir: PathBuf,
    config: serde_json::Value,
    config_bytes: Vec<u8>,
    /// Where `config`'s fields sit in `config.json` (`""`, or
    /// [`WRAPPER_TEXT_SCOPE`] for a wrapper's text part).
    config_scope: &'static str,
    files: Arc<Vec<WeightFile>>,
    tensors: BTreeMap<String, TensorInfo>,
}
fn io_err(path: &Path, offset: u64, len: u64) -> impl FnOnce(std::io::Error) -> CheckpointError {
    let path = path.to_path_buf();
    move |source| CheckpointError::Io {
        path,
        offset,
        len,
        source,
    }
}

fn read_json(path: &Path) -> Result<(serde_json::Value, Vec<u8>), CheckpointError> {
    let mut bytes = Vec::new();
    open_regular_read(path)?
        .read_to_end(&mut bytes)
        .map_err(io_err(path, 0, 0))?;
    let v = serde_json::from_slice(&bytes).map_err(|e| CheckpointError::Json {
        path: path.to_path_buf(),
        what: e.to_string(),
    })?;
    Ok((v, bytes))
}

impl CheckpointFiles {
    /// Open the checkpoint in `dir`, parsing every safetensors header.
    pub fn open(dir: &Path) -> Result<Self, CheckpointError> {
        let (config, config_bytes) = read_json(&dir.join("config.json"))?;
        let names = weight_file_names(dir)?;
        let mut files = Vec::with_capacity(names.len());
        let mut tensors = BTreeMap::new();
        for (i, name) in names.into_iter().enumerate() {
            let (wf, entries) = open_weight_file(dir, name, i)?;
            for (tname, info) in entries {
                if tensors.insert(tname.clone(), info).is_some() {
                    return Err(CheckpointError::BadTensor {
                        path: wf.path.clone(),
                        tensor: tname,
                        why: "appears in more than one file".into(),
                    });
                }
            }
            files.push(wf);
        }
        Ok(Self {
            dir: dir.to_path_buf(),
            config,
            config_bytes,
            config_scope: "",
            files: Arc::new(files),
            tensors,
        })
    }

    /// The checkpoint folder.
    #[must_use]
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Parsed `config.json`.
    #[must_use]
    pub fn config(&self) -> &serde_json::Value {
        &self.config
    }

    /// Where [`Self::config`]'s fields sit in `config.json`: `""`, or
    /// `text_config.` in a wrapper's text part (errors name a field as
    /// this plus its name).
    #[must_use]
    pub fn config_scope(&self) -> &'static str {
        self.config_scope
    }

    /// Raw bytes of `config.json`.
    #[must_use]
    pub fn config_bytes(&self) -> &[u8] {
        &self.config_bytes
    }

    /// The safetensors files, sorted by name.
    #[must_use]
    pub fn files(&self) -> &[WeightFile] {
        &self.files
    }

    /// Every file of the checkpoint a writer reads (config.json, the index,
    /// the safetensors files): an output may be none of them.
    #[must_use]
    pub fn input_paths(&self) -> Vec<PathBuf> {
        let mut inputs = vec![
            self.dir().join("config.json"),
            self.dir().join("model.safetensors.index.json"),
        ];
        inputs.extend(self.files().iter().map(|f| f.path.clone()));
        inputs
    }

    /// Every tensor, by name.
    #[must_use]
    pub fn tensors(&self) -> &BTreeMap<String, TensorInfo> {
        &self.tensors
    }

    /// The tensor called `name`.
    pub fn tensor(&self, name: &str) -> Result<&TensorInfo, CheckpointError> {
        self.tensors
            .get(name)
            .ok_or_else(|| CheckpointError::MissingTensor {
                tensor: name.to_string(),
                where_: self.dir.display().to_string(),
            })
    }

    /// Read tensor `name`'s bytes into `dst` (exactly its length).
    pub fn read_tensor(&self, name: &str, dst: &mut [u8]) -> Result<(), CheckpointError> {
        self.check_whole(name, dst)?;
        self.read_tensor_part(name, 0, dst)
    }

    /// Read `dst.len()` bytes of tensor `name`, starting `at` bytes into it
    /// (one expert's slice of a fused `[experts, ...]` tensor, say).
    pub fn read_tensor_part(
        &self,
        name: &str,
        at: u64,
        dst: &mut [u8],
    ) -> Result<(), CheckpointError> {
        let (wf, offset) = self.locate_part(name, at, dst.len())?;
        Ok(wf.buffered.read_exact_at(dst, offset)?)
    }

    fn check_whole(&self, name: &str, dst: &[u8]) -> Result<(), CheckpointError> {
        let t = self.tensor(name)?;
        if dst.len() as u64 != t.len_bytes {
            return Err(CheckpointError::BufferSize {
                tensor: name.to_string(),
                len_bytes: t.len_bytes,
                got: dst.len() as u64,
            });
        }
        Ok(())
    }

    /// The file holding `len` bytes at byte `at` of tensor `name`, and their
    /// absolute offset in it.
    fn locate_part(
        &self,
        name: &str,
        at: u64,
        len: usize,
    ) -> Result<(&WeightFile, u64), CheckpointError> {
        let t = self.tensor(name)?;
        let len = len as u64;
        if at.checked_add(len).is_none_or(|end| end > t.len_bytes) {
            return Err(CheckpointError::PartOutOfRange {
                tensor: name.to_string(),
                at,
                len,
                len_bytes: t.len_bytes,
            });
        }
        let wf = self
            .files
            .get(t.file)
            .ok_or_else(|| CheckpointError::MissingTensor {
                tensor: name.to_string(),
                where_: format!("file #{}", t.file),
            })?;
        Ok((wf, t.offset + at))
    }
}

impl CheckpointFiles {
    /// [`CheckpointFiles::read_tensor_part`] with direct I/O, bypassing the page
    /// cache: the aligned window around the bytes lands in `staging`
    /// (replaced by a larger one when too small, so its size is bounded by
    /// the largest read plus 8 KiB), then they are copied out
    /// ([`StoreFile::read_exact_at_staged`]). Reads buffered where the file
    /// system refuses O_DIRECT.
    pub fn read_tensor_part_direct(
        &self,
        name: &str,
        at: u64,
        dst: &mut [u8],
        staging: &mut AlignedBuf,
    ) -> Result<(), CheckpointError> {
        let (wf, offset) = self.locate_part(name, at, dst.len())?;
        let direct = wf.direct_handle()?;
        Ok(direct.read_exact_at_staged(dst, offset, staging)?)
    }
}

/// The safetensors files of `dir`: the index's files, or `model.safetensors`.
fn weight_file_names(dir: &Path) -> Result<Vec<String>, CheckpointError> {
    let index = dir.join("model.safetensors.index.json");
    if index.exists() {
        let (v, _) = read_json(&index)?;
        let map = v
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| CheckpointError::Json {
                path: index.clone(),
                what: "no \"weight_map\" object".into(),
            })?;
        let mut names = Vec::new();
        for (tensor, file) in map {
            let file = file.as_str().filter(|f| !f.contains('/') && !f.is_empty());
            let Some(file) = file else {
                return Err(CheckpointError::Json {
                    path: index.clone(),
                    what: format!("weight_map entry {tensor} is not a plain file name"),
                });
            };
            names.push(file.to_string());
        }
        names.sort();
        names.dedup();
        return Ok(names);
    }
    if dir.join("model.safetensors").exists() {
        return Ok(vec!["model.safetensors".into()]);
    }
    Err(CheckpointError::NoWeights {
        dir: dir.to_path_buf(),
    })
}
