//! Block-granular KV I/O: the coalesced and per-head paths give identical
//! bytes on disk and in memory, runs coalesce exactly when the layout allows,
//! and a slot whose read did not land is never served.

use std::sync::{Arc, Mutex};

use flashtier_format::kv::{BlockId, BlockOrder, GroupLayout, KvGeometry};
use flashtier_io::blocks::{
    BlockPath, BlockSpan, SlotPool, SlotState, expand_block_to_groups, write_block,
    write_blocks_run, write_span,
};
use flashtier_io::{DirectMode, IoError, PosixBackend, ReadReq, StorageBackend, StoreFile, Ticket};
use proptest::prelude::*;

/// A real posix backend that also logs every op it is given (offset, len).
struct Logged {
    inner: PosixBackend,
    writes: Mutex<Vec<(u64, usize)>>,
    reads: Mutex<Vec<(u64, usize)>>,
}

impl Logged {
    fn new() -> Self {
        Self {
            inner: PosixBackend::new(4).expect("backend"),
            writes: Mutex::new(Vec::new()),
            reads: Mutex::new(Vec::new()),
        }
    }
    fn take_writes(&self) -> Vec<(u64, usize)> {
        std::mem::take(&mut *self.writes.lock().expect("lock"))
    }
    fn take_reads(&self) -> Vec<(u64, usize)> {
        std::mem::take(&mut *self.reads.lock().expect("lock"))
    }
}

impl StorageBackend for Logged {
    fn name(&self) -> &'static str {
        "logged-posix"
    }
    fn queue_depth(&self) -> usize {
        self.inner.queue_depth()
    }
    fn read_async(&self, reqs: Vec<ReadReq>) -> Result<Ticket, IoError> {
        self.reads
            .lock()
            .expect("lock")
            .extend(reqs.iter().map(|r| (r.offset, r.len)));
        self.inner.read_async(reqs)
    }
    fn write(&self, file: &StoreFile, offset: u64, src: &[u8]) -> Result<(), IoError> {
        self.writes.lock().expect("lock").push((offset, src.len()));
        self.inner.write(file, offset, src)
    }
}

fn layout(order: BlockOrder, layers: u32, blocks: u32, nkv: u32, dim: u32) -> GroupLayout {
    let g = KvGeometry {
        num_layers: layers,
        num_blocks: blocks,
        num_kv_heads: nkv,
        block_tokens: 16,
        head_dim: dim,
        dtype_bytes: 2,
    };
    GroupLayout::new(g, order).expect("layout")
}

fn store(dir: &tempfile::TempDir, name: &str, l: &GroupLayout) -> Arc<StoreFile> {
    let f = StoreFile::open_rw(&dir.path().join(name), DirectMode::Prefer, true).expect("open");
    f.set_len(l.file_len_bytes()).expect("size");
    f
}

fn pattern(id: BlockId, len: usize, salt: u64) -> flashtier_io::AlignedBuf {
    let mut b = flashtier_io::AlignedBuf::zeroed(len);
    let mut x = (u64::from(id.layer) << 32 | u64::from(id.block)) ^ salt ^ 0x9E37_79B9_7F4A_7C15;
    for byte in b.iter_mut() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *byte = x as u8;
    }
    b
}

fn file_bytes(f: &StoreFile) -> Vec<u8> {
    std::fs::read(f.path()).expect("read back")
}

fn all_blocks(l: &GroupLayout) -> Vec<BlockId> {
    let g = l.geometry();
    (0..g.num_layers)
        .flat_map(|ly| (0..g.num_blocks).map(move |b| BlockId::new(ly, b)))
        .collect()
}

