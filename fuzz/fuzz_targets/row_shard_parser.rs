//! Fuzz the packed row-shard parser: any bytes either decode into a header
//! whose every derived offset is consistent and whose rows all lie inside
//! the data area, or give a typed error. Never a panic, never a row placed
//! outside the file the header describes.
#![no_main]

use std::path::Path;

use flashtier_format::row_shard::{ROW_SHARD_BLOCK_BYTES, RowShardHeader};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
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
});
