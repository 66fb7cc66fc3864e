//! The prefix cache's two levels on real CPU caches and a real store file:
//! spilled entries come back byte for byte, the store keeps its length and
//! goes with the cache, and every injected fault (a failed, short or
//! corrupt read; a torn write) is a typed error or a dropped entry, never
//! wrong bytes. These wait for the writer thread with
//! [`PrefixCache::flush`] where they need an entry on the drive; the
//! writes in flight are [`writes`]'s.
#![allow(clippy::unwrap_used, reason = "tests")]

mod writes;

use std::os::unix::fs::FileExt;
use std::sync::Arc;

use flashtier::kv::KvError;
use flashtier_engine::device::cpu::kv::KvCache;
use flashtier_engine::device::{KvPrecision, KvSpec, KvState};
use flashtier_engine::engine::SeqKv;
use flashtier_engine::error::EngineError;
use flashtier_format::kv::{BlockId, BlockOrder, GroupLayout, KvGeometry};
use flashtier_io::sim::{Fault, FaultPlan, OpKind, SimBackend};

use super::*;

const LAYERS: usize = 3;
const CAPACITY: usize = 256;

fn spec() -> KvSpec {
    KvSpec {
        layers: LAYERS,
        q_heads: 4,
        kv_heads: 2,
        head_dim: 32,
        capacity: CAPACITY,
        precision: KvPrecision::Bf16x2,
    }
}

fn empty() -> Result<SeqKv, EngineError> {
    Ok(SeqKv::Cpu(Box::new(KvCache::new(&spec())?)))
}

/// [`PrefixCache::take`], then, for an entry on the drive, the restore
/// collected once it lands (an error either way is the entry lost).
trait TakeNow {
    fn take_now(
        &mut self,
        prompt: &[u32],
        capacity: usize,
        fresh: fn() -> Result<SeqKv, EngineError>,
    ) -> Result<Option<Reused>, SpillError>;
}

impl TakeNow for PrefixCache {
    fn take_now(
        &mut self,
        prompt: &[u32],
        capacity: usize,
        fresh: fn() -> Result<SeqKv, EngineError>,
    ) -> Result<Option<Reused>, SpillError> {
        let ticket = match self.take(prompt, capacity, fresh)? {
            None => return Ok(None),
            Some(Taken::Ready(r)) => return Ok(Some(r)),
            Some(Taken::Restoring { ticket, .. }) => ticket,
        };
        assert_eq!(self.restoring(), 1);
        loop {
            if let Some((_, got)) = self.restores().into_iter().find(|(t, _)| *t == ticket) {
                assert_eq!(self.restoring(), 0);
                return got.map(Some);
            }
            self.wait_restores(std::time::Duration::from_millis(100));
        }
    }
}

/// A cache of `n` positions whose values depend on `seed` and the position.
fn cache(n: usize, seed: u32) -> SeqKv {
    let mut c = KvCache::new(&spec()).unwrap();
    for p in 0..n {
        for layer in 0..LAYERS {
            let x = |i: usize| ((seed as usize * 7919 + p * 131 + layer * 17 + i) % 1000) as f32;
            let k: Vec<f32> = (0..64).map(|i| x(i) * 0.013 - 6.0).collect();
            let v: Vec<f32> = (0..64).map(|i| x(i + 5) * -0.021 + 1.5).collect();
            c.push(layer, &k, &v).unwrap();
        }
        c.advance(1);
    }
    SeqKv::Cpu(Box::new(c))
}

fn tokens(n: usize, seed: u32) -> Vec<u32> {
    (0..n as u32).map(|i| seed * 1000 + i).collect()
}

/// Every layer's K and V bytes.
fn bytes(kv: &SeqKv) -> Vec<(Vec<u8>, Vec<u8>)> {
    let SeqKv::Cpu(c) = kv else {
        panic!("a CPU cache")
    };
    (0..LAYERS)
        .map(|l| {
            let (k, v) = c.layer_bytes(l).unwrap();
            (k.to_vec(), v.to_vec())
        })
        .collect()
}

fn spill_in(dir: &std::path::Path, tokens: usize, plan: Option<FaultPlan>) -> PrefixSpill {
    let mut cfg = SpillConfig::new(dir, tokens);
    if let Some(p) = plan {
        cfg.backend = Some(Arc::new(SimBackend::new(p, 2).unwrap()));
    }
    PrefixSpill::new(cfg).unwrap()
}

/// A memory budget of 40 positions: the second entry pushes the first
/// (37 positions of seed 1) to the drive, written by the time it returns.
fn spilled_one(spill: PrefixSpill) -> PrefixCache {
    let mut p = PrefixCache::with_spill(40, Some(spill));
    p.put(tokens(37, 1), cache(37, 1));
    p.put(tokens(20, 2), cache(20, 2));
    assert_eq!((p.held(), p.spilled(), p.len()), (20, 37, 2));
    p.flush();
    assert_eq!(p.spill().unwrap().writing(), 0);
    assert_eq!((p.held(), p.spilled(), p.len()), (20, 37, 2));
    p
}

