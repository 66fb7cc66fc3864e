//! Shared fixtures of the store-fault tests: small expert stores in several
//! versions (so a rewrite is visible), a writer that goes through a
//! `StorageBackend` (so the simulator can fail its writes), and the ways a
//! store changes under a running pool (scribble, truncate, rename-replace).
#![allow(dead_code)]

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use flashtier::experts::{Backing, ExpertPool, ExpertsError, PoolConfig, StoreSet};
use flashtier_format::{Dtype, Manifest, RecordKey, StoreKind, StoreWriterPlan};
use flashtier_io::{DirectMode, IoError, StorageBackend, StoreFile};

pub const LAYERS: u32 = 2;
pub const EXPERTS: u32 = 8;
pub const RECORDS: usize = (LAYERS * EXPERTS) as usize;
/// Payload bytes per record; the stride is 4096.
pub const PAYLOAD: usize = 3000;
pub const STRIDE: u64 = 4096;

/// The bytes of record `index` in version `version` of the store (versions
/// differ in almost every byte).
#[must_use]
pub fn record(version: u8, index: usize) -> Vec<u8> {
    let mut x = 0x9E37_79B9_7F4A_7C15u64 ^ (u64::from(version) << 32) ^ index as u64;
    (0..PAYLOAD)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn plan() -> StoreWriterPlan {
    let keys = (0..LAYERS)
        .flat_map(|l| (0..EXPERTS).map(move |e| RecordKey::new(l, e)))
        .collect();
    let manifest = Manifest::single_tensor(StoreKind::Experts, Dtype::U8, PAYLOAD as u64, keys);
    StoreWriterPlan::new(manifest).expect("plan of a valid manifest")
}

/// The whole file image of `version`.
#[must_use]
pub fn image(version: u8) -> Vec<u8> {
    let records: Vec<Vec<u8>> = (0..RECORDS).map(|i| record(version, i)).collect();
    plan().image(&records).expect("image")
}

/// Write `version` at `path` in one go (no faults).
pub fn write_store(path: &Path, version: u8) {
    std::fs::write(path, image(version)).expect("write store");
}

/// Write `version` at `path` through `backend` the way a packer does: every
/// record (a whole stride), then the tail, then the header last, so a failed
/// write leaves no valid header behind a fresh file. Over an existing store
/// it rewrites in place. Returns the first write error (and stops there).
pub fn write_through(
    backend: &dyn StorageBackend,
    path: &Path,
    version: u8,
) -> Result<(), IoError> {
    let plan = plan();
    let file = StoreFile::open_rw(path, DirectMode::Off, true)?;
    let mut sums = Vec::with_capacity(RECORDS);
    for i in 0..RECORDS {
        let payload = record(version, i);
        sums.push(plan.header().checksum_algo.digest(&payload));
        let mut stride = payload;
        stride.resize(STRIDE as usize, 0);
        let at = plan.record_offset(i as u64).expect("record in range");
        backend.write(&file, at, &stride)?;
    }
    let tail = plan.tail_bytes(&sums).expect("tail");
    backend.write(&file, plan.tail_offset(), &tail)?;
    let header = plan.header_bytes(&sums).expect("header");
    backend.write(&file, 0, &header)
}

/// File offset of record `index`.
#[must_use]
pub fn record_offset(index: usize) -> u64 {
    plan().record_offset(index as u64).expect("record in range")
}

/// File length of a complete store.
#[must_use]
pub fn file_len() -> u64 {
    plan().file_len()
}

/// Flip bits of `len` bytes at `offset` of the file in place (every byte
/// changes).
pub fn scribble(path: &Path, offset: u64, len: usize) {
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .expect("open rw");
    let mut buf = vec![0u8; len];
    f.read_exact_at(&mut buf, offset)
        .expect("read before scribble");
    for b in &mut buf {
        *b ^= 0xA5;
    }
    f.write_all_at(&buf, offset).expect("scribble");
}

/// Cut the file to `len` bytes.
pub fn truncate(path: &Path, len: u64) {
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(path)
        .expect("open rw");
    f.set_len(len).expect("truncate");
}

/// Replace the file by a new store of `version`: write a sibling, rename it
/// over `path`.
pub fn replace_by_rename(path: &Path, version: u8) {
    let tmp: PathBuf = path.with_extension("new");
    write_store(&tmp, version);
    std::fs::rename(&tmp, path).expect("rename");
}

/// Flush the file and drop its cached pages, so mapped reads go to the
/// backend (advisory; callers that depend on it check the plan's reads).
pub fn make_cold(path: &Path, pool: &ExpertPool) {
    std::fs::File::open(path)
        .and_then(|f| f.sync_all())
        .expect("sync store");
    if let Some(m) = &pool.stores().full().map {
        m.drop_cached(0, m.len_bytes()).expect("fadvise");
    }
}

/// A pool of `capacity` records over the store at `path`.
pub fn open_pool(
    path: &Path,
    backing: Backing,
    capacity: u64,
    backend: Arc<dyn StorageBackend>,
) -> Result<ExpertPool, ExpertsError> {
    let stores = StoreSet::open(path, backing == Backing::Mapped)?;
    let config = PoolConfig {
        backing,
        budget_bytes: capacity * STRIDE,
        ..PoolConfig::default()
    };
    ExpertPool::new(stores, backend, config)
}
