//! The KV tier's schedule on the CPU: a host model of the CUDA cache (the
//! same window, the same chunk layout) offloads and restores through the
//! real `KvSwap` over the posix backend and the fault-injecting simulator.

use std::path::Path;
use std::sync::Arc;

use flashtier::kv::KvError;
use flashtier_cuda::ops::attn::window::ChunkWindow;
use flashtier_cuda::ops::attn::{CHUNK_POSITIONS, group_floats};
use flashtier_format::kv::BlockId;
use flashtier_io::sim::{Fault, FaultPlan, OpKind, SimBackend};
use flashtier_io::{AlignedBuf, LandingRegion, PosixBackend, StorageBackend};

use super::tier::{ChunkDevice, KvTier, TierIo, TierShape};
use super::{KvBudget, KvSizing};
use crate::device::{KvPrecision, KvSpec};
use crate::error::EngineError;

const LAYERS: usize = 2;
const KV_HEADS: usize = 1;
const DIM: usize = 4;
const CAPACITY_CHUNKS: usize = 24;

fn chunk_floats() -> usize {
    2 * KV_HEADS * group_floats(DIM)
}

/// The value of element `i` of K (`v` false) or V of `layer` at `pos`.
fn value(layer: usize, pos: usize, i: usize, v: bool) -> f32 {
    (layer * 1_000_003 + pos * 131 + i * 7 + usize::from(v)) as f32
}

