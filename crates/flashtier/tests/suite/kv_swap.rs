//! KvSwap: offload and pipelined restore, the coalesced and per-head paths
//! agree, failed restores are reported and never consumed, torn and stale
//! blocks are never restored as valid (fault injection through the sim
//! backend).

use std::path::Path;
use std::sync::Arc;

use flashtier::kv::attention::{AttentionDims, AttnState, KvTile, TileSeq};
use flashtier::kv::swap::{BlockVersion, KvError, KvSwap, SwapOptions};
use flashtier_format::kv::{BlockId, BlockOrder, GroupLayout, KvGeometry};
use flashtier_io::blocks::BlockPath;
use flashtier_io::sim::{Fault, FaultPlan, OpKind, SimBackend};
use flashtier_io::{AlignedBuf, PersistError, PosixBackend, StorageBackend};

fn layout(order: BlockOrder) -> GroupLayout {
    let g = KvGeometry {
        num_layers: 3,
        num_blocks: 6,
        num_kv_heads: 2,
        block_tokens: 16,
        head_dim: 64,
        dtype_bytes: 2,
    };
    GroupLayout::new(g, order).expect("layout")
}

/// A block image of finite BF16 values that depend on (id, salt).
fn block_image(l: &GroupLayout, id: BlockId, salt: u32) -> AlignedBuf {
    let mut b = AlignedBuf::zeroed(l.block_bytes() as usize);
    let mut x = id.layer.wrapping_mul(7919)
        ^ id.block.wrapping_mul(104_729)
        ^ salt.wrapping_mul(15_485_863)
        | 1;
    for pair in b.chunks_exact_mut(2) {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        let v = half::bf16::from_f32(((x % 2001) as f32 - 1000.0) / 500.0);
        pair.copy_from_slice(&v.to_bits().to_le_bytes());
    }
    b
}

fn opts(path: BlockPath) -> SwapOptions {
    SwapOptions {
        path,
        tile_slots: 6,
        ring_tiles: 2,
        ..SwapOptions::default()
    }
}

fn offload_all(swap: &mut KvSwap, salt: u32) -> Vec<BlockVersion> {
    let l = *swap.layout();
    let mut out = Vec::new();
    for layer in 0..3 {
        for block in 0..6 {
            let id = BlockId::new(layer, block);
            out.push(
                swap.offload_block(id, &block_image(&l, id, salt))
                    .expect("offload"),
            );
        }
    }
    out
}

/// Restore `tiles`, returning every consumed tile's bytes.
fn restore(swap: &mut KvSwap, tiles: &[Vec<BlockVersion>]) -> (Result<u64, KvError>, Vec<Vec<u8>>) {
    let mut seen = Vec::new();
    let r = swap.restore_tiles(tiles, |_, t| {
        seen.push(t.bytes().to_vec());
        Ok(())
    });
    (r.map(|s| s.read_ops), seen)
}

fn posix() -> Arc<dyn StorageBackend> {
    Arc::new(PosixBackend::new(4).expect("backend"))
}

fn new_swap(
    dir: &Path,
    order: BlockOrder,
    path: BlockPath,
    backend: Arc<dyn StorageBackend>,
) -> KvSwap {
    KvSwap::create(backend, &dir.join("kv.store"), layout(order), opts(path)).expect("create")
}

#[test]
fn restore_lands_exact_bytes_on_every_path() {
    for order in [BlockOrder::PerLayer, BlockOrder::BlockMajor] {
        let mut images = Vec::new();
        for path in [BlockPath::Coalesced, BlockPath::PerHead] {
            let dir = tempfile::tempdir().expect("dir");
            let mut swap = new_swap(dir.path(), order, path, posix());
            let v = offload_all(&mut swap, 1);
            // Tiles: one block of every layer (block-major: one op), then a
            // run of one layer (per-layer: one op).
            let col: Vec<BlockVersion> = (0..3).map(|ly| v[ly * 6 + 4]).collect();
            let run: Vec<BlockVersion> = v[6..12].to_vec();
            let (ops, seen) = restore(&mut swap, &[col.clone(), run.clone(), vec![v[0]]]);
            let ops = ops.expect("restore");
            let want_ops = match (path, order) {
                (BlockPath::Coalesced, BlockOrder::PerLayer) => 3 + 1 + 1,
                (BlockPath::Coalesced, BlockOrder::BlockMajor) => 1 + 6 + 1,
                (BlockPath::PerHead, _) => (3 + 6 + 1) * 4, // 2 * nkv group ops per block
            };
            assert_eq!(ops, want_ops, "{order} {path:?}");
            let l = *swap.layout();
            let expect: Vec<u8> = col
                .iter()
                .flat_map(|x| block_image(&l, x.id, 1).to_vec())
                .collect();
            assert!(seen[0] == expect, "{order} {path:?}: column tile bytes");
            let expect: Vec<u8> = run
                .iter()
                .flat_map(|x| block_image(&l, x.id, 1).to_vec())
                .collect();
            assert!(seen[1] == expect, "{order} {path:?}: run tile bytes");
            images.push((
                std::fs::read(dir.path().join("kv.store")).expect("image"),
                seen,
            ));
        }
        assert!(
            images[0] == images[1],
            "{order}: coalesced and per-head differ on disk or in memory"
        );
    }
}