fn prompt_over(n: usize, seed: u32) -> Vec<u32> {
    let mut t = tokens(n, seed);
    t.push(9_999_999);
    t
}

#[test]
fn a_spilled_cache_comes_back_byte_for_byte_whole_and_cut_back() {
    let dir = tempfile::tempdir().unwrap();
    let want = bytes(&cache(37, 1));
    let mut p = spilled_one(spill_in(dir.path(), 256, None));
    let r = p
        .take_now(&prompt_over(37, 1), CAPACITY, empty)
        .unwrap()
        .unwrap();
    assert!(r.restored);
    assert_eq!((r.cached, r.kv.len()), (37, 37));
    assert_eq!(bytes(&r.kv), want);
    let s = p.spill().unwrap().stats();
    assert_eq!((s.spilled, s.restored, s.restore_failures), (1, 1, 0));
    // 3 blocks of 3 layers, each block 2 kv heads x K and V x 4096 bytes.
    assert_eq!(s.bytes_written, 9 * 16384);
    assert_eq!(s.bytes_read, s.bytes_written);
    assert_eq!(p.spilled(), 0);

    // A prompt sharing 21 positions restores two blocks and cuts back to
    // them: the same bytes as the original cut back to 21.
    p.put(tokens(37, 1), r.kv);
    p.put(tokens(30, 3), cache(30, 3));
    p.flush();
    let mut cut = cache(37, 1);
    cut.truncate(21).unwrap();
    let mut shared = tokens(21, 1);
    shared.extend([7, 7, 7]);
    let r = p.take_now(&shared, CAPACITY, empty).unwrap().unwrap();
    assert!(r.restored);
    assert_eq!((r.cached, r.kv.len()), (21, 21));
    assert_eq!(bytes(&r.kv), bytes(&cut));
    assert_eq!(p.spill().unwrap().stats().bytes_read, (9 + 6) * 16384);
}

#[test]
fn at_equal_reuse_the_entry_in_memory_wins() {
    let dir = tempfile::tempdir().unwrap();
    let mut p = spilled_one(spill_in(dir.path(), 100, None));
    // Seed 1 again in memory; seed 2 goes to the drive beside its copy.
    p.put(tokens(37, 1), cache(37, 1));
    assert_eq!((p.held(), p.spilled()), (37, 57));
    let r = p
        .take_now(&prompt_over(37, 1), CAPACITY, empty)
        .unwrap()
        .unwrap();
    assert!(!r.restored);
    assert_eq!(p.spill().unwrap().stats().restored, 0);
}

#[test]
fn the_drive_keeps_its_bound_dropping_the_least_recently_used() {
    let dir = tempfile::tempdir().unwrap();
    // 48 positions: 3 blocks, all of them seed 1's.
    let mut p = spilled_one(spill_in(dir.path(), 48, None));
    assert_eq!(p.spill().unwrap().free_blocks(), 0);
    // Seed 2 leaves memory; seed 1 leaves the drive to make room.
    p.put(tokens(30, 3), cache(30, 3));
    assert_eq!((p.held(), p.spilled()), (30, 20));
    p.flush();
    let s = p.spill().unwrap().stats();
    assert_eq!((s.spilled, s.dropped), (2, 1));
    assert!(
        p.take_now(&prompt_over(37, 1), CAPACITY, empty)
            .unwrap()
            .is_none()
    );
    let r = p
        .take_now(&prompt_over(20, 2), CAPACITY, empty)
        .unwrap()
        .unwrap();
    assert!(r.restored && r.cached == 20);
    assert_eq!(bytes(&r.kv), bytes(&cache(20, 2)));
    // An entry longer than the whole drive is dropped, never written.
    let other = tempfile::tempdir().unwrap();
    let mut small = PrefixCache::with_spill(10, Some(spill_in(other.path(), 16, None)));
    small.put(tokens(20, 8), cache(20, 8));
    let s = small.spill().unwrap().stats();
    assert_eq!((s.spilled, s.dropped, small.len()), (0, 1, 0));
}

#[test]
fn the_store_keeps_its_length_and_goes_with_the_cache() {
    let dir = tempfile::tempdir().unwrap();
    let p = spilled_one(spill_in(dir.path(), 100, None));
    let spill = p.spill().unwrap();
    let path = spill.path().to_path_buf();
    // 7 block numbers of 3 layers: header, one table page, 21 blocks.
    let len = 4096 + 4096 + 21 * 16384;
    assert_eq!(spill.file_len_bytes(), Some(len));
    let mut p = p;
    for seed in 10..30 {
        p.put(
            tokens(33 + seed as usize, seed),
            cache(33 + seed as usize, seed),
        );
        p.flush();
        assert_eq!(std::fs::metadata(&path).unwrap().len(), len);
    }
    assert!(p.spill().unwrap().stats().dropped > 0);
    drop(p);
    assert!(!path.exists(), "the store goes with the cache");
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
}