/// Write every block through `path`, read every block back through `path`,
/// return (file image, landed bytes of every slot in block order).
fn roundtrip(l: &GroupLayout, path: BlockPath, salt: u64) -> (Vec<u8>, Vec<u8>, usize, usize) {
    let dir = tempfile::tempdir().expect("dir");
    let f = store(&dir, "kv.bin", l);
    let be = Logged::new();
    let bb = l.block_bytes() as usize;
    for id in all_blocks(l) {
        write_block(&be, &f, l, id, &pattern(id, bb, salt), path).expect("write");
    }
    let writes = be.take_writes().len();
    let blocks = all_blocks(l);
    let mut pool = SlotPool::new(bb, blocks.len()).expect("pool");
    let spans: Vec<BlockSpan> = blocks
        .iter()
        .enumerate()
        .map(|(s, &first)| BlockSpan {
            first,
            count: 1,
            slot: s,
        })
        .collect();
    let batch = pool.submit(&be, &f, l, &spans, path).expect("submit");
    pool.wait(batch).expect("landed");
    let reads = be.take_reads().len();
    (
        file_bytes(&f),
        pool.landed(0, blocks.len()).expect("landed").to_vec(),
        writes,
        reads,
    )
}

#[test]
fn coalesced_and_per_head_are_byte_identical() {
    for order in [BlockOrder::PerLayer, BlockOrder::BlockMajor] {
        let l = layout(order, 3, 4, 2, 64);
        let (disk_c, mem_c, wc, rc) = roundtrip(&l, BlockPath::Coalesced, 1);
        let (disk_h, mem_h, wh, rh) = roundtrip(&l, BlockPath::PerHead, 1);
        assert!(disk_c == disk_h, "{order}: on-disk images differ");
        assert!(mem_c == mem_h, "{order}: landed bytes differ");
        let n = all_blocks(&l).len();
        assert_eq!((wc, rc), (n, n), "coalesced: one op per block");
        assert_eq!((wh, rh), (n * 4, n * 4), "per head: 2 * nkv ops per block");
        // And the landed bytes are what was written.
        let bb = l.block_bytes() as usize;
        for (i, id) in all_blocks(&l).into_iter().enumerate() {
            assert!(mem_c[i * bb..(i + 1) * bb] == pattern(id, bb, 1)[..]);
        }
    }
}

#[test]
fn fan_out_covers_each_block_once_in_head_order() {
    let l = layout(BlockOrder::BlockMajor, 2, 3, 3, 32);
    let ops = expand_block_to_groups(&l, BlockId::new(1, 2)).expect("ops");
    assert_eq!(ops.len(), 6);
    let ext = l.block_extent(BlockId::new(1, 2)).expect("extent");
    let mut covered: Vec<(usize, usize)> = ops.iter().map(|o| (o.block_offset, o.len)).collect();
    covered.sort_unstable();
    let mut at = 0;
    for (off, len) in covered {
        assert_eq!(off, at);
        at += len;
    }
    assert_eq!(at as u64, l.block_bytes());
    for o in &ops {
        assert_eq!(o.file_offset, ext.offset + o.block_offset as u64);
    }
    assert_eq!((ops[0].key.kv_head, ops[1].key.kv_head), (0, 0));
    assert!(expand_block_to_groups(&l, BlockId::new(2, 0)).is_err());
}

#[test]
fn runs_coalesce_only_where_contiguous() {
    for order in [BlockOrder::PerLayer, BlockOrder::BlockMajor] {
        let l = layout(order, 2, 6, 2, 64);
        let bb = l.block_bytes() as usize;
        let dir = tempfile::tempdir().expect("dir");
        let (fa, fb) = (store(&dir, "a", &l), store(&dir, "b", &l));
        let be = Logged::new();
        let first = BlockId::new(1, 2);
        let mut src = flashtier_io::AlignedBuf::zeroed(3 * bb);
        for i in 0..3u32 {
            let id = BlockId::new(1, 2 + i);
            src[i as usize * bb..(i as usize + 1) * bb].copy_from_slice(&pattern(id, bb, 5));
        }
        let ops =
            write_blocks_run(&be, &fa, &l, first, 3, &src, BlockPath::Coalesced).expect("run");
        let run_ops = be.take_writes();
        for i in 0..3u32 {
            let id = BlockId::new(1, 2 + i);
            write_block(&be, &fb, &l, id, &pattern(id, bb, 5), BlockPath::Coalesced)
                .expect("write");
        }
        let block_ops = be.take_writes();
        assert!(
            file_bytes(&fa) == file_bytes(&fb),
            "{order}: run image differs"
        );
        match order {
            BlockOrder::PerLayer => assert_eq!((ops, run_ops.len()), (1, 1)),
            BlockOrder::BlockMajor => {
                assert_eq!((ops, &run_ops), (3, &block_ops), "op-for-op identical")
            }
        }
        // The per-head run is op-for-op the per-head blocks.
        write_blocks_run(&be, &fa, &l, first, 3, &src, BlockPath::PerHead).expect("run");
        let head_run = be.take_writes();
        for i in 0..3u32 {
            let id = BlockId::new(1, 2 + i);
            write_block(&be, &fb, &l, id, &pattern(id, bb, 5), BlockPath::PerHead).expect("write");
        }
        assert_eq!(head_run, be.take_writes());
        assert!(
            write_blocks_run(
                &be,
                &fa,
                &l,
                BlockId::new(1, 4),
                3,
                &src,
                BlockPath::Coalesced
            )
            .is_err()
        );
        assert!(write_blocks_run(&be, &fa, &l, first, 2, &src, BlockPath::Coalesced).is_err());
    }
}