#[test]
fn offload_run_matches_block_by_block_offload() {
    for order in [BlockOrder::PerLayer, BlockOrder::BlockMajor] {
        let dir = tempfile::tempdir().expect("dir");
        let mut swap = new_swap(dir.path(), order, BlockPath::Coalesced, posix());
        let l = *swap.layout();
        let bb = l.block_bytes() as usize;
        let mut src = AlignedBuf::zeroed(4 * bb);
        for i in 0..4u32 {
            src[i as usize * bb..(i as usize + 1) * bb].copy_from_slice(&block_image(
                &l,
                BlockId::new(2, 1 + i),
                3,
            ));
        }
        let versions = swap.offload_run(BlockId::new(2, 1), 4, &src).expect("run");
        let (r, seen) = restore(&mut swap, &[versions]);
        r.expect("restore");
        assert!(seen[0] == src[..]);
        // A span in file order (block-major: whole columns) as one write.
        let first = l.block_at(5).expect("in range");
        let ids: Vec<BlockId> = (5..9).map(|i| l.block_at(i).expect("in range")).collect();
        for (i, id) in ids.iter().enumerate() {
            src[i * bb..(i + 1) * bb].copy_from_slice(&block_image(&l, *id, 4));
        }
        let versions = swap.offload_span(first, 4, &src).expect("span");
        assert_eq!(versions.iter().map(|v| v.id).collect::<Vec<_>>(), ids);
        let (r, seen) = restore(&mut swap, &[versions]);
        assert_eq!(r.expect("restore"), 1, "one read for a span in file order");
        assert!(seen[0] == src[..]);
    }
}

#[test]
fn failed_restore_is_reported_and_never_consumed() {
    let dir = tempfile::tempdir().expect("dir");
    // Reads: tile 0 is one op (block-major column), tile 1 one op; fail the 2nd read.
    let sim = SimBackend::new(
        FaultPlan::seeded(42).fail_nth(OpKind::Read, 2, Fault::Eio),
        2,
    )
    .expect("sim");
    let mut swap = new_swap(
        dir.path(),
        BlockOrder::BlockMajor,
        BlockPath::Coalesced,
        Arc::new(sim),
    );
    let v = offload_all(&mut swap, 2);
    let tiles: Vec<Vec<BlockVersion>> = (0..4)
        .map(|b| (0..3).map(|ly| v[ly * 6 + b]).collect())
        .collect();
    let (r, seen) = restore(&mut swap, &tiles);
    match r {
        Err(KvError::Restore { tile: 1, source }) => {
            assert!(matches!(*source, KvError::Io(_)), "{source}")
        }
        other => panic!("expected tile 1 to fail, got {other:?}"),
    }
    assert_eq!(
        seen.len(),
        1,
        "only the tile before the failure is consumed"
    );
    // The pipeline drained: the swap restores again (tile 0 only, no fault now).
    let (r, seen) = restore(&mut swap, &tiles[..1]);
    r.expect("second restore");
    assert_eq!(seen.len(), 1);
}

#[test]
fn failed_read_on_the_per_head_path_is_reported() {
    let dir = tempfile::tempdir().expect("dir");
    let sim = SimBackend::new(
        FaultPlan::seeded(7).fail_nth(OpKind::Read, 3, Fault::Eio),
        2,
    )
    .expect("sim");
    let mut swap = new_swap(
        dir.path(),
        BlockOrder::PerLayer,
        BlockPath::PerHead,
        Arc::new(sim),
    );
    let v = offload_all(&mut swap, 2);
    let (r, seen) = restore(&mut swap, &[vec![v[0]], vec![v[1]]]);
    assert!(matches!(r, Err(KvError::Restore { tile: 0, .. })), "{r:?}");
    assert!(seen.is_empty());
}

