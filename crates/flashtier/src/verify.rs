//! Checking every record or block of a flashtier file against its checksum:
//! what the three verifiers share ([`crate::experts::verify`] for record
//! stores and low-bit companions, [`crate::rows::verify`] for packed row
//! shards, [`crate::kv::verify`] for KV stores), and [`sniff`], which tells
//! them apart from a file's first bytes.
//!
//! A verifier lists the units it checks (a record's whole stride, a 4 KiB
//! row block, a KV block) in file order; [`scan`] coalesces neighbouring
//! units into reads of at most [`WINDOW_BYTES`] (a unit larger than that is
//! one read of its own), keeps at most [`QUEUE_WINDOWS`] reads in flight
//! through a `StorageBackend`, and hands each unit's landed bytes to the
//! verifier's check. Bounds: `QUEUE_WINDOWS * max(WINDOW_BYTES, unit)` bytes
//! of buffers; every bad unit is counted, the first [`MAX_LISTED_BAD`] are
//! kept with their index, key, offset and length. A read that fails is an
//! error naming the file, offset and length, not a bad unit.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use flashtier_format::kind::SNIFF_BYTES;
use flashtier_format::{FileKind, UnknownKind};
use flashtier_io::{AlignedBuf, DirectMode, IoError, Landing, ReadReq, StorageBackend, StoreFile};

/// Most bytes one coalesced read covers (unless one unit is larger).
pub const WINDOW_BYTES: usize = 1 << 20;
/// Reads in flight at once.
pub const QUEUE_WINDOWS: usize = 4;
/// Bad units kept in a report (all are counted).
pub const MAX_LISTED_BAD: usize = 64;

/// One checked extent of a file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Unit {
    /// Record or block index.
    pub index: u64,
    /// Byte offset in the file.
    pub offset: u64,
    /// Length in bytes.
    pub len_bytes: usize,
}

/// A unit whose bytes do not match its checksum (or its padding is not zero).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct BadUnit {
    /// Record or block index.
    pub index: u64,
    /// Its key, e.g. `layer=3 expert=7` or `block 5 (rows 75..90)`.
    pub key: String,
    /// Byte offset in the file.
    pub offset: u64,
    /// Length in bytes.
    pub len_bytes: u64,
    /// What is wrong.
    pub error: String,
}

impl BadUnit {
    /// The bad unit `u`, named `key`.
    #[must_use]
    pub fn new(u: &Unit, key: String, error: String) -> Self {
        Self {
            index: u.index,
            key,
            offset: u.offset,
            len_bytes: u.len_bytes as u64,
            error,
        }
    }
}

/// What a verification found.
#[derive(Clone, Debug)]
pub struct VerifyReport {
    /// The file.
    pub file: PathBuf,
    /// Its kind: `experts`, `lowbit`, `row_shard`, `kv_store`.
    pub kind: &'static str,
    /// What a unit is: `record` or `block`.
    pub unit: &'static str,
    /// Units checked.
    pub units: u64,
    /// Bytes read.
    pub bytes: u64,
    /// Bad units found (all of them).
    pub bad_count: u64,
    /// The first [`MAX_LISTED_BAD`] bad units, in file order.
    pub bad: Vec<BadUnit>,
    /// Whether reads bypassed the page cache.
    pub direct: bool,
    /// Wall time.
    pub elapsed: Duration,
}

impl VerifyReport {
    /// No bad unit.
    #[must_use]
    pub fn ok(&self) -> bool {
        self.bad_count == 0
    }

    /// The first bad unit.
    #[must_use]
    pub fn first_bad(&self) -> Option<&BadUnit> {
        self.bad.first()
    }

    /// JSON for scripts.
    #[must_use]
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "file": self.file,
            "kind": self.kind,
            "ok": self.ok(),
            "unit": self.unit,
            "units": self.units,
            "bad_units": self.bad_count,
            "first_bad": self.first_bad(),
            "bytes": self.bytes,
            "direct": self.direct,
            "elapsed_s": self.elapsed.as_secs_f64(),
        })
    }
}

/// What [`scan`] counted.
#[derive(Clone, Debug, Default)]
pub struct Tally {
    /// Units checked.
    pub units: u64,
    /// Bytes read.
    pub bytes: u64,
    /// Bad units (all).
    pub bad_count: u64,
    /// The first [`MAX_LISTED_BAD`] bad units.
    pub bad: Vec<BadUnit>,
}

impl Tally {
    /// The report of a verification of `file` that started at `t0`.
    #[must_use]
    pub fn report(
        self,
        file: &StoreFile,
        kind: &'static str,
        unit: &'static str,
        t0: Instant,
    ) -> VerifyReport {
        VerifyReport {
            file: file.path().to_path_buf(),
            kind,
            unit,
            units: self.units,
            bytes: self.bytes,
            bad_count: self.bad_count,
            bad: self.bad,
            direct: file.is_direct(),
            elapsed: t0.elapsed(),
        }
    }
}

/// Progress of a verification: `(bytes done, bytes in all)`.
pub type Progress<'a> = &'a mut dyn FnMut(u64, u64);

