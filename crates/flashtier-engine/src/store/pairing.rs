//! Checking that a store belongs to a checkpoint, before the engine reads
//! experts from one and dense tensors from the other.
//!
//! Two levels, both from headers only (no tensor bytes are read):
//! - the files: the same `config.json` (XXH3-64), the same safetensors files
//!   (names, lengths, header checksums) as the manifest's `source`;
//! - the records: the checkpoint's experts are laid out again with the
//!   packer's own rules ([`super::layout::expert_layout`]), and the manifest
//!   must agree with that layout exactly: the same expert-tensor layout
//!   (`split` per-expert tensors or the transformers-5 `fused` pair, where
//!   each record is one expert's slice), the same element type, the same
//!   record tensors in the same order (names, dtypes, shapes, offsets,
//!   lengths, FP8 scale tensors included), and record `i`'s key equal to the
//!   layout's `i`-th (layer, expert). A low-bit companion must hold the
//!   companion layout of that record layout for its bits and group.
//!
//! So a manifest edited after packing (a dtype, a shape, a tensor name, a
//! key), even with every checksum recomputed, is refused naming the record,
//! its key, the record tensor and the checkpoint tensor it comes from.

use flashtier::experts::lowbit_pack::companion_layout;
use flashtier::experts::verify::lowbit_spec;
use flashtier_format::manifest::hex_u64;
use flashtier_format::{RecordKey, RecordLayout, Store, TensorLayout, xxh3_64};

use super::error::{PackError, RecordMismatch};
use super::layout::{ExpertLayout, expert_layout};
use crate::checkpoint::files::CheckpointFiles;

/// Check that `store` was packed from `ckpt`: same config.json, same
/// safetensors files (names, lengths, header checksums), and every record's
/// key and tensors as the checkpoint's headers lay them out (a multimodal
/// wrapper's as its text part lays them out, as the packer does).
pub fn check_pairing(store: &Store, ckpt: &CheckpointFiles) -> Result<(), PackError> {
    let text = ckpt.text_part()?;
    let ckpt = text.as_ref().unwrap_or(ckpt);
    check_files(store, ckpt)?;
    check_records(store, ckpt)
}

fn source_mismatch(store: &Store, ckpt: &CheckpointFiles, why: String) -> PackError {
    PackError::SourceMismatch {
        store: store.path().to_path_buf(),
        dir: ckpt.dir().to_path_buf(),
        why,
    }
}

fn check_files(store: &Store, ckpt: &CheckpointFiles) -> Result<(), PackError> {
    let mismatch = |why: String| source_mismatch(store, ckpt, why);
    let Some(src) = &store.manifest().source else {
        return Err(mismatch(
            "the store's manifest names no source checkpoint".into(),
        ));
    };
    let config = hex_u64(xxh3_64(ckpt.config_bytes()));
    if src.config_xxh3 != config {
        return Err(mismatch(format!(
            "config.json checksum {config}, packed from {}",
            src.config_xxh3
        )));
    }
    let names: Vec<&str> = ckpt.files().iter().map(|f| f.name.as_str()).collect();
    let packed: Vec<&str> = src.files.iter().map(|f| f.name.as_str()).collect();
    if names != packed {
        return Err(mismatch(format!(
            "safetensors files {}, packed from {}",
            names.join(", "),
            packed.join(", ")
        )));
    }
    for (f, p) in ckpt.files().iter().zip(&src.files) {
        let sum = hex_u64(xxh3_64(&f.header));
        if f.len_bytes != p.len_bytes || sum != p.header_xxh3 {
            return Err(mismatch(format!(
                "{}: {} bytes, header {sum}; packed from {} bytes, header {}",
                f.name, f.len_bytes, p.len_bytes, p.header_xxh3
            )));
        }
    }
    Ok(())
}

/// One record's view of a mismatch, for [`PackError::RecordMismatch`].
struct Records<'a> {
    store: &'a Store,
    ckpt: &'a CheckpointFiles,
    layout: &'a ExpertLayout,
}