#[test]
fn torn_write_is_never_restored_as_valid() {
    let dir = tempfile::tempdir().expect("dir");
    let mut swap = new_swap(
        dir.path(),
        BlockOrder::PerLayer,
        BlockPath::Coalesced,
        posix(),
    );
    let id = BlockId::new(1, 3);
    let l = *swap.layout();
    let v1 = swap
        .offload_block(id, &block_image(&l, id, 1))
        .expect("offload");
    swap.persist().expect("persist");
    drop(swap);
    // A second process tears its rewrite of the block (header write is op 1).
    let sim = SimBackend::new(
        FaultPlan::seeded(9).fail_nth(OpKind::Write, 1, Fault::Torn),
        1,
    )
    .expect("sim");
    let mut torn = KvSwap::open(
        Arc::new(sim),
        &dir.path().join("kv.store"),
        opts(BlockPath::Coalesced),
    )
    .expect("open");
    let err = torn
        .offload_block(id, &block_image(&l, id, 2))
        .expect_err("torn");
    assert!(matches!(err, KvError::Io(_)));
    // In that process the block is no longer resident.
    assert_eq!(torn.resident(id).expect("in range"), None);
    assert!(matches!(
        restore(&mut torn, &[vec![v1]]).0,
        Err(KvError::Restore { .. })
    ));
    drop(torn);
    // After a crash, the persisted table still claims v1, but the bytes are torn.
    let mut reopened = KvSwap::open(
        posix(),
        &dir.path().join("kv.store"),
        opts(BlockPath::Coalesced),
    )
    .expect("open");
    assert_eq!(reopened.resident(id).expect("in range"), Some(v1));
    let (r, seen) = restore(&mut reopened, &[vec![v1]]);
    match r {
        Err(KvError::Restore { source, .. }) => {
            assert!(matches!(*source, KvError::Corrupt { .. }), "{source}")
        }
        other => panic!("expected a checksum failure, got {other:?}"),
    }
    assert!(seen.is_empty());
}

#[test]
fn stale_and_missing_blocks_are_refused() {
    let dir = tempfile::tempdir().expect("dir");
    let mut swap = new_swap(
        dir.path(),
        BlockOrder::BlockMajor,
        BlockPath::Coalesced,
        posix(),
    );
    let l = *swap.layout();
    let id = BlockId::new(0, 0);
    let old = swap
        .offload_block(id, &block_image(&l, id, 1))
        .expect("offload");
    let new = swap
        .offload_block(id, &block_image(&l, id, 2))
        .expect("offload");
    let r = restore(&mut swap, &[vec![old]]).0;
    assert!(
        matches!(r, Err(KvError::Restore { ref source, .. }) if matches!(**source, KvError::Stale { .. })),
        "{r:?}"
    );
    restore(&mut swap, &[vec![new]])
        .0
        .expect("current generation restores");
    let never = BlockVersion {
        id: BlockId::new(2, 5),
        generation: 1,
    };
    let r = restore(&mut swap, &[vec![never]]).0;
    assert!(
        matches!(r, Err(KvError::Restore { ref source, .. }) if matches!(**source, KvError::NotResident { .. })),
        "{r:?}"
    );
    let outside = BlockVersion {
        id: BlockId::new(3, 0),
        generation: 1,
    };
    assert!(restore(&mut swap, &[vec![outside]]).0.is_err());
    let too_big = vec![new; 7];
    assert!(matches!(
        restore(&mut swap, &[too_big]).0,
        Err(KvError::Invalid(_))
    ));
}

