use proptest::prelude::*;

use super::*;
use crate::kv::header::{BlockEntry, KV_HEADER_BYTES, KvFormatError, KvHeader};

fn geom(layers: u32, blocks: u32, nkv: u32, tokens: u32, dim: u32, dtype: u32) -> KvGeometry {
    KvGeometry {
        num_layers: layers,
        num_blocks: blocks,
        num_kv_heads: nkv,
        block_tokens: tokens,
        head_dim: dim,
        dtype_bytes: dtype,
    }
}

fn any_layout() -> impl Strategy<Value = GroupLayout> {
    (
        1u32..5,
        1u32..9,
        1u32..5,
        1u32..33,
        1u32..257,
        prop::sample::select(vec![1u32, 2, 4]),
        any::<bool>(),
    )
        .prop_map(|(l, b, h, t, d, dt, major)| {
            let order = if major {
                BlockOrder::BlockMajor
            } else {
                BlockOrder::PerLayer
            };
            GroupLayout::new(geom(l, b, h, t, d, dt), order).expect("valid geometry")
        })
}

#[test]
fn llama_like_geometry() {
    let l = GroupLayout::new(geom(32, 1024, 8, 16, 128, 2), BlockOrder::PerLayer).expect("layout");
    assert_eq!(l.group_bytes(), 4096);
    assert_eq!(l.group_stride(), 4096);
    assert_eq!(l.block_bytes(), 64 * 1024);
    assert_eq!(l.table_extent().offset, 4096);
    assert_eq!(l.table_extent().len_bytes, 32 * 1024 * 16);
    assert_eq!(l.data_extent().offset, 4096 + 32 * 1024 * 16);
    let s = l.slot_strides();
    assert_eq!(
        (s.block, s.token, s.kv_head, l.slot_v_offset_bytes()),
        (32768, 128, 2048, 8 * 4096)
    );
    assert_eq!(s.slot_v_offset(8) * 2, l.slot_v_offset_bytes());
}

#[test]
fn bad_geometry_is_typed() {
    let e = GroupLayout::new(geom(0, 1, 1, 1, 1, 2), BlockOrder::PerLayer).unwrap_err();
    assert_eq!(
        e,
        KvFormatError::BadField {
            field: "num_layers",
            value: 0
        }
    );
    let e = GroupLayout::new(geom(1, 1, 1, 1, 1, 3), BlockOrder::PerLayer).unwrap_err();
    assert!(matches!(
        e,
        KvFormatError::BadField {
            field: "dtype_bytes",
            ..
        }
    ));
    let e = GroupLayout::new(
        geom(u32::MAX, u32::MAX, u32::MAX, u32::MAX, u32::MAX, 4),
        BlockOrder::PerLayer,
    )
    .unwrap_err();
    assert_eq!(e, KvFormatError::Overflow);
}

#[test]
fn out_of_range_ids_are_errors() {
    let l = GroupLayout::new(geom(2, 3, 2, 4, 8, 2), BlockOrder::BlockMajor).expect("layout");
    assert!(matches!(
        l.block_extent(BlockId::new(2, 0)),
        Err(KvFormatError::BlockOutOfRange { .. })
    ));
    assert!(matches!(
        l.block_extent(BlockId::new(0, 3)),
        Err(KvFormatError::BlockOutOfRange { .. })
    ));
    assert!(matches!(
        l.group_extent(GroupKey::new(0, 0, 2, KvKind::K)),
        Err(KvFormatError::HeadOutOfRange { .. })
    ));
    assert!(l.run_extent(BlockId::new(0, 2), 2).is_err());
    assert!(l.run_extent(BlockId::new(0, 0), 0).is_err());
    assert!(l.run_extent(BlockId::new(0, 1), u32::MAX).is_err());
}

#[test]
fn block_major_keeps_a_block_of_all_layers_together() {
    let l = GroupLayout::new(geom(4, 8, 2, 16, 64, 2), BlockOrder::BlockMajor).expect("layout");
    let first = l.block_extent(BlockId::new(0, 5)).expect("extent");
    for layer in 1..4 {
        let e = l.block_extent(BlockId::new(layer, 5)).expect("extent");
        assert_eq!(e.offset, first.offset + u64::from(layer) * l.block_bytes());
    }
    assert_eq!(l.run_extent(BlockId::new(1, 2), 3).expect("in range"), None);
    assert!(
        l.run_extent(BlockId::new(1, 2), 1)
            .expect("in range")
            .is_some()
    );
}

