//! Fuzz the KV store header and block-table parsers: any bytes either decode
//! into a layout whose extents all lie inside the file it describes, or give
//! a typed error. Never a panic.
#![no_main]

use flashtier_format::kv::{
    BlockEntry, BlockId, KV_HEADER_BYTES, KV_MAGIC, KV_TABLE_ENTRY_BYTES, KV_VERSION, KvHeader,
};
use flashtier_format::xxh3_64;
use libfuzzer_sys::fuzz_target;

/// Bytes of the header the stored checksum covers, and where it sits.
const CHECKED: usize = 104;

fuzz_target!(|data: &[u8]| {
    check(data);
    // The same bytes with a valid magic, version and header checksum, so
    // the fuzzer reaches the geometry checks behind them.
    let mut fixed = data.to_vec();
    fixed.resize(fixed.len().clamp(CHECKED + 8, KV_HEADER_BYTES), 0);
    fixed[..8].copy_from_slice(&KV_MAGIC);
    fixed[8..12].copy_from_slice(&KV_VERSION.to_le_bytes());
    let sum = xxh3_64(&fixed[..CHECKED]);
    fixed[CHECKED..CHECKED + 8].copy_from_slice(&sum.to_le_bytes());
    check(&fixed);
});

fn check(data: &[u8]) {
    // Table entries decode from any bytes (short input reads as zeros).
    for chunk in data.chunks(KV_TABLE_ENTRY_BYTES).take(64) {
        let e = BlockEntry::decode(chunk);
        if chunk.len() == KV_TABLE_ENTRY_BYTES {
            assert_eq!(&e.encode()[..], chunk);
        }
    }
    let Ok(h) = KvHeader::decode(data) else {
        return;
    };
    // A header that decodes re-encodes to the bytes it came from.
    let again = h.encode();
    assert_eq!(KvHeader::decode(&again).ok(), Some(h));
    let l = h.layout;
    let g = l.geometry();
    let file = l.file_len_bytes();
    let table = l.table_extent();
    let area = l.data_extent();
    assert!(table.offset + table.len_bytes <= area.offset);
    assert!(area.offset + area.len_bytes <= file);
    // Blocks at the corners of the geometry lie inside the data area;
    // one past the end is refused.
    let (nl, nb) = (g.num_layers, g.num_blocks);
    for (layer, block) in [
        (0, 0),
        (nl.saturating_sub(1), nb.saturating_sub(1)),
        (nl / 2, nb / 2),
    ] {
        let id = BlockId::new(layer, block);
        if let Ok(x) = l.block_extent(id) {
            assert!(x.offset >= area.offset);
            assert!(x.offset + x.len_bytes <= area.offset + area.len_bytes);
            let idx = l.file_index(id).expect("a placed block has a file index");
            assert_eq!(l.block_at(idx).ok(), Some(id));
        }
    }
    assert!(l.block_extent(BlockId::new(nl, 0)).is_err());
    assert!(l.block_extent(BlockId::new(0, nb)).is_err());
}