/// The extent of block (`layer`, `block`) of the store of `spilled_one`
/// (100 positions: 7 block numbers).
fn block_offset(layer: u32, block: u32) -> u64 {
    let g = KvGeometry {
        num_layers: LAYERS as u32,
        num_blocks: 7,
        num_kv_heads: 2,
        block_tokens: 16,
        head_dim: 64,
        dtype_bytes: 2,
    };
    let layout = GroupLayout::new(g, BlockOrder::BlockMajor).unwrap();
    layout
        .block_extent(BlockId::new(layer, block))
        .unwrap()
        .offset
}

/// The take after `damage` fails with a restore error whose cause `check`
/// accepts; the entry is gone, the failure counted, and a fresh cache can
/// still be made.
fn fails_to_restore(
    plan: Option<FaultPlan>,
    damage: impl FnOnce(&std::path::Path),
    check: impl FnOnce(&KvError) -> bool,
) {
    let dir = tempfile::tempdir().unwrap();
    let mut p = spilled_one(spill_in(dir.path(), 100, plan));
    damage(p.spill().unwrap().path());
    let err = p
        .take_now(&prompt_over(37, 1), CAPACITY, empty)
        .unwrap_err();
    let SpillError::Restore { source, blocks, .. } = &err else {
        panic!("not a restore error: {err}")
    };
    assert_eq!(*blocks, 9);
    assert!(check(source), "{err}");
    let s = p.spill().unwrap().stats();
    assert_eq!((s.restored, s.restore_failures), (0, 1));
    assert_eq!((p.spilled(), p.len()), (0, 1));
    assert!(
        p.take_now(&prompt_over(37, 1), CAPACITY, empty)
            .unwrap()
            .is_none()
    );
    // Its blocks are free again: the next spill reuses them.
    assert_eq!(p.spill().unwrap().free_blocks(), 7);
}

fn caused_by(e: &KvError, pred: &dyn Fn(&KvError) -> bool) -> bool {
    match e {
        KvError::Restore { source, .. } => caused_by(source, pred),
        other => pred(other),
    }
}

#[test]
fn a_corrupt_block_is_a_typed_error_never_a_cache() {
    fails_to_restore(
        Some(FaultPlan::seeded(11)),
        |path| {
            let f = std::fs::OpenOptions::new().write(true).open(path).unwrap();
            f.write_all_at(&[0x5a; 8], block_offset(1, 1) + 100)
                .unwrap();
        },
        |e| caused_by(e, &|e| matches!(e, KvError::Corrupt { .. })),
    );
}

#[test]
fn a_failed_read_is_a_typed_error() {
    let plan = FaultPlan::seeded(12).fail_nth(OpKind::Read, 2, Fault::Eio);
    fails_to_restore(
        Some(plan),
        |_| {},
        |e| caused_by(e, &|e| matches!(e, KvError::Io(_))),
    );
}

#[test]
fn a_short_read_of_a_truncated_store_is_a_typed_error() {
    fails_to_restore(
        Some(FaultPlan::seeded(13).short_reads(0.5)),
        |path| {
            let f = std::fs::OpenOptions::new().write(true).open(path).unwrap();
            f.set_len(block_offset(0, 2) + 4096).unwrap();
        },
        |e| caused_by(e, &|e| matches!(e, KvError::Io(_))),
    );
}

#[test]
fn a_torn_spill_write_drops_the_entry() {
    let dir = tempfile::tempdir().unwrap();
    let plan = FaultPlan::seeded(14).fail_nth(OpKind::Write, 2, Fault::Torn);
    let mut p = PrefixCache::with_spill(40, Some(spill_in(dir.path(), 100, Some(plan))));
    p.put(tokens(37, 1), cache(37, 1));
    p.put(tokens(20, 2), cache(20, 2));
    p.flush();
    let s = p.spill().unwrap().stats();
    assert_eq!((s.spilled, s.spill_failures), (0, 1));
    assert_eq!((p.spilled(), p.len()), (0, 1));
    assert!(
        p.take_now(&prompt_over(37, 1), CAPACITY, empty)
            .unwrap()
            .is_none()
    );
    assert_eq!(p.spill().unwrap().free_blocks(), 7);
}

#[test]
fn a_stale_store_of_a_gone_server_is_swept_and_others_stay() {
    let dir = tempfile::tempdir().unwrap();
    let stale = dir.path().join(".flashtier-prefix-4194303999-0.ftkv");
    let other = dir.path().join("notes.ftkv");
    std::fs::write(&stale, b"left by a killed server").unwrap();
    std::fs::write(&other, b"not ours").unwrap();
    let s = spill_in(dir.path(), 16, None);
    assert!(!stale.exists() && other.exists());
    assert_ne!(s.path(), stale);
}

#[test]
fn a_spill_past_its_limits_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    for n in [0, spill::MAX_SPILL_TOKENS + 1] {
        let e = PrefixSpill::new(SpillConfig::new(dir.path(), n)).unwrap_err();
        assert!(matches!(e, SpillError::Shape(_)), "{e}");
    }
    for q in [0, spill::MAX_WRITE_QUEUE + 1] {
        let mut cfg = SpillConfig::new(dir.path(), 16);
        cfg.write_queue = q;
        let e = PrefixSpill::new(cfg).unwrap_err();
        assert!(matches!(e, SpillError::Shape(_)), "{e}");
    }
}
