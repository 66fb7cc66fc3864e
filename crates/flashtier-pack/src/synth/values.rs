//! Deterministic tensor values and the safetensors writer.
//!
//! Element `i` of a tensor is a pure function of (seed, tensor name, i)
//! (a SplitMix64 hash), so any chunk can be generated on its own and the
//! whole checkpoint is reproducible from the seed.

use std::io::{BufWriter, Write};
use std::path::Path;

use flashtier_format::splitmix::splitmix64;
use flashtier_format::{Dtype, xxh3_64};

use super::{CHUNK_BYTES, Init, SynthTensor};

fn value(init: Init, r: u64) -> f32 {
    let u = (r >> 40) as f32 / (1u64 << 24) as f32;
    match init {
        Init::Uniform(s) | Init::ShiftedRows { scale: s, .. } => (2.0 * u - 1.0) * s,
        Init::NearOne(s) => 1.0 + (2.0 * u - 1.0) * s,
        Init::Scale(s) => s * (0.5 + u),
    }
}

fn tensor_key(name_hash: u64, seed: u64) -> u64 {
    name_hash ^ seed.wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

/// The random word of element `index` of the tensor keyed `key`.
fn element(key: u64, index: u64) -> u64 {
    splitmix64(key ^ index.wrapping_mul(0xD1B5_4A32_D192_ED03))
}

/// Fill `out` with the bytes of tensor `t` starting at byte `start` of the
/// tensor (`start` a multiple of the element size; `out` a whole number of
/// elements).
pub fn fill_tensor(seed: u64, t: &SynthTensor, start: u64, out: &mut [u8]) {
    let key = match t.init {
        Init::ShiftedRows { of, .. } => tensor_key(of, seed),
        _ => tensor_key(xxh3_64(t.name.as_bytes()), seed),
    };
    let size = t.dtype.size_bytes() as usize;
    let first = start / size as u64;
    for (i, elem) in out.chunks_exact_mut(size).enumerate() {
        let at = first + i as u64;
        let index = match t.init {
            Init::ShiftedRows {
                shift, rows, cols, ..
            } => ((at / cols.max(1) + shift) % rows.max(1)) * cols + at % cols.max(1),
            _ => at,
        };
        let r = element(key, index);
        let x = value(t.init, r);
        match t.dtype {
            Dtype::F32 => elem.copy_from_slice(&x.to_le_bytes()),
            Dtype::Bf16 => elem.copy_from_slice(&half::bf16::from_f32(x).to_le_bytes()),
            Dtype::F16 => elem.copy_from_slice(&half::f16::from_f32(x).to_le_bytes()),
            // Sign and a magnitude below 1.0 (exponent field 0..=6): never NaN.
            Dtype::F8E4M3 => elem[0] = (r & 0x80) as u8 | ((r >> 8) % 0x38) as u8,
            _ => elem[0] = r as u8,
        }
    }
}

/// Write `tensors` as one safetensors file; returns the tensor bytes.
pub(super) fn write_safetensors(
    seed: u64,
    tensors: &[SynthTensor],
    path: &Path,
    progress: &mut dyn FnMut(u64),
) -> std::io::Result<u64> {
    let mut header = serde_json::Map::new();
    header.insert("__metadata__".into(), serde_json::json!({ "format": "pt" }));
    let mut at = 0u64;
    for t in tensors {
        let end = at + t.len_bytes();
        header.insert(
            t.name.clone(),
            serde_json::json!({ "dtype": t.dtype.name(), "shape": t.shape, "data_offsets": [at, end] }),
        );
        at = end;
    }
    let mut json = serde_json::to_vec(&header)?;
    json.resize(json.len().next_multiple_of(8), b' ');
    let mut w = BufWriter::with_capacity(CHUNK_BYTES, std::fs::File::create(path)?);
    w.write_all(&(json.len() as u64).to_le_bytes())?;
    w.write_all(&json)?;
    let mut chunk = vec![0u8; CHUNK_BYTES];
    for t in tensors {
        let len = t.len_bytes();
        let mut done = 0u64;
        while done < len {
            let n = (len - done).min(CHUNK_BYTES as u64) as usize;
            let piece = &mut chunk[..n];
            fill_tensor(seed, t, done, piece);
            w.write_all(piece)?;
            done += n as u64;
            progress(n as u64);
        }
    }
    w.into_inner()
        .map_err(std::io::IntoInnerError::into_error)?
        .sync_all()?;
    Ok(at)
}