/// Chunk `c` of `layer` with positions below `len` written, as bytes.
fn expected_chunk(layer: usize, c: usize, len: usize) -> Vec<u8> {
    let mut f = vec![0f32; chunk_floats()];
    let gs = group_floats(DIM);
    for t in 0..CHUNK_POSITIONS {
        let p = c * CHUNK_POSITIONS + t;
        if p >= len {
            break;
        }
        for h in 0..KV_HEADS {
            for i in 0..DIM {
                f[h * gs + t * DIM + i] = value(layer, p, h * DIM + i, false);
                f[(KV_HEADS + h) * gs + t * DIM + i] = value(layer, p, h * DIM + i, true);
            }
        }
    }
    f.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// The CUDA cache's arena on the host: `slots` chunk slots per layer.
struct HostChunks {
    window: ChunkWindow,
    /// Page-aligned, as pinned memory is (O_DIRECT writes).
    arena: Vec<Vec<AlignedBuf>>,
    len: Vec<usize>,
    offloaded: Vec<usize>,
    consumed: Vec<(usize, usize, Vec<u8>)>,
    fail_consume_at: Option<usize>,
}

impl HostChunks {
    fn new(slots: usize) -> Self {
        let window = ChunkWindow::new(slots, CAPACITY_CHUNKS * CHUNK_POSITIONS).unwrap();
        let slots = || {
            (0..window.slots())
                .map(|_| AlignedBuf::zeroed(chunk_floats() * 4))
                .collect()
        };
        Self {
            window,
            arena: (0..LAYERS).map(|_| slots()).collect(),
            len: vec![0; LAYERS],
            offloaded: vec![0; LAYERS],
            consumed: Vec::new(),
            fail_consume_at: None,
        }
    }

    /// Write `rows` positions of `layer`, as `kv_push` does.
    fn push(&mut self, layer: usize, rows: usize) {
        let held = self.len[layer];
        self.window
            .check_append(held, rows, self.offloaded[layer])
            .expect("append over a chunk not offloaded");
        let gs = group_floats(DIM);
        for p in held..held + rows {
            let (c, t) = (p / CHUNK_POSITIONS, p % CHUNK_POSITIONS);
            let slot = &mut self.arena[layer][c % self.window.slots()];
            if t == 0 {
                slot.fill(0);
            }
            for h in 0..KV_HEADS {
                for i in 0..DIM {
                    for (g, v) in [(h, false), (KV_HEADS + h, true)] {
                        let at = 4 * (g * gs + t * DIM + i);
                        let x = value(layer, p, h * DIM + i, v);
                        slot[at..at + 4].copy_from_slice(&x.to_le_bytes());
                    }
                }
            }
        }
        self.len[layer] = held + rows;
    }
}

impl ChunkDevice for HostChunks {
    fn download(&mut self, layer: usize, chunk: usize) -> Result<&[u8], EngineError> {
        let held = self.len[layer];
        assert!(
            (chunk + 1) * CHUNK_POSITIONS <= held,
            "offload of an incomplete chunk"
        );
        assert!(
            chunk >= self.window.first_resident(held),
            "offload of a chunk not resident"
        );
        Ok(&self.arena[layer][chunk % self.window.slots()])
    }

    fn consume(&mut self, layer: usize, first: usize, bytes: &[u8]) -> Result<(), EngineError> {
        if self.fail_consume_at == Some(self.consumed.len()) {
            return Err(EngineError::Attention(format!(
                "device failed at chunk {first}"
            )));
        }
        self.consumed.push((layer, first, bytes.to_vec()));
        Ok(())
    }

    fn staging(&mut self, len: usize) -> Result<Arc<LandingRegion>, EngineError> {
        Ok(LandingRegion::host(len))
    }
}

fn shape(tile_chunks: usize, read_ahead: usize) -> TierShape {
    TierShape {
        layers: LAYERS,
        capacity_chunks: CAPACITY_CHUNKS,
        kv_heads: KV_HEADS,
        head_dim: DIM,
        chunk_positions: CHUNK_POSITIONS,
        tile_chunks,
        read_ahead,
    }
}

fn tier(dir: &Path, backend: Arc<dyn StorageBackend>, tile: usize, ahead: usize) -> KvTier {
    let io = TierIo {
        dir: dir.to_path_buf(),
        backend,
    };
    KvTier::new(shape(tile, ahead), io).unwrap()
}

/// One step of `rows` on every layer: offload what leaves the window,
/// append, restore the cold tiles; returns the error of the first layer
/// that failed.
fn step(t: &mut KvTier, dev: &mut HostChunks, rows: usize, tile: usize) -> Result<(), EngineError> {
    for layer in 0..LAYERS {
        let held = dev.len[layer];
        let leaving = dev
            .window
            .evictions(held, rows, dev.offloaded[layer])
            .unwrap();
        let end = leaving.end;
        t.offload(dev, layer, leaving)?;
        dev.offloaded[layer] = end;
        dev.push(layer, rows);
        let len = dev.len[layer];
        let tiles = dev.window.cold_tiles(len, tile);
        dev.consumed.clear();
        t.restore(dev, layer, &tiles)?;
        let first_resident = dev.window.first_resident(len);
        let got: Vec<u8> = dev
            .consumed
            .iter()
            .flat_map(|(_, _, b)| b.clone())
            .collect();
        let want: Vec<u8> = (0..first_resident)
            .flat_map(|c| expected_chunk(layer, c, len))
            .collect();
        assert!(got == want, "layer {layer} at {len}: restored bytes differ");
        let firsts: Vec<usize> = dev.consumed.iter().map(|(_, f, _)| *f).collect();
        let want_firsts: Vec<usize> = tiles.iter().map(|r| r.start).collect();
        assert_eq!(firsts, want_firsts);
    }
    Ok(())
}

fn posix() -> Arc<dyn StorageBackend> {
    Arc::new(PosixBackend::new(4).unwrap())
}

/// A prompt in chunks of 256 and odd sizes, then decode steps across chunk
/// boundaries: every restore hands the device exactly the chunks it
/// offloaded, in order, at every window size and tile.
#[test]
fn restores_give_back_exactly_what_left_at_every_window() {
    for (slots, tile, ahead) in [(2, 1, 1), (2, 2, 4), (3, 3, 2), (5, 2, 3)] {
        let dir = tempfile::tempdir().unwrap();
        let mut t = tier(dir.path(), posix(), tile, ahead);
        let mut dev = HostChunks::new(slots);
        for rows in [256, 256, 100, 256, 256, 156, 256] {
            step(&mut t, &mut dev, rows, tile).unwrap();
        }
        for _ in 0..300 {
            step(&mut t, &mut dev, 1, tile).unwrap();
        }
        let st = t.stats();
        let len = dev.len[0];
        assert_eq!(len, 1536 + 300);
        assert_eq!(
            st.offloaded_blocks as usize,
            LAYERS * dev.window.first_resident(len)
        );
        assert!(st.restored_bytes > 0 && st.restored_blocks >= st.offloaded_blocks);
        let store = t.path().to_path_buf();
        assert!(store.exists());
        drop(t);
        assert!(!store.exists(), "the store outlived its cache");
    }
}

/// Short reads and latency from the simulator change nothing.
#[test]
fn restores_are_exact_through_short_and_slow_reads() {
    let dir = tempfile::tempdir().unwrap();
    let plan = FaultPlan::seeded(11)
        .short_reads(0.5)
        .latency(0.3, std::time::Duration::from_micros(200));
    let sim: Arc<dyn StorageBackend> = Arc::new(SimBackend::new(plan, 4).unwrap());
    let mut t = tier(dir.path(), sim, 2, 3);
    let mut dev = HostChunks::new(2);
    for rows in [256, 256, 256, 256, 7] {
        step(&mut t, &mut dev, rows, 2).unwrap();
    }
    for _ in 0..260 {
        step(&mut t, &mut dev, 1, 2).unwrap();
    }
}

/// Fill 5 chunks of each layer with a window of 2: 3 offloaded.
fn filled(backend: Arc<dyn StorageBackend>, dir: &Path) -> (KvTier, HostChunks) {
    let mut t = tier(dir, backend, 1, 2);
    let mut dev = HostChunks::new(2);
    for _ in 0..5 {
        step(&mut t, &mut dev, 256, 1).unwrap();
    }
    (t, dev)
}

fn restore_all(t: &mut KvTier, dev: &mut HostChunks, layer: usize) -> Result<(), EngineError> {
    let tiles = dev.window.cold_tiles(dev.len[layer], 1);
    dev.consumed.clear();
    t.restore(dev, layer, &tiles)
}

#[test]
fn a_failed_read_is_a_typed_error_and_its_tile_never_reaches_the_device() {
    let dir = tempfile::tempdir().unwrap();
    // The offloads are writes; reads are restores only. The 5 steps above
    // read 0+0+1+2+3 tiles per layer: 12 reads. Fail the 14th (layer 0's
    // second tile in the next restore).
    let plan = FaultPlan::seeded(3).fail_nth(OpKind::Read, 14, Fault::Eio);
    let sim: Arc<dyn StorageBackend> = Arc::new(SimBackend::new(plan, 1).unwrap());
    let (mut t, mut dev) = filled(sim, dir.path());
    let err = restore_all(&mut t, &mut dev, 0).unwrap_err();
    match &err {
        EngineError::Kv(KvError::Restore { tile: 1, source }) => {
            assert!(matches!(**source, KvError::Io(_)), "{source}");
        }
        other => panic!("expected a restore error of tile 1, got {other}"),
    }
    assert_eq!(dev.consumed.len(), 1, "only tile 0 was consumed");
}

#[test]
fn a_corrupt_block_is_named_and_never_served() {
    let dir = tempfile::tempdir().unwrap();
    let (mut t, mut dev) = filled(posix(), dir.path());
    let layout = shape(1, 2).layout().unwrap();
    let ext = layout.block_extent(BlockId::new(1, 2)).unwrap();
    {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(t.path())
            .unwrap();
        f.write_all_at(&[0x5a; 64], ext.offset + 4096).unwrap();
    }
    restore_all(&mut t, &mut dev, 0).expect("layer 0 is intact");
    let err = restore_all(&mut t, &mut dev, 1).unwrap_err();
    match &err {
        EngineError::Kv(KvError::Restore { tile: 2, source }) => match **source {
            KvError::Corrupt { id, .. } => assert_eq!(id, BlockId::new(1, 2)),
            ref other => panic!("expected a corrupt block, got {other}"),
        },
        other => panic!("expected a restore error of tile 2, got {other}"),
    }
    assert!(err.to_string().contains("layer 1, block 2"), "{err}");
    assert_eq!(dev.consumed.len(), 2, "tiles 0 and 1 only");
}

#[test]
fn a_torn_offload_is_an_error_and_the_chunk_stays_out_of_the_store() {
    let dir = tempfile::tempdir().unwrap();
    let plan = FaultPlan::seeded(5).fail_nth(OpKind::Write, 2, Fault::Torn);
    let sim: Arc<dyn StorageBackend> = Arc::new(SimBackend::new(plan, 2).unwrap());
    let mut t = tier(dir.path(), sim, 1, 2);
    let mut dev = HostChunks::new(2);
    step(&mut t, &mut dev, 256, 1).unwrap();
    step(&mut t, &mut dev, 256, 1).unwrap();
    // The third chunk of layer 0 evicts chunk 0 (write 1), of layer 1 its
    // chunk 0 (write 2, torn).
    let err = step(&mut t, &mut dev, 256, 1).unwrap_err();
    assert!(matches!(err, EngineError::Kv(KvError::Io(_))), "{err}");
    assert_eq!((t.offloaded(0), t.offloaded(1)), (1, 0));
}

#[test]
fn a_device_failure_comes_back_as_itself() {
    let dir = tempfile::tempdir().unwrap();
    let (mut t, mut dev) = filled(posix(), dir.path());
    dev.fail_consume_at = Some(1);
    let err = restore_all(&mut t, &mut dev, 0).unwrap_err();
    assert!(
        matches!(&err, EngineError::Attention(m) if m.contains("chunk 1")),
        "{err}"
    );
}

#[test]
fn restores_of_chunks_not_in_the_store_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (mut t, mut dev) = filled(posix(), dir.path());
    assert!(
        t.restore(&mut dev, 0, std::slice::from_ref(&(2..4)))
            .is_err(),
        "tile wider than 1"
    );
    assert!(
        t.restore(&mut dev, 0, std::slice::from_ref(&(3..4)))
            .is_err(),
        "chunk 3 is resident"
    );
    assert!(t.offload(&mut dev, 0, 4..5).is_err(), "chunk 3 comes first");
}