#[test]
fn header_roundtrip_and_corruption() {
    let layout =
        GroupLayout::new(geom(3, 7, 2, 16, 96, 2), BlockOrder::BlockMajor).expect("layout");
    let h = KvHeader {
        layout,
        model_hash: 0xfeed,
        rank: 3,
    };
    let bytes = h.encode();
    assert_eq!(bytes.len(), KV_HEADER_BYTES);
    assert_eq!(KvHeader::decode(&bytes), Ok(h));
    assert!(matches!(
        KvHeader::decode(&bytes[..50]),
        Err(KvFormatError::Truncated { .. })
    ));
    let mut bad = bytes.clone();
    bad[0] ^= 1;
    assert!(matches!(
        KvHeader::decode(&bad),
        Err(KvFormatError::BadMagic { .. })
    ));
    let mut bad = bytes.clone();
    bad[8] = 9;
    assert!(matches!(
        KvHeader::decode(&bad),
        Err(KvFormatError::BadVersion { found: 9, .. })
    ));
    for at in [12usize, 20, 44, 90, 100] {
        let mut bad = bytes.clone();
        bad[at] ^= 0x40;
        assert!(
            matches!(
                KvHeader::decode(&bad),
                Err(KvFormatError::HeaderChecksum { .. })
            ),
            "flip at {at}"
        );
    }
}

#[test]
fn checksum_binds_identity_and_generation() {
    let data = vec![5u8; 4096];
    let a = block_checksum(BlockId::new(1, 2), 7, &data);
    assert_ne!(a, block_checksum(BlockId::new(2, 1), 7, &data));
    assert_ne!(a, block_checksum(BlockId::new(1, 2), 6, &data));
    assert_ne!(a, block_checksum(BlockId::new(1, 3), 7, &data));
    assert_eq!(a, block_checksum(BlockId::new(1, 2), 7, &data));
    let e = BlockEntry {
        generation: 7,
        checksum: a,
    };
    assert_eq!(BlockEntry::decode(&e.encode()), e);
}

proptest! {
    #[test]
    fn blocks_tile_the_data_area(layout in any_layout()) {
        let g = layout.geometry();
        let mut seen = std::collections::BTreeSet::new();
        for layer in 0..g.num_layers {
            for block in 0..g.num_blocks {
                let id = BlockId::new(layer, block);
                let idx = layout.file_index(id).expect("in range");
                prop_assert_eq!(layout.block_at(idx).expect("in range"), id);
                let e = layout.block_extent(id).expect("in range");
                prop_assert_eq!(e.offset % PAGE_BYTES, 0);
                prop_assert_eq!(e.offset, layout.data_extent().offset + idx * layout.block_bytes());
                prop_assert!(seen.insert(idx));
                // Groups tile the block in [K heads.., V heads..] order.
                for kind in [KvKind::K, KvKind::V] {
                    for h in 0..g.num_kv_heads {
                        let ge = layout.group_extent(GroupKey::new(layer, block, h, kind)).expect("in range");
                        let gi = u64::from(layout.group_index(h, kind).expect("head"));
                        prop_assert_eq!(ge.offset, e.offset + gi * layout.group_stride());
                        prop_assert!(ge.offset + ge.len_bytes <= e.offset + e.len_bytes);
                    }
                }
            }
        }
        prop_assert_eq!(seen.len() as u64, layout.blocks_total());
        prop_assert!(layout.block_at(layout.blocks_total()).is_err());
        prop_assert_eq!(layout.file_len_bytes(), layout.data_extent().offset + layout.blocks_total() * layout.block_bytes());
    }

    #[test]
    fn runs_are_contiguous_exactly_when_promised(layout in any_layout(), layer in 0u32..5, first in 0u32..9, len in 1u32..9) {
        let g = layout.geometry();
        let res = layout.run_extent(BlockId::new(layer, first), len);
        if layer >= g.num_layers || first + len > g.num_blocks {
            prop_assert!(res.is_err());
        } else if let Some(run) = res.expect("in range") {
            prop_assert_eq!(run.len_bytes, u64::from(len) * layout.block_bytes());
            for i in 0..len {
                let e = layout.block_extent(BlockId::new(layer, first + i)).expect("in range");
                prop_assert_eq!(e.offset, run.offset + u64::from(i) * layout.block_bytes());
            }
        } else {
            prop_assert!(layout.order() == BlockOrder::BlockMajor && g.num_layers > 1 && len > 1);
        }
    }

    #[test]
    fn header_roundtrips(layout in any_layout(), model_hash in any::<u64>(), rank in any::<u32>()) {
        let h = KvHeader { layout, model_hash, rank };
        prop_assert_eq!(KvHeader::decode(&h.encode()), Ok(h));
    }

    #[test]
    fn decode_never_panics_on_damaged_headers(layout in any_layout(), flips in prop::collection::vec((0usize..200, any::<u8>()), 0..6), cut in 0usize..200) {
        let mut bytes = KvHeader { layout, model_hash: 1, rank: 0 }.encode();
        for (at, x) in flips {
            bytes[at] ^= x;
        }
        let damaged = &bytes[..cut.min(bytes.len())];
        // Either a typed error or a header whose every field re-derives.
        if let Ok(h) = KvHeader::decode(damaged) {
            prop_assert_eq!(KvHeader::decode(&h.encode()), Ok(h));
        }
        let _ = KvHeader::decode(&flips_free_noise(cut));
    }
}

fn flips_free_noise(n: usize) -> Vec<u8> {
    (0..n).map(|i| (i as u8).wrapping_mul(31)).collect()
}
