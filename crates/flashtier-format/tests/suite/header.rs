//! Unit tests of the header encoding (moved out of src/ to keep files short).

use std::path::Path;

use flashtier_format::FormatError;
use flashtier_format::header::{HEADER_BYTES, Header, StoreKind};

use proptest::prelude::*;

fn path() -> &'static Path {
    Path::new("t.ftstore")
}

#[test]
fn plan_is_valid_and_round_trips() {
    let h = Header::plan(StoreKind::Experts, 10, 5000, 321).expect("plan");
    assert_eq!(h.record_stride_bytes, 8192);
    assert_eq!(h.checksum_table_offset, 4096 + 10 * 8192);
    assert_eq!(h.file_len % 4096, 0);
    let back = Header::decode(path(), &h.encode()).expect("decode");
    assert_eq!(back, h);
    assert_eq!(h.record_offset(9), Some(4096 + 9 * 8192));
    assert_eq!(h.record_offset(10), None);
}

#[test]
fn each_corruption_has_its_error() {
    let good = Header::plan(StoreKind::Rows, 3, 4096, 10)
        .expect("plan")
        .encode();
    let mut b = good;
    b[0] = b'X';
    assert!(matches!(
        Header::decode(path(), &b),
        Err(FormatError::BadMagic { .. })
    ));
    let mut b = good;
    b[8] = 2;
    assert!(matches!(
        Header::decode(path(), &b),
        Err(FormatError::UnknownVersion { found: 2, .. })
    ));
    let mut b = good;
    b[30] ^= 1;
    assert!(matches!(
        Header::decode(path(), &b),
        Err(FormatError::HeaderChecksum { .. })
    ));
    assert!(matches!(
        Header::decode(path(), &good[..100]),
        Err(FormatError::Truncated { .. })
    ));
}

#[test]
fn unaligned_stride_is_refused() {
    let mut h = Header::plan(StoreKind::Kv, 1, 100, 10).expect("plan");
    h.record_stride_bytes = 4095;
    assert!(matches!(
        Header::decode(path(), &h.encode()),
        Err(FormatError::UnalignedStride { stride: 4095, .. })
    ));
    h.record_stride_bytes = 0;
    assert!(matches!(
        Header::decode(path(), &h.encode()),
        Err(FormatError::UnalignedStride { stride: 0, .. })
    ));
}

#[test]
fn tables_past_the_file_are_refused() {
    let mut h = Header::plan(StoreKind::Experts, 2, 4096, 50).expect("plan");
    h.manifest_len = h.file_len;
    assert!(matches!(
        Header::decode(path(), &h.encode()),
        Err(FormatError::TableOverflow {
            table: "manifest",
            ..
        })
    ));
    let mut h = Header::plan(StoreKind::Experts, 2, 4096, 50).expect("plan");
    h.record_count = u64::MAX / 2;
    assert!(matches!(
        Header::decode(path(), &h.encode()),
        Err(FormatError::BadField {
            field: "record_count",
            ..
        })
    ));
}

#[test]
fn file_len_check_distinguishes_short_and_long() {
    let h = Header::plan(StoreKind::Experts, 1, 4096, 50).expect("plan");
    assert!(h.check_file_len(path(), h.file_len).is_ok());
    assert!(matches!(
        h.check_file_len(path(), h.file_len - 1),
        Err(FormatError::Truncated { .. })
    ));
    assert!(matches!(
        h.check_file_len(path(), h.file_len + 1),
        Err(FormatError::TrailingBytes { .. })
    ));
}

proptest! {
    #[test]
    fn planned_headers_round_trip(
        kind in prop_oneof![Just(StoreKind::Experts), Just(StoreKind::Rows), Just(StoreKind::Kv)],
        count in 0u64..1_000_000,
        payload in 1u64..(64 << 20),
        manifest_len in 1u64..(1 << 20),
        ct_sum in any::<u64>(),
        m_sum in any::<u64>(),
    ) {
        let mut h = Header::plan(kind, count, payload, manifest_len).expect("plan");
        h.checksum_table_checksum = ct_sum;
        h.manifest_checksum = m_sum;
        let bytes = h.encode();
        prop_assert_eq!(Header::decode(path(), &bytes).expect("decode"), h);
    }

    #[test]
    fn any_single_byte_flip_is_caught(at in 0usize..HEADER_BYTES, bit in 0u8..8) {
        let h = Header::plan(StoreKind::Experts, 7, 12345, 99).expect("plan");
        let mut bytes = h.encode();
        bytes[at] ^= 1 << bit;
        prop_assert!(Header::decode(path(), &bytes).is_err());
    }
}