#[test]
fn reopen_checks_owner_and_header() {
    let dir = tempfile::tempdir().expect("dir");
    let p = dir.path().join("kv.store");
    let o = SwapOptions {
        model_hash: 77,
        rank: 1,
        ..opts(BlockPath::Coalesced)
    };
    KvSwap::create(posix(), &p, layout(BlockOrder::PerLayer), o).expect("create");
    assert!(KvSwap::open(posix(), &p, o).is_ok());
    let other = SwapOptions { rank: 2, ..o };
    assert!(matches!(
        KvSwap::open(posix(), &p, other),
        Err(KvError::WrongOwner { .. })
    ));
    let mut bytes = std::fs::read(&p).expect("read");
    bytes[17] ^= 1;
    std::fs::write(&p, &bytes).expect("write");
    assert!(matches!(
        KvSwap::open(posix(), &p, o),
        Err(KvError::Format { .. })
    ));
}

/// `create` used to truncate whatever was at its path. Now it replaces only
/// a KV store of the same layout and owner (dropping its blocks), refuses
/// anything else and leaves it byte for byte, and leaves no temp file.
#[test]
fn create_replaces_only_a_kv_store_of_the_same_layout_and_owner() {
    let dir = tempfile::tempdir().expect("dir");
    let p = dir.path().join("kv.store");
    let o = opts(BlockPath::Coalesced);
    let names = || {
        let mut n: Vec<String> = std::fs::read_dir(dir.path())
            .expect("ls")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .collect();
        n.sort();
        n
    };
    // Someone else's file is refused and left alone.
    std::fs::write(&p, b"my notes, not a KV store").expect("write");
    let err = KvSwap::create(posix(), &p, layout(BlockOrder::PerLayer), o).expect_err("notes");
    assert!(
        matches!(err, KvError::Persist(PersistError::NotReplaceable { .. })),
        "{err}"
    );
    assert_eq!(
        std::fs::read(&p).expect("read"),
        b"my notes, not a KV store"
    );
    assert_eq!(names(), ["kv.store"]);
    std::fs::remove_file(&p).expect("rm");

    // A store of this layout and owner is replaced by an empty one.
    let mut swap = KvSwap::create(posix(), &p, layout(BlockOrder::PerLayer), o).expect("create");
    let v = offload_all(&mut swap, 1);
    swap.persist().expect("persist");
    drop(swap);
    let swap = KvSwap::create(posix(), &p, layout(BlockOrder::PerLayer), o).expect("recreate");
    assert_eq!(swap.resident(v[0].id).expect("resident"), None);
    drop(swap);
    assert!(KvSwap::open(posix(), &p, o).is_ok());
    assert_eq!(names(), ["kv.store"]);

    // Another block order, another rank: refused, the store kept intact.
    let before = std::fs::read(&p).expect("read");
    let other_rank = SwapOptions { rank: 3, ..o };
    for (l, o2) in [
        (layout(BlockOrder::BlockMajor), o),
        (layout(BlockOrder::PerLayer), other_rank),
    ] {
        let err = KvSwap::create(posix(), &p, l, o2).expect_err("another store");
        let msg = err.to_string();
        assert!(
            matches!(err, KvError::Persist(PersistError::NotReplaceable { .. }))
                && msg.contains("it is a KV store of 3 layers x 6 blocks")
                && msg.contains("per-layer, model 0x0 rank 0"),
            "{msg}"
        );
    }
    assert_eq!(std::fs::read(&p).expect("read"), before);
    assert_eq!(names(), ["kv.store"]);
}

#[test]
fn attention_over_landed_slots_equals_attention_in_memory() {
    let dir = tempfile::tempdir().expect("dir");
    let mut swap = new_swap(
        dir.path(),
        BlockOrder::PerLayer,
        BlockPath::Coalesced,
        posix(),
    );
    let v = offload_all(&mut swap, 5);
    let l = *swap.layout();
    let dims = AttentionDims::new(1, 4, 2, 64, 16);
    let q: Vec<f32> = (0..4 * 64)
        .map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0)
        .collect();
    let seqs = [TileSeq {
        blocks: &[0, 1, 2],
        last_block_tokens: 9,
    }];
    let mut from_disk = AttnState::new(dims).expect("dims");
    from_disk.begin_step(1).expect("step");
    swap.restore_tiles(&[v[6..9].to_vec()], |_, t| {
        from_disk
            .step_tile(&q, &t.kv_tile(&seqs))
            .map_err(|e| KvError::Consumer {
                tile: 0,
                what: e.to_string(),
            })
    })
    .expect("restore");
    // The same blocks straight from memory, slot layout with padded groups.
    let mem: Vec<u8> = v[6..9]
        .iter()
        .flat_map(|x| block_image(&l, x.id, 5).to_vec())
        .collect();
    let strides = l.slot_strides();
    let mut in_mem = AttnState::new(dims).expect("dims");
    in_mem.begin_step(1).expect("step");
    in_mem
        .step_tile(
            &q,
            &KvTile {
                k: &mem,
                v: &mem[l.slot_v_offset_bytes()..],
                strides,
                seqs: &seqs,
            },
        )
        .expect("tile");
    let (mut a, mut b) = (vec![0.0f32; 256], vec![0.0f32; 256]);
    from_disk.finalize_f32(&mut a).expect("fin");
    in_mem.finalize_f32(&mut b).expect("fin");
    assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()));
}