/// The check of one unit's landed bytes: `Some` when it is bad.
pub type Check<'a> = &'a mut dyn FnMut(&Unit, &[u8]) -> Option<BadUnit>;

/// Consecutive units read as one extent.
struct Window {
    offset: u64,
    len: usize,
    units: Vec<Unit>,
}

impl Window {
    fn takes(&self, u: &Unit) -> bool {
        self.offset + self.len as u64 == u.offset && self.len + u.len_bytes <= WINDOW_BYTES
    }
}

/// Read every unit of `units` (in file order) from `file` and check it.
/// `total_bytes` is their sum, for `progress`.
pub fn scan(
    backend: &dyn StorageBackend,
    file: &Arc<StoreFile>,
    units: impl Iterator<Item = Unit>,
    total_bytes: u64,
    progress: Progress<'_>,
    check: Check<'_>,
) -> Result<Tally, IoError> {
    let mut tally = Tally::default();
    let mut spare: Vec<AlignedBuf> = Vec::with_capacity(QUEUE_WINDOWS);
    let mut batch: Vec<Window> = Vec::with_capacity(QUEUE_WINDOWS);
    let mut current: Option<Window> = None;
    progress(0, total_bytes);
    for u in units {
        match current.as_mut() {
            Some(w) if w.takes(&u) => {
                w.len += u.len_bytes;
                w.units.push(u);
                continue;
            }
            _ => {}
        }
        if let Some(w) = current.take() {
            batch.push(w);
        }
        if batch.len() == QUEUE_WINDOWS {
            run_batch(backend, file, &mut batch, &mut spare, &mut tally, check)?;
            progress(tally.bytes, total_bytes);
        }
        current = Some(Window {
            offset: u.offset,
            len: u.len_bytes,
            units: vec![u],
        });
    }
    batch.extend(current);
    run_batch(backend, file, &mut batch, &mut spare, &mut tally, check)?;
    progress(tally.bytes, total_bytes);
    Ok(tally)
}

fn run_batch(
    backend: &dyn StorageBackend,
    file: &Arc<StoreFile>,
    batch: &mut Vec<Window>,
    spare: &mut Vec<AlignedBuf>,
    tally: &mut Tally,
    check: Check<'_>,
) -> Result<(), IoError> {
    if batch.is_empty() {
        return Ok(());
    }
    let mut reqs = Vec::with_capacity(batch.len());
    for (i, w) in batch.iter().enumerate() {
        let buf = match spare.iter().position(|b| b.capacity() >= w.len) {
            Some(at) => spare.swap_remove(at),
            None => AlignedBuf::zeroed(w.len),
        };
        reqs.push(ReadReq {
            file: file.clone(),
            offset: w.offset,
            len: w.len,
            landing: Landing::Host(buf),
            tag: i as u64,
        });
    }
    let landed = backend.read(reqs)?;
    for (w, l) in batch.drain(..).zip(landed) {
        let Some(buf) = l.buf else { continue };
        for u in &w.units {
            let at = (u.offset - w.offset) as usize;
            let bytes = buf.get(at..at + u.len_bytes).unwrap_or_default();
            tally.units += 1;
            tally.bytes += u.len_bytes as u64;
            if let Some(bad) = check(u, bytes) {
                tally.bad_count += 1;
                if tally.bad.len() < MAX_LISTED_BAD {
                    tally.bad.push(bad);
                }
            }
        }
        spare.push(buf);
    }
    Ok(())
}

/// Why [`sniff`] could not tell a file's kind.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SniffError {
    /// Opening or reading the file failed (a FIFO or device node is refused
    /// here, before any read).
    #[error(transparent)]
    Io(#[from] IoError),
    /// The file starts with none of flashtier's magics.
    #[error(transparent)]
    Unknown(#[from] UnknownKind),
}

/// The kind of the flashtier file at `path`, from its first bytes (read
/// through `flashtier-io`, buffered).
pub fn sniff(path: &Path) -> Result<FileKind, SniffError> {
    let file = StoreFile::open_read(path, DirectMode::Off)?;
    let len = file.len_bytes()?.min(SNIFF_BYTES as u64) as usize;
    let mut first = [0u8; SNIFF_BYTES];
    let head = first.get_mut(..len).unwrap_or_default();
    file.read_exact_at(head, 0)?;
    Ok(FileKind::sniff_path(path, head)?)
}

/// Read `len` bytes at `offset` of `file` through `backend` (a header page,
/// a table).
pub(crate) fn read_extent(
    backend: &dyn StorageBackend,
    file: &Arc<StoreFile>,
    offset: u64,
    len: usize,
) -> Result<AlignedBuf, IoError> {
    let req = ReadReq {
        file: file.clone(),
        offset,
        len,
        landing: Landing::Host(AlignedBuf::zeroed(len)),
        tag: 0,
    };
    backend
        .read(vec![req])?
        .pop()
        .and_then(|l| l.buf)
        .ok_or_else(|| IoError::Backend {
            backend: backend.name(),
            what: format!("read of {len} bytes at {offset} returned no buffer"),
        })
}
