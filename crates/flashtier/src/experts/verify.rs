//! Verifying a record store (an expert store or a low-bit companion) end to
//! end: the header, checksum table and manifest are validated on open
//! ([`Store`]), then every record's whole stride is read through a
//! `StorageBackend` ([`crate::verify::scan`]): its payload must match its
//! checksum and the padding after the payload must be zero. A bad record is
//! reported with its index, key, offset and stride; the scan goes on.

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use flashtier_format::{Manifest, Store};
use flashtier_io::{DirectMode, StorageBackend, StoreFile};

use super::ExpertsError;
use super::lowbit::{LowbitError, LowbitSpec};
use crate::verify::{BadUnit, Progress, Unit, VerifyReport, scan};

/// Open and validate the record store at `path` (header, tables, manifest),
/// through `flashtier-io` so that a FIFO or device node is refused before
/// any read. Returns it with the buffered handle it was read from.
pub fn open_store(path: &Path) -> Result<(Store, Arc<StoreFile>), ExpertsError> {
    let file = StoreFile::open_read(path, DirectMode::Off)?;
    let store = Store::read_from(path, file.as_ref())?;
    Ok((store, file))
}

/// The bits and group of a low-bit companion (`manifest.extra["lowbit"]`),
/// `None` for an exact store.
pub fn lowbit_spec(manifest: &Manifest) -> Result<Option<LowbitSpec>, LowbitError> {
    let Some(extra) = manifest.extra.get("lowbit") else {
        return Ok(None);
    };
    let field = |name: &str| {
        extra
            .get(name)
            .and_then(serde_json::Value::as_u64)
            .ok_or_else(|| LowbitError::Layout(format!("manifest extra.lowbit.{name} is missing")))
    };
    let bits = u32::try_from(field("bits")?).unwrap_or(u32::MAX);
    let group = usize::try_from(field("group")?).unwrap_or(usize::MAX);
    LowbitSpec::new(bits, group).map(Some)
}

/// `experts` for an exact expert store, `lowbit` for a companion (the other
/// store kinds by their header name).
#[must_use]
pub fn kind_name(store: &Store) -> &'static str {
    if store.manifest().extra.contains_key("lowbit") {
        "lowbit"
    } else {
        store.kind().name()
    }
}

/// Check every record of the store at `path`; reads go through `backend`
/// with the `direct` policy. `progress(done, total)` in bytes.
pub fn verify_store(
    path: &Path,
    backend: &dyn StorageBackend,
    direct: DirectMode,
    progress: Progress<'_>,
) -> Result<(Store, VerifyReport), ExpertsError> {
    let t0 = Instant::now();
    let (store, _) = open_store(path)?;
    let file = StoreFile::open_read(path, direct)?;
    let stride =
        usize::try_from(store.stride_bytes()).map_err(|_| ExpertsError::StoreMismatch {
            path: path.to_path_buf(),
            what: format!("record stride {} exceeds memory", store.stride_bytes()),
        })?;
    let count = store.record_count();
    let units = (0..count).filter_map(|i| {
        let offset = store.record_offset(i).ok()?;
        Some(Unit {
            index: i,
            offset,
            len_bytes: stride,
        })
    });
    let mut check = |u: &Unit, bytes: &[u8]| check_record(&store, u, bytes);
    let tally = scan(
        backend,
        &file,
        units,
        count.saturating_mul(store.stride_bytes()),
        progress,
        &mut check,
    )?;
    let report = tally.report(&file, kind_name(&store), "record", t0);
    Ok((store, report))
}

fn check_record(store: &Store, u: &Unit, stride: &[u8]) -> Option<BadUnit> {
    let key = store
        .key_of(u.index)
        .map(|k| store.manifest().key_name(k))
        .unwrap_or_default();
    let payload = usize::try_from(store.payload_bytes()).unwrap_or(usize::MAX);
    let (body, pad) = stride.split_at(payload.min(stride.len()));
    if let Err(e) = store.verify_record(u.index, body) {
        return Some(BadUnit::new(u, key, e.to_string()));
    }
    if let Some(at) = pad.iter().position(|&b| b != 0) {
        let error = format!(
            "{}: record {} ({key}): padding after the payload is not zero (byte {} of the record)",
            store.path().display(),
            u.index,
            payload + at
        );
        return Some(BadUnit::new(u, key, error));
    }
    None
}