#[test]
fn spans_write_one_op_and_match_the_per_head_image() {
    for order in [BlockOrder::PerLayer, BlockOrder::BlockMajor] {
        let l = layout(order, 3, 4, 2, 64);
        let bb = l.block_bytes() as usize;
        let dir = tempfile::tempdir().expect("dir");
        let (fa, fb) = (store(&dir, "a", &l), store(&dir, "b", &l));
        let be = Logged::new();
        // Five blocks in file order from position 2.
        let first = l.block_at(2).expect("in range");
        let mut src = flashtier_io::AlignedBuf::zeroed(5 * bb);
        for i in 0..5u64 {
            let id = l.block_at(2 + i).expect("in range");
            src[i as usize * bb..(i as usize + 1) * bb].copy_from_slice(&pattern(id, bb, 3));
        }
        assert_eq!(
            write_span(&be, &fa, &l, first, 5, &src, BlockPath::Coalesced).expect("span"),
            1
        );
        assert_eq!(be.take_writes().len(), 1);
        assert_eq!(
            write_span(&be, &fb, &l, first, 5, &src, BlockPath::PerHead).expect("span"),
            20
        );
        assert_eq!(be.take_writes().len(), 20);
        assert!(file_bytes(&fa) == file_bytes(&fb), "{order}");
        let end = l.block_at(l.blocks_total() - 2).expect("in range");
        assert!(write_span(&be, &fa, &l, end, 5, &src, BlockPath::Coalesced).is_err());
        assert!(write_span(&be, &fa, &l, first, 4, &src, BlockPath::Coalesced).is_err());
    }
}

#[test]
fn block_major_span_reads_all_layers_in_one_op() {
    let l = layout(BlockOrder::BlockMajor, 4, 3, 2, 64);
    let bb = l.block_bytes() as usize;
    let dir = tempfile::tempdir().expect("dir");
    let f = store(&dir, "kv", &l);
    let be = Logged::new();
    for id in all_blocks(&l) {
        write_block(&be, &f, &l, id, &pattern(id, bb, 9), BlockPath::Coalesced).expect("write");
    }
    let mut pool = SlotPool::new(bb, 4).expect("pool");
    let span = BlockSpan {
        first: BlockId::new(0, 1),
        count: 4,
        slot: 0,
    };
    let batch = pool
        .submit(&be, &f, &l, &[span], BlockPath::Coalesced)
        .expect("submit");
    pool.wait(batch).expect("landed");
    assert_eq!(
        be.take_reads(),
        vec![(
            l.block_extent(BlockId::new(0, 1)).expect("e").offset,
            4 * bb
        )]
    );
    for layer in 0..4u32 {
        let got = pool.landed(layer as usize, 1).expect("landed");
        assert!(got == &pattern(BlockId::new(layer, 1), bb, 9)[..]);
    }
}

