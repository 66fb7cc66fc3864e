//! Writing a low-bit companion store from an exact expert store (the library
//! half of `flashtier pack experts --lowbit 3,2`).
//!
//! The companion has the same keys in the same order; its record layout
//! lists, for each quantized source tensor `T`, the tensors `T.qB.min` (F16,
//! one per group), `T.qB.step` (F16, one per group) and `T.qB.codes` (U8,
//! packed codes), each on a 64-byte boundary; other tensors keep their name,
//! dtype and bytes. `manifest.extra["lowbit"]` holds the bits, the group
//! size, the source store's payload size and the measured error against the
//! source. The file is written through [`flashtier_io::persist`]: under a
//! lock beside `OUT`, into a unique temp file renamed over `OUT` when
//! complete, and only over an older companion (never over the source store,
//! an exact store or a file that is not a store).
//!
//! Bound: one source and one companion record in memory.

use std::path::{Path, PathBuf};

use flashtier_format::widen::to_f32;
use flashtier_format::{
    Dtype, MAGIC, Manifest, RecordLayout, Store, StoreKind, StoreWriterPlan, TensorLayout,
};
use flashtier_io::persist::{Existing, FileKind, Output, PersistError, Wait, refuse_inputs};
use flashtier_io::{DirectMode, StoreFile};

use super::lowbit::{
    LowbitError, LowbitSpec, QuantError, TENSOR_ALIGN_BYTES, dequantize, quantize,
};

/// What [`write_companion`] wrote.
#[derive(Debug, Clone, serde::Serialize)]
pub struct LowbitReport {
    /// Companion store.
    pub path: PathBuf,
    /// Bits and group.
    pub spec: LowbitSpec,
    /// Records.
    pub records: u64,
    /// Payload bytes per companion record.
    pub payload_bytes: u64,
    /// Payload bytes per source record.
    pub source_payload_bytes: u64,
    /// Tensors quantized per record.
    pub quantized_tensors: usize,
    /// Tensors copied exactly per record.
    pub copied_tensors: usize,
    /// Error of the dequantized values against the source, over every record.
    pub error: QuantError,
}

/// The key of `manifest.extra` that marks a low-bit companion.
pub const LOWBIT_EXTRA_KEY: &str = "lowbit";

/// What an exact expert store starts with (for replacing one).
pub const EXACT_STORE_KIND: FileKind = FileKind {
    name: "flashtier expert store",
    magic: &MAGIC,
};

/// What a low-bit companion starts with (for replacing one).
pub const COMPANION_STORE_KIND: FileKind = FileKind {
    name: "flashtier low-bit companion store",
    magic: &MAGIC,
};

/// Whether `store` is a low-bit companion (its manifest has the
/// [`LOWBIT_EXTRA_KEY`] entry).
#[must_use]
pub fn is_companion(store: &Store) -> bool {
    store.manifest().extra.contains_key(LOWBIT_EXTRA_KEY)
}

/// The store at `path`, when a writer of an exact store (`companion`
/// false) or of a companion may replace or reuse it. `Ok(None)`: nothing
/// there, or a damaged file with the store magic (ours; replace it).
/// Refused: anything without the magic, a store of another kind, an exact
/// store where a companion is written and the reverse.
pub fn existing_store(path: &Path, companion: bool) -> Result<Option<Store>, PersistError> {
    let kind = if companion {
        COMPANION_STORE_KIND
    } else {
        EXACT_STORE_KIND
    };
    if flashtier_io::persist::existing(path, kind)? == Existing::Absent {
        return Ok(None);
    }
    let Ok(store) = Store::open(path) else {
        return Ok(None);
    };
    let found = if store.kind() != StoreKind::Experts {
        format!("it is a {} store", store.kind())
    } else if is_companion(&store) && !companion {
        "it is a low-bit companion store".to_string()
    } else if !is_companion(&store) && companion {
        "it is an exact expert store".to_string()
    } else {
        return Ok(Some(store));
    };
    Err(PersistError::NotReplaceable {
        path: path.to_path_buf(),
        expected: kind.name,
        found,
    })
}

