//! Helpers for tests, examples and benchmarks: write small expert stores with
//! known contents.

use std::path::Path;

use flashtier_format::{Dtype, FormatError, Manifest, RecordKey, StoreKind, StoreWriterPlan};

/// The byte at `i` of record `(layer, expert)` in stores from [`write_store`].
#[must_use]
pub fn pattern_byte(layer: u32, expert: u32, i: usize) -> u8 {
    (layer.wrapping_mul(31).wrapping_add(expert.wrapping_mul(7)) as usize).wrapping_add(i * 13)
        as u8
}

/// Write an expert store of `layers x experts` records of `payload_bytes`
/// each, filled with [`pattern_byte`].
pub fn write_store(
    path: &Path,
    layers: u32,
    experts: u32,
    payload_bytes: u64,
) -> Result<(), std::io::Error> {
    let keys: Vec<RecordKey> = (0..layers)
        .flat_map(|l| (0..experts).map(move |e| RecordKey::new(l, e)))
        .collect();
    let records: Vec<Vec<u8>> = keys
        .iter()
        .map(|k| {
            (0..payload_bytes as usize)
                .map(|i| pattern_byte(k.layer, k.item, i))
                .collect()
        })
        .collect();
    let manifest = Manifest::single_tensor(StoreKind::Experts, Dtype::U8, payload_bytes, keys);
    let image = StoreWriterPlan::new(manifest)
        .and_then(|p| p.image(&records))
        .map_err(|e: FormatError| std::io::Error::other(e.to_string()))?;
    std::fs::write(path, image)
}

/// Write an expert store of `layers x experts` records of `payload_bytes`
/// pseudo-random bytes (seeded), with O_DIRECT where the file system allows,
/// so a benchmark reads fresh bytes that are not in the page cache.
/// `progress(bytes)` after each record. Memory: one record.
pub fn write_random_store(
    path: &Path,
    layers: u32,
    experts: u32,
    payload_bytes: u64,
    seed: u64,
    progress: &mut dyn FnMut(u64),
) -> Result<(), super::ExpertsError> {
    use flashtier_io::{AlignedBuf, DirectMode, StoreFile};
    let keys: Vec<RecordKey> = (0..layers)
        .flat_map(|l| (0..experts).map(move |e| RecordKey::new(l, e)))
        .collect();
    let count = keys.len();
    let manifest = Manifest::single_tensor(StoreKind::Experts, Dtype::U8, payload_bytes, keys);
    let plan = StoreWriterPlan::new(manifest)?;
    let file = StoreFile::open_rw(path, DirectMode::Prefer, true)?;
    file.set_len(0)?;
    let stride = plan.header().record_stride_bytes as usize;
    let mut buf = AlignedBuf::zeroed(stride);
    let mut state = seed | 1;
    let mut sums = Vec::with_capacity(count);
    for i in 0..count as u64 {
        for word in buf.as_full_mut().chunks_exact_mut(8) {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            word.copy_from_slice(&state.to_le_bytes());
        }
        // The stride is the payload rounded up to 4096, so these ranges are in bounds.
        let full = &mut buf.as_full_mut()[..stride];
        full[payload_bytes as usize..].fill(0);
        sums.push(
            plan.header()
                .checksum_algo
                .digest(&full[..payload_bytes as usize]),
        );
        let at = plan.record_offset(i).unwrap_or_default();
        file.write_all_at(full, at)?;
        progress(stride as u64);
    }
    // Tail and header lengths are multiples of 4096 (the format pads them).
    for (bytes, at) in [
        (plan.tail_bytes(&sums)?, plan.tail_offset()),
        (plan.header_bytes(&sums)?.to_vec(), 0),
    ] {
        let mut aligned = AlignedBuf::zeroed(bytes.len());
        aligned.copy_from_slice(&bytes);
        file.write_all_at(&aligned, at)?;
    }
    file.set_len(plan.file_len())?;
    file.sync_data()?;
    Ok(())
}
