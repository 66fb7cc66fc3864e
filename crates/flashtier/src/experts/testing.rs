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