/// The conventional companion path: `experts.ftstore` -> `experts.q3.ftstore`.
#[must_use]
pub fn companion_path(exact: &Path, bits: u32) -> PathBuf {
    let stem = exact
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    let ext = exact
        .extension()
        .map(|e| e.to_string_lossy().into_owned())
        .unwrap_or_else(|| "ftstore".into());
    exact.with_file_name(format!("{stem}.q{bits}.{ext}"))
}

fn quantizable(t: &TensorLayout) -> bool {
    matches!(
        t.dtype,
        Dtype::Bf16 | Dtype::F16 | Dtype::F32 | Dtype::F8E4M3
    ) && !t.name.contains("scale")
}

fn push(tensors: &mut Vec<TensorLayout>, end: &mut u64, name: String, dtype: Dtype, elems: u64) {
    let offset = end.next_multiple_of(TENSOR_ALIGN_BYTES);
    let len_bytes = elems * dtype.size_bytes();
    tensors.push(TensorLayout {
        name,
        dtype,
        shape: vec![elems],
        offset,
        len_bytes,
    });
    *end = offset + len_bytes;
}

/// The companion's record layout for a source layout.
#[must_use]
pub fn companion_layout(source: &RecordLayout, spec: LowbitSpec) -> RecordLayout {
    let mut tensors = Vec::new();
    let mut end = 0u64;
    for t in &source.tensors {
        let n = t.len_bytes / t.dtype.size_bytes();
        if quantizable(t) {
            let groups = spec.groups(n as usize) as u64;
            let b = spec.bits;
            push(
                &mut tensors,
                &mut end,
                format!("{}.q{b}.min", t.name),
                Dtype::F16,
                groups,
            );
            push(
                &mut tensors,
                &mut end,
                format!("{}.q{b}.step", t.name),
                Dtype::F16,
                groups,
            );
            push(
                &mut tensors,
                &mut end,
                format!("{}.q{b}.codes", t.name),
                Dtype::U8,
                spec.code_bytes(n as usize) as u64,
            );
        } else {
            let offset = end.next_multiple_of(TENSOR_ALIGN_BYTES);
            tensors.push(TensorLayout {
                offset,
                ..t.clone()
            });
            end = offset + t.len_bytes;
        }
    }
    RecordLayout {
        payload_bytes: end,
        tensors,
    }
}

fn slice<'a>(buf: &'a [u8], t: &TensorLayout) -> Result<&'a [u8], LowbitError> {
    let (o, l) = (t.offset as usize, t.len_bytes as usize);
    buf.get(o..o + l)
        .ok_or_else(|| LowbitError::Layout(format!("tensor {} outside its record", t.name)))
}

fn slice_mut<'a>(buf: &'a mut [u8], t: &TensorLayout) -> Result<&'a mut [u8], LowbitError> {
    let (o, l) = (t.offset as usize, t.len_bytes as usize);
    buf.get_mut(o..o + l)
        .ok_or_else(|| LowbitError::Layout(format!("tensor {} outside its record", t.name)))
}

/// Quantize one source record into `out` (a companion record, zeroed).
pub fn quantize_record(
    source: &RecordLayout,
    companion: &RecordLayout,
    spec: LowbitSpec,
    src: &[u8],
    out: &mut [u8],
    error: &mut QuantError,
) -> Result<(), LowbitError> {
    let mut dst = companion.tensors.iter();
    for t in &source.tensors {
        let bytes = slice(src, t)?;
        if !quantizable(t) {
            let d = dst
                .next()
                .ok_or_else(|| LowbitError::Layout("companion layout too short".into()))?;
            slice_mut(out, d)?.copy_from_slice(bytes);
            continue;
        }
        let values = to_f32(bytes, t.dtype);
        let q = quantize(&t.name, &values, spec)?;
        error.add(&values, &dequantize(&q, values.len(), spec));
        let mins: Vec<u8> = q.mins.iter().flat_map(|v| v.to_le_bytes()).collect();
        let steps: Vec<u8> = q.steps.iter().flat_map(|v| v.to_le_bytes()).collect();
        for part in [&mins, &steps, &q.codes] {
            let d = dst
                .next()
                .ok_or_else(|| LowbitError::Layout("companion layout too short".into()))?;
            slice_mut(out, d)?.copy_from_slice(part);
        }
    }
    Ok(())
}

