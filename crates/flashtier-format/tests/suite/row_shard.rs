//! The packed row-shard header: round trips, every single-byte corruption,
//! mismatches naming their field, geometry bounds, checksum table and block
//! checks, and proptest invariants of the decoder and the row locator.

use std::path::Path;

use flashtier_format::row_shard::{
    RowShardError, RowShardHeader, block_checksum, checksums_digest, encode_checksums,
};
use proptest::prelude::*;

fn p() -> &'static Path {
    Path::new("t.rows")
}

#[test]
fn engram_geometry() {
    let h = RowShardHeader::new(3, 100, 1100, 5000, 256, 8).expect("valid");
    assert_eq!(h.row_stride(), 264);
    assert_eq!(h.rows_per_block, 15);
    assert_eq!(h.block_count(), 67);
    let loc = h.locate(100 + 16).expect("owned");
    assert_eq!(loc.block, 1);
    assert_eq!(loc.block_offset, 8192);
    assert_eq!(loc.in_block, 264);
    assert!(h.locate(99).is_none() && h.locate(1100).is_none());
}

#[test]
fn round_trip_and_every_corruption() {
    let mut h = RowShardHeader::new(1, 0, 10, 20, 256, 8).expect("valid");
    h.checksums_xxh3 = 42;
    let b = h.encode();
    assert_eq!(RowShardHeader::decode(p(), &b).expect("decodes"), h);
    // Any single flipped byte in the checked range is caught.
    for i in 0..112 {
        let mut c = b.clone();
        c[i] ^= 0x40;
        assert!(RowShardHeader::decode(p(), &c).is_err(), "byte {i}");
    }
    assert!(matches!(
        RowShardHeader::decode(p(), &b[..100]),
        Err(RowShardError::TooShort { .. })
    ));
}

#[test]
fn mismatch_names_the_field() {
    let h = RowShardHeader::new(1, 0, 10, 20, 256, 8).expect("valid");
    let other = RowShardHeader::new(2, 0, 10, 20, 256, 8).expect("valid");
    let e = h.expect(p(), &other).expect_err("layer differs");
    assert!(matches!(
        e,
        RowShardError::Mismatch {
            field: "layer",
            expected: 2,
            found: 1,
            ..
        }
    ));
    let other = RowShardHeader::new(1, 10, 20, 20, 256, 8).expect("valid");
    let e = h.expect(p(), &other).expect_err("range differs");
    assert!(e.to_string().contains("`lo`"), "{e}");
}

#[test]
fn bad_geometry_rejected() {
    assert!(RowShardHeader::new(0, 5, 4, 10, 256, 8).is_err());
    assert!(RowShardHeader::new(0, 0, 11, 10, 256, 8).is_err());
    assert!(RowShardHeader::new(0, 0, 1, 10, 4096, 8).is_err());
    assert!(RowShardHeader::new(0, 0, 1, 10, 0, 8).is_err());
}

#[test]
fn checksum_table_and_blocks() {
    let mut h = RowShardHeader::new(0, 0, 31, 31, 256, 8).expect("valid");
    let blocks: Vec<Vec<u8>> = (0..h.block_count()).map(|i| vec![i as u8; 4096]).collect();
    let sums: Vec<u64> = blocks.iter().map(|b| block_checksum(b)).collect();
    h.checksums_xxh3 = checksums_digest(&sums);
    let table = encode_checksums(&sums);
    assert_eq!(table.len() as u64, h.checksum_region_bytes());
    assert_eq!(h.decode_checksums(p(), &table).expect("valid"), sums);
    let mut bad = table.clone();
    bad[3] ^= 1;
    assert!(matches!(
        h.decode_checksums(p(), &bad),
        Err(RowShardError::ChecksumTable { .. })
    ));
    h.verify_block(p(), 1, &blocks[1], sums[1])
        .expect("good block");
    let mut torn = blocks[1].clone();
    torn[4000] ^= 1;
    assert!(matches!(
        h.verify_block(p(), 1, &torn, sums[1]),
        Err(RowShardError::BlockChecksum {
            block: 1,
            offset: 8192,
            ..
        })
    ));
    assert!(h.check_len(p(), h.file_bytes() - 1).is_err());
    h.check_len(p(), h.file_bytes()).expect("exact length");
}

proptest! {
    #[test]
    fn decode_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..5000)) {
        let _ = RowShardHeader::decode(p(), &bytes);
    }

    #[test]
    fn locate_stays_in_its_block(lo in 0u64..1000, n in 1u64..5000, w in 1u32..600, s in 0u32..64, k in 0u64..5000) {
        let hi = lo + n;
        let h = RowShardHeader::new(0, lo, hi, hi + 3, w, s).expect("valid");
        let id = lo + k % n;
        let loc = h.locate(id).expect("owned");
        prop_assert!(loc.in_block + h.row_stride() as usize <= 4096);
        prop_assert!(loc.block < h.block_count());
        prop_assert!(loc.block_offset + 4096 <= h.checksum_offset());
    }
}
