//! `flashtier verify`: check every record of a store against its checksum.
//!
//! Records are read with O_DIRECT (where the file system allows it) through
//! the posix backend, in batches of [`BATCH_RECORDS`] whole strides, so
//! memory stays at `BATCH_RECORDS * stride` bytes. Besides each payload's
//! checksum, the padding after the payload must be zero.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use flashtier_format::Store;
use flashtier_io::{
    AlignedBuf, DirectMode, Landing, PosixBackend, ReadReq, StorageBackend, StoreFile,
};

use super::pack::experts::bytes_bar;

/// Records read per batch.
pub const BATCH_RECORDS: usize = 8;

/// Options of `flashtier verify`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Store file.
    pub file: PathBuf,
    /// Also check the store was packed from this checkpoint folder.
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// O_DIRECT for reading records: prefer | require | off.
    #[arg(long, default_value = "prefer")]
    pub direct: DirectMode,
    /// Print the result as JSON on stdout (still exits non-zero when bad).
    #[arg(long)]
    pub json: bool,
}

/// One bad record.
#[derive(Clone, Debug, serde::Serialize)]
pub struct BadRecord {
    /// Record index.
    pub index: u64,
    /// Its key, e.g. `layer=3 expert=7`.
    pub key: String,
    /// What is wrong.
    pub error: String,
}

/// What a verification found.
#[derive(Clone, Debug, serde::Serialize)]
pub struct VerifyReport {
    /// The store.
    pub file: PathBuf,
    /// Records checked.
    pub records: u64,
    /// Bytes read.
    pub bytes: u64,
    /// Bad records, in index order.
    pub bad: Vec<BadRecord>,
    /// Whether reads bypassed the page cache.
    pub direct: bool,
    /// Wall time.
    #[serde(skip)]
    pub elapsed: Duration,
}

impl VerifyReport {
    /// JSON for scripts.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "file": self.file,
            "ok": self.bad.is_empty(),
            "records": self.records,
            "bad_records": self.bad.len(),
            "first_bad": self.bad.first(),
            "bytes": self.bytes,
            "direct": self.direct,
            "elapsed_s": self.elapsed.as_secs_f64(),
        })
    }
}

fn check_landed(store: &Store, index: u64, buf: &[u8]) -> Option<BadRecord> {
    let payload = store.payload_bytes() as usize;
    let key = store
        .key_of(index)
        .map(|k| store.manifest().key_name(k))
        .unwrap_or_default();
    let (body, pad) = buf.split_at(payload.min(buf.len()));
    if let Err(e) = store.verify_record(index, body) {
        return Some(BadRecord {
            index,
            key,
            error: e.to_string(),
        });
    }
    if pad.iter().any(|&b| b != 0) {
        let error = format!(
            "{}: record {index} ({key}): padding after the payload is not zero",
            store.path().display()
        );
        return Some(BadRecord { index, key, error });
    }
    None
}

/// Open (validating header and tables) and check every record of `path`.
pub fn verify_store(
    path: &Path,
    direct: DirectMode,
    show: bool,
) -> anyhow::Result<(Store, VerifyReport)> {
    let t0 = Instant::now();
    let store = Store::open(path)?;
    let file = StoreFile::open_read(path, direct)?;
    let backend = PosixBackend::new(4)?;
    let stride =
        usize::try_from(store.stride_bytes()).context("record stride exceeds the address space")?;
    let count = store.record_count();
    let bar = if show {
        bytes_bar(count * store.stride_bytes(), "verifying")
    } else {
        indicatif::ProgressBar::hidden()
    };
    let mut spare: Vec<AlignedBuf> = Vec::new();
    let mut bad = Vec::new();
    let mut next = 0u64;
    while next < count {
        let batch = (count - next).min(BATCH_RECORDS as u64);
        let mut reqs = Vec::with_capacity(batch as usize);
        for i in next..next + batch {
            let buf = spare.pop().unwrap_or_else(|| AlignedBuf::zeroed(stride));
            let offset = store.record_offset(i)?;
            reqs.push(ReadReq {
                file: file.clone(),
                offset,
                len: stride,
                landing: Landing::Host(buf),
                tag: i,
            });
        }
        for landed in backend.read(reqs)? {
            if let Some(buf) = landed.buf {
                bad.extend(check_landed(&store, landed.tag, &buf));
                spare.push(buf);
            }
            bar.inc(stride as u64);
        }
        next += batch;
    }
    bar.finish_and_clear();
    let report = VerifyReport {
        file: path.to_path_buf(),
        records: count,
        bytes: count * store.stride_bytes(),
        bad,
        direct: file.is_direct(),
        elapsed: t0.elapsed(),
    };
    Ok((store, report))
}

/// Run `flashtier verify`.
pub fn run(args: Args) -> anyhow::Result<()> {
    let (store, report) = verify_store(&args.file, args.direct, !args.json)?;
    if let Some(model) = &args.model {
        let ckpt = flashtier_engine::source::Checkpoint::open(model)?;
        flashtier_engine::pack::check_pairing(&store, &ckpt)?;
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report.to_json())?);
    }
    if let Some(first) = report.bad.first() {
        anyhow::bail!(
            "{} of {} records bad; first bad record {} ({}): {}",
            report.bad.len(),
            report.records,
            first.index,
            first.key,
            first.error
        );
    }
    if !args.json {
        let secs = report.elapsed.as_secs_f64().max(1e-9);
        println!(
            "ok: {} records verified in {} ({:.1} MiB at {:.0} MiB/s{})",
            report.records,
            args.file.display(),
            report.bytes as f64 / f64::from(1 << 20),
            report.bytes as f64 / f64::from(1 << 20) / secs,
            if report.direct {
                ", O_DIRECT"
            } else {
                ", buffered"
            }
        );
    }
    Ok(())
}