fn spec(layers: usize, capacity: usize) -> KvSpec {
    KvSpec {
        layers,
        q_heads: 8,
        kv_heads: 2,
        head_dim: 64,
        capacity,
        precision: KvPrecision::Bf16x2,
    }
}

#[test]
fn budgets_split_into_window_and_ring() {
    let s = spec(4, 16 * CHUNK_POSITIONS);
    let chunk = 2 * 2 * CHUNK_POSITIONS as u64 * 64 * 4;
    let b = |bytes| KvBudget::new(bytes, "/nonexistent".into());
    let whole = KvSizing::plan(&s, &b(4 * 16 * chunk)).unwrap();
    assert_eq!(
        (whole.slots, whole.offloads, whole.chunk_bytes),
        (16, false, chunk)
    );
    // Ring: 2 slots x 2 chunks; window: 2 chunks x 4 layers.
    let least = 4 * chunk + 8 * chunk;
    let p = KvSizing::plan(&s, &b(least)).unwrap();
    assert_eq!((p.slots, p.offloads), (2, true));
    assert_eq!(KvSizing::plan(&s, &b(least + 4 * chunk)).unwrap().slots, 3);
    match KvSizing::plan(&s, &b(least - 1)) {
        Err(EngineError::KvBudgetTooSmall {
            needed, ring_bytes, ..
        }) => {
            assert_eq!((needed, ring_bytes), (least, 4 * chunk));
        }
        other => panic!("expected KvBudgetTooSmall, got {other:?}"),
    }
    let mut no_ring = b(1 << 30);
    no_ring.ring_slots = 0;
    assert!(KvSizing::plan(&spec(4, 1 << 40), &no_ring).is_err());
}

#[test]
fn a_context_past_the_store_s_block_ids_is_refused() {
    let mut s = shape(1, 1);
    s.capacity_chunks = usize::MAX;
    assert!(matches!(s.layout(), Err(EngineError::TooLarge { .. })));
}