fn lowbit_extra(spec: LowbitSpec, source: &Store, error: &QuantError) -> serde_json::Value {
    serde_json::json!({
        "bits": spec.bits,
        "group": spec.group,
        "source_payload_bytes": source.payload_bytes(),
        "source_file": source.path().file_name().map(|n| n.to_string_lossy().into_owned()),
        "error": error,
        "relative_rmse": error.relative_rmse(),
    })
}

/// Write every record, the tail and the header of the companion of
/// `source` into `file`; the companion's layout and its measured error.
fn write_body(
    source: &Store,
    spec: LowbitSpec,
    file: &StoreFile,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<(RecordLayout, QuantError), LowbitError> {
    // Records are read through flashtier-io, then checked against the
    // source's checksum table before they are quantized.
    let src_file = StoreFile::open_read(source.path(), DirectMode::Off)?;
    let layout = companion_layout(&source.manifest().record, spec);
    let mut manifest: Manifest = source.manifest().clone();
    manifest.record = layout.clone();
    manifest.extra.insert(
        LOWBIT_EXTRA_KEY.into(),
        lowbit_extra(spec, source, &QuantError::default()),
    );
    let plan = StoreWriterPlan::new(manifest.clone())?;
    let mut src_buf = vec![0u8; source.payload_bytes() as usize];
    let mut error = QuantError::default();
    let mut sums = Vec::with_capacity(source.record_count() as usize);
    for i in 0..source.record_count() {
        src_file.read_exact_at(&mut src_buf, source.record_offset(i)?)?;
        source.verify_record(i, &src_buf)?;
        let mut rec = vec![0u8; layout.payload_bytes as usize];
        quantize_record(
            &source.manifest().record,
            &layout,
            spec,
            &src_buf,
            &mut rec,
            &mut error,
        )?;
        let at = plan
            .record_offset(i)
            .ok_or_else(|| LowbitError::Layout(format!("record {i} outside the plan")))?;
        file.write_all_at(&rec, at)?;
        sums.push(plan.header().checksum_algo.digest(&rec));
        progress(i + 1, source.record_count());
    }
    // The error is known only now; the manifest sits after the records, so
    // re-planning with it moves no record.
    manifest
        .extra
        .insert(LOWBIT_EXTRA_KEY.into(), lowbit_extra(spec, source, &error));
    let last = StoreWriterPlan::new(manifest)?;
    if last.tail_offset() != plan.tail_offset() {
        return Err(LowbitError::Layout("re-planning moved the records".into()));
    }
    file.write_all_at(&last.tail_bytes(&sums)?, last.tail_offset())?;
    file.set_len(last.file_len())?;
    file.write_all_at(&last.header_bytes(&sums)?, 0)?;
    Ok((layout, error))
}

/// Write the `spec` companion of the exact store `src` to `out`;
/// `progress(done, total)` after each record. Waits for another writer of
/// `out`; see [`write_companion_with`].
pub fn write_companion(
    src: &Path,
    out: &Path,
    spec: LowbitSpec,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<LowbitReport, LowbitError> {
    write_companion_with(src, out, spec, Wait::Block, progress)
}

/// [`write_companion`], waiting for another writer of `out` or failing
/// at once per `wait`. Refuses an `out` that is (or links to) `src`, and an
/// existing `out` that is not a low-bit companion.
pub fn write_companion_with(
    src: &Path,
    out: &Path,
    spec: LowbitSpec,
    wait: Wait,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<LowbitReport, LowbitError> {
    refuse_inputs(out, &[src.to_path_buf()])?;
    let source = Store::open(src)?;
    let mut output = Output::lock(out, wait)?;
    existing_store(output.target(), true)?;
    let tmp = output.create_temp()?.to_path_buf();
    let file = StoreFile::open_rw(&tmp, DirectMode::Off, false)?;
    let (layout, error) = write_body(&source, spec, &file, progress)?;
    drop(file);
    output.commit()?;
    Ok(LowbitReport {
        path: out.to_path_buf(),
        spec,
        records: source.record_count(),
        payload_bytes: layout.payload_bytes,
        source_payload_bytes: source.payload_bytes(),
        quantized_tensors: source
            .manifest()
            .record
            .tensors
            .iter()
            .filter(|t| quantizable(t))
            .count(),
        copied_tensors: source
            .manifest()
            .record
            .tensors
            .iter()
            .filter(|t| !quantizable(t))
            .count(),
        error,
    })
}
