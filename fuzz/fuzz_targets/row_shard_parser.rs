//! Fuzz the packed row-shard parser: any bytes either decode into a header
//! whose every derived offset is consistent and whose rows all lie inside
//! the data area, or give a typed error. Never a panic, never a row placed
//! outside the file the header describes.
#![no_main]

use std::path::Path;

use flashtier_format::row_shard::{
    ROW_SHARD_BLOCK_BYTES, ROW_SHARD_HEADER_BYTES, ROW_SHARD_MAGIC, ROW_SHARD_VERSION,
    RowShardHeader,
};
use flashtier_format::xxh3_64;
use libfuzzer_sys::fuzz_target;

/// Bytes of the header the stored checksum covers, and where it sits.
const CHECKED: usize = 104;

fuzz_target!(|data: &[u8]| {
    check(data);
    // The same bytes with a valid magic, version, size and header checksum,
    // so the fuzzer reaches the field checks behind them.
    let mut fixed = data.to_vec();
    fixed.resize(fixed.len().max(ROW_SHARD_HEADER_BYTES as usize), 0);
    fixed[..8].copy_from_slice(&ROW_SHARD_MAGIC);
    fixed[8..12].copy_from_slice(&ROW_SHARD_VERSION.to_le_bytes());
    fixed[12..16].copy_from_slice(&ROW_SHARD_HEADER_BYTES.to_le_bytes());
    let sum = xxh3_64(&fixed[..CHECKED]);
    fixed[CHECKED..CHECKED + 8].copy_from_slice(&sum.to_le_bytes());
    check(&fixed);
});

fn check(data: &[u8]) {
    let path = Path::new("fuzz.rows");
    let Ok(h) = RowShardHeader::decode(path, data) else {
        return;
    };
    // The length check and the checksum table accept or refuse, never panic.
    let _ = h.check_len(path, data.len() as u64);
    let table_at = usize::try_from(h.checksum_offset()).unwrap_or(usize::MAX);
    if let Some(table) = data.get(table_at..) {
        if let Ok(sums) = h.decode_checksums(path, table) {
            assert_eq!(sums.len() as u64, h.block_count());
        }
    }
    // Every owned row sits inside a block of the data area, and no row
    // outside [lo, hi) is placed at all.
    assert!(h.lo <= h.hi && h.hi <= h.rows);
    let stride = u64::from(h.row_stride());
    let probes = [
        h.lo,
        h.lo.saturating_add(1),
        h.hi.saturating_sub(1),
        h.lo / 2 + h.hi / 2,
    ];
    for id in probes {
        match h.locate(id) {
            Some(loc) => {
                assert!(id >= h.lo && id < h.hi);
                assert!(loc.block < h.block_count());
                assert!(loc.in_block as u64 + stride <= u64::from(ROW_SHARD_BLOCK_BYTES));
                assert!(loc.block_offset >= h.data_offset());
                assert!(loc.block_offset + u64::from(ROW_SHARD_BLOCK_BYTES) <= h.checksum_offset());
            }
            None => assert!(id < h.lo || id >= h.hi),
        }
    }
    assert!(h.locate(h.hi).is_none());
}