/// A live store is its holder's alone: a second `open` or `create` of the
/// same path (here from this process; another process gets the same `flock`
/// refusal) fails at once with `InUse` instead of writing beside it, and
/// works again once the holder is dropped.
#[test]
fn a_live_store_is_not_opened_or_replaced_by_a_second_writer() {
    let dir = tempfile::tempdir().expect("dir");
    let p = dir.path().join("kv.store");
    let o = opts(BlockPath::Coalesced);
    let l = layout(BlockOrder::PerLayer);
    let held = KvSwap::create(posix(), &p, l, o).expect("create");
    let before = std::fs::read(&p).expect("read");
    for second in [
        KvSwap::open(posix(), &p, o),
        KvSwap::create(posix(), &p, l, o),
    ] {
        match second {
            Err(KvError::Io(flashtier_io::IoError::InUse { path })) => assert_eq!(path, p),
            Err(other) => panic!("expected InUse, got {other}"),
            Ok(_) => panic!("a second writer got the live store"),
        }
    }
    assert_eq!(
        std::fs::read(&p).expect("read"),
        before,
        "the live store was rewritten"
    );
    drop(held);
    let reopened = KvSwap::open(posix(), &p, o).expect("open after the holder is gone");
    drop(reopened);
    KvSwap::create(posix(), &p, l, o).expect("create after the holder is gone");
}

/// Restores land in a region the caller hands over (the GPU engine's
/// pinned memory), blocks of any element width come back through
/// `restore_blocks`, and `restore_tiles` (BF16 attention) refuses f32; a
/// region too small for the ring is refused at creation.
#[test]
fn restores_land_in_a_given_region_at_any_width() {
    let g = KvGeometry {
        num_layers: 2,
        num_blocks: 4,
        num_kv_heads: 1,
        block_tokens: 256,
        head_dim: 4,
        dtype_bytes: 4,
    };
    let l = GroupLayout::new(g, BlockOrder::PerLayer).expect("layout");
    let bb = l.block_bytes() as usize;
    let o = SwapOptions {
        tile_slots: 2,
        ring_tiles: 2,
        ..SwapOptions::default()
    };
    let dir = tempfile::tempdir().expect("dir");
    let small = flashtier_io::LandingRegion::host(3 * bb);
    let err = KvSwap::create_in(posix(), &dir.path().join("a.store"), l, o, Some(small));
    assert!(err.is_err(), "a region of 3 blocks for a ring of 4");
    let region = flashtier_io::LandingRegion::host(4 * bb);
    let mut swap = KvSwap::create_in(posix(), &dir.path().join("b.store"), l, o, Some(region))
        .expect("create in a region");
    let mut v = Vec::new();
    for block in 0..4 {
        let id = BlockId::new(1, block);
        let mut img = AlignedBuf::zeroed(bb);
        img.fill(block as u8 + 1);
        v.push(swap.offload_block(id, &img).expect("offload"));
    }
    let tiles = vec![v[0..2].to_vec(), v[2..3].to_vec(), v[3..4].to_vec()];
    assert!(matches!(
        swap.restore_tiles(&tiles, |_, _| Ok(())),
        Err(KvError::Invalid(_))
    ));
    let mut seen = Vec::new();
    let st = swap
        .restore_blocks(&tiles, |i, t| {
            seen.push((i, t.bytes().to_vec()));
            Ok(())
        })
        .expect("restore f32 blocks");
    assert_eq!((st.tiles, st.blocks), (3, 4));
    let flat: Vec<u8> = seen.iter().flat_map(|(_, b)| b.clone()).collect();
    let want: Vec<u8> = (0..4u8).flat_map(|b| vec![b + 1; bb]).collect();
    assert!(flat == want, "restored bytes differ");
}