impl Records<'_> {
    /// The checkpoint tensor record tensor `name` of `key` comes from (for a
    /// low-bit tensor `T.qB.*`, the source of `T`).
    fn source_tensor(&self, key: RecordKey, name: &str) -> String {
        let base = self.layout.tensors.iter().find(|t| {
            name == t.name
                || name
                    .strip_prefix(t.name.as_str())
                    .is_some_and(|rest| rest.starts_with(".q"))
        });
        base.map_or_else(|| "none".into(), |t| self.layout.source_of(key, t).0)
    }

    fn err(&self, record: u64, tensor: &str, why: String) -> PackError {
        let m = self.store.manifest();
        let at = usize::try_from(record).unwrap_or(usize::MAX);
        let key = m
            .keys
            .get(at)
            .map_or_else(|| format!("index {record}"), |k| m.key_name(*k));
        let source_tensor = self
            .layout
            .keys
            .get(at)
            .map_or_else(|| "none".into(), |k| self.source_tensor(*k, tensor));
        PackError::RecordMismatch(Box::new(RecordMismatch {
            store: self.store.path().to_path_buf(),
            dir: self.ckpt.dir().to_path_buf(),
            record,
            key,
            tensor: tensor.to_string(),
            source_tensor,
            why,
        }))
    }
}

fn check_records(store: &Store, ckpt: &CheckpointFiles) -> Result<(), PackError> {
    let layout = expert_layout(ckpt)?;
    let m = store.manifest();
    let mismatch = |why: String| source_mismatch(store, ckpt, why);
    let packed_as = m.source.as_ref().map_or("", |s| s.expert_tensors.as_str());
    if packed_as != layout.source.name() {
        return Err(mismatch(format!(
            "packed from {packed_as} expert tensors, the checkpoint holds {} ones",
            layout.source.name()
        )));
    }
    if m.keys.len() != layout.keys.len() {
        return Err(mismatch(format!(
            "{} records, the checkpoint holds {} experts",
            m.keys.len(),
            layout.keys.len()
        )));
    }
    let exact = RecordLayout {
        payload_bytes: layout.payload_bytes,
        tensors: layout.tensors.clone(),
    };
    let expected = match lowbit_spec(m).map_err(|e| mismatch(e.to_string()))? {
        Some(spec) => companion_layout(&exact, spec),
        None => exact,
    };
    let r = Records {
        store,
        ckpt,
        layout: &layout,
    };
    let first = m.record.tensors.first().map_or("", |t| t.name.as_str());
    if m.dtype != layout.dtype {
        let why = format!(
            "the store's dtype is {}, the checkpoint's expert matrices are {}",
            m.dtype, layout.dtype
        );
        return Err(r.err(0, first, why));
    }
    check_tensors(&r, &m.record.tensors, &expected.tensors)?;
    for (i, (got, want)) in m.keys.iter().zip(&layout.keys).enumerate() {
        if got != want {
            let why = format!("the checkpoint's record {i} is {}", m.key_name(*want));
            return Err(r.err(i as u64, first, why));
        }
    }
    Ok(())
}

/// The manifest's record tensors `got` against the layout's `want`; a
/// difference is reported at record 0, the first record it applies to.
fn check_tensors(
    r: &Records<'_>,
    got: &[TensorLayout],
    want: &[TensorLayout],
) -> Result<(), PackError> {
    for (j, w) in want.iter().enumerate() {
        let Some(g) = got.get(j) else {
            return Err(r.err(
                0,
                &w.name,
                format!(
                    "missing from the manifest's record ({} tensors, the checkpoint gives {})",
                    got.len(),
                    want.len()
                ),
            ));
        };
        if g.name != w.name {
            let why = format!(
                "tensor {j} of the record is {} in the manifest, the checkpoint gives {}",
                g.name, w.name
            );
            return Err(r.err(0, &g.name, why));
        }
        if g.dtype != w.dtype || g.shape != w.shape {
            let why = format!(
                "the manifest says {} {}, the checkpoint has {} {}",
                g.dtype,
                dims(&g.shape),
                w.dtype,
                dims(&w.shape)
            );
            return Err(r.err(0, &g.name, why));
        }
        if (g.offset, g.len_bytes) != (w.offset, w.len_bytes) {
            let why = format!(
                "the manifest places it at byte {} length {}, the checkpoint's layout at byte {} length {}",
                g.offset, g.len_bytes, w.offset, w.len_bytes
            );
            return Err(r.err(0, &g.name, why));
        }
    }
    if let Some(extra) = got.get(want.len()) {
        let why = "not a tensor of the checkpoint's experts".to_string();
        return Err(r.err(0, &extra.name, why));
    }
    Ok(())
}

/// A shape as `[2, 3]`.
fn dims(shape: &[u64]) -> String {
    let d: Vec<String> = shape.iter().map(u64::to_string).collect();
    format!("[{}]", d.join(", "))
}