#[test]
fn unlanded_slots_are_never_served() {
    let l = layout(BlockOrder::PerLayer, 1, 4, 1, 64);
    let bb = l.block_bytes() as usize;
    let dir = tempfile::tempdir().expect("dir");
    let f = store(&dir, "kv", &l);
    // Cut the file inside block 3: its read fails with a short read.
    f.set_len(l.block_extent(BlockId::new(0, 3)).expect("e").offset + 4096)
        .expect("truncate");
    let be = PosixBackend::new(2).expect("backend");
    let mut pool = SlotPool::new(bb, 4).expect("pool");
    assert!(pool.landed(0, 1).is_err(), "fresh slots are not landed");
    let spans: Vec<BlockSpan> = (0..4)
        .map(|b| BlockSpan {
            first: BlockId::new(0, b),
            count: 1,
            slot: b as usize,
        })
        .collect();
    let batch = pool
        .submit(&be, &f, &l, &spans, BlockPath::Coalesced)
        .expect("submit");
    assert!(matches!(pool.state(0), Ok(SlotState::InFlight(_))));
    let err = pool.wait(batch).expect_err("short read");
    assert!(
        err.to_string().contains("kv"),
        "error names the file: {err}"
    );
    for s in 0..4 {
        assert_eq!(pool.state(s).expect("state"), SlotState::Failed);
        assert!(pool.landed(s, 1).is_err());
    }
    // Overlapping spans and out-of-range slots are refused.
    let dup = [
        spans[0],
        BlockSpan {
            slot: 0,
            ..spans[1]
        },
    ];
    assert!(
        pool.submit(&be, &f, &l, &dup, BlockPath::Coalesced)
            .is_err()
    );
    let far = [BlockSpan {
        slot: 4,
        ..spans[0]
    }];
    assert!(
        pool.submit(&be, &f, &l, &far, BlockPath::Coalesced)
            .is_err()
    );
    assert!(SlotPool::new(4095, 1).is_err());
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 12, ..ProptestConfig::default() })]
    #[test]
    fn paths_agree_for_any_geometry(layers in 1u32..4, blocks in 1u32..4, nkv in 1u32..4, dim in prop::sample::select(vec![8u32, 64, 96, 200]), major in any::<bool>(), salt in any::<u64>()) {
        let order = if major { BlockOrder::BlockMajor } else { BlockOrder::PerLayer };
        let l = layout(order, layers, blocks, nkv, dim);
        let (disk_c, mem_c, _, _) = roundtrip(&l, BlockPath::Coalesced, salt);
        let (disk_h, mem_h, _, _) = roundtrip(&l, BlockPath::PerHead, salt);
        prop_assert!(disk_c == disk_h);
        prop_assert!(mem_c == mem_h);
    }
}

#[test]
fn owner_fills_slots_only_when_no_read_targets_them() {
    let l = layout(BlockOrder::PerLayer, 1, 2, 2, 64);
    let bb = l.block_bytes() as usize;
    let dir = tempfile::tempdir().expect("dir");
    let f = store(&dir, "kv", &l);
    let be = flashtier_io::SimBackend::new(
        flashtier_io::FaultPlan::seeded(5).latency(1.0, std::time::Duration::from_millis(5)),
        2,
    )
    .expect("sim");
    let mut pool = SlotPool::new(bb, 2).expect("pool");
    // Offload straight from a slot the owner filled.
    let id = BlockId::new(0, 1);
    pool.fill(0, 1)
        .expect("idle slot")
        .copy_from_slice(&pattern(id, bb, 8));
    write_block(
        &be,
        &f,
        &l,
        id,
        pool.fill(0, 1).expect("idle slot"),
        BlockPath::Coalesced,
    )
    .expect("write");
    assert_eq!(
        pool.state(0).expect("state"),
        SlotState::Empty,
        "filled bytes are not a landed read"
    );
    assert!(pool.landed(0, 1).is_err());
    // While its read is in flight, a slot can be neither viewed nor filled.
    let span = BlockSpan {
        first: id,
        count: 1,
        slot: 1,
    };
    let batch = pool
        .submit(&be, &f, &l, &[span], BlockPath::PerHead)
        .expect("submit");
    assert!(pool.landed(1, 1).is_err());
    assert!(pool.fill(1, 1).is_err());
    assert!(pool.invalidate(1).is_err());
    assert!(
        pool.submit(&be, &f, &l, &[span], BlockPath::Coalesced)
            .is_err(),
        "busy slot"
    );
    pool.wait(batch).expect("landed");
    assert!(pool.landed(1, 1).expect("landed") == &pattern(id, bb, 8)[..]);
    pool.invalidate(1).expect("idle");
    assert!(pool.landed(1, 1).is_err());
}
