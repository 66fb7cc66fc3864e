//! C ABI of the flashtier row store; the header is `include/flashtier_rows.h`.
//!
//! Every entry point catches panics at the boundary, returns an
//! `FT_ROWS_*` code, and records a message for `ft_rows_last_error` in a
//! thread-local. No entry point makes a CUDA call, so lookups are safe in a
//! CUDA host-function callback. Raw pointers from C are checked for NULL and
//! turned into slices only under the lengths the header documents; those
//! conversions live in [`ffi`], each with its `// SAFETY:` contract.

use std::cell::RefCell;
use std::ffi::{CString, c_char};
use std::panic::{AssertUnwindSafe, catch_unwind};

use flashtier::rows::{RowError, RowPrefetch, RowStats, RowStore};

pub mod ffi;

/// Success.
pub const FT_ROWS_OK: i32 = 0;
/// NULL pointer, bad geometry or configuration.
pub const FT_ROWS_ERR_INVALID_ARG: i32 = 1;
/// A read failed.
pub const FT_ROWS_ERR_IO: i32 = 2;
/// A row id outside the table, or negative.
pub const FT_ROWS_ERR_OUT_OF_RANGE: i32 = 3;
/// A packed shard is mismatched, truncated or corrupt.
pub const FT_ROWS_ERR_SHARD: i32 = 4;
/// RAM mode could not map or lock the table.
pub const FT_ROWS_ERR_MEMLOCK: i32 = 5;
/// Invalid range, or the range is already fixed.
pub const FT_ROWS_ERR_RANGE: i32 = 6;
/// The table source is malformed.
pub const FT_ROWS_ERR_SOURCE: i32 = 7;
/// A panic was caught at the boundary (a bug).
pub const FT_ROWS_ERR_PANIC: i32 = 8;

/// Map the whole table and lock it in RAM.
pub const FT_ROWS_FLAG_RAM: u32 = 1;
/// Buffered reads (no O_DIRECT).
pub const FT_ROWS_FLAG_BUFFERED: u32 = 2;
/// Do not pin the owned scales at `set_range`.
pub const FT_ROWS_FLAG_NO_PIN_SCALES: u32 = 4;
/// Read misses through an io_uring ring of [`URING_QUEUE_DEPTH`] reads
/// (the posix worker queue where io_uring is unavailable, said once on
/// stderr), so `ft_rows_prefetch_start` returns before the drive does.
pub const FT_ROWS_FLAG_URING: u32 = 8;

/// Reads in flight at most with [`FT_ROWS_FLAG_URING`]: fio's deepest
/// reference queue for 4 KiB reads.
pub const URING_QUEUE_DEPTH: usize = 64;

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

/// Record `msg` as this thread's last error.
pub(crate) fn set_last_error(msg: &str) {
    let c = CString::new(msg.replace('\0', " ")).unwrap_or_default();
    LAST_ERROR.with(|e| *e.borrow_mut() = c);
}

/// Pointer to this thread's last error (valid until the next failing call).
pub(crate) fn last_error_ptr() -> *const c_char {
    LAST_ERROR.with(|e| e.borrow().as_ptr())
}

/// The code for a row-store error.
#[must_use]
pub fn error_code(e: &RowError) -> i32 {
    match e {
        RowError::Io(_) | RowError::WorkerLost { .. } => FT_ROWS_ERR_IO,
        RowError::Shard(_) => FT_ROWS_ERR_SHARD,
        RowError::Lock(_) => FT_ROWS_ERR_MEMLOCK,
        RowError::IdOutOfRange { .. } | RowError::NegativeId { .. } => FT_ROWS_ERR_OUT_OF_RANGE,
        RowError::InvalidRange { .. } | RowError::RangeFixed { .. } => FT_ROWS_ERR_RANGE,
        RowError::Source { .. } => FT_ROWS_ERR_SOURCE,
        _ => FT_ROWS_ERR_INVALID_ARG,
    }
}

/// Run `f` at the boundary: panics and errors become codes plus a message.
pub(crate) fn guard(f: impl FnOnce() -> Result<(), (i32, String)>) -> i32 {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => FT_ROWS_OK,
        Ok(Err((code, msg))) => {
            set_last_error(&msg);
            code
        }
        Err(_) => {
            set_last_error("flashtier: internal panic caught at the C boundary");
            FT_ROWS_ERR_PANIC
        }
    }
}

/// Convert a row-store result for [`guard`].
pub(crate) fn lift<T>(r: Result<T, RowError>) -> Result<T, (i32, String)> {
    r.map_err(|e| (error_code(&e), e.to_string()))
}

/// C ids to row ids; a negative id is an error naming it.
pub(crate) fn to_row_ids(ids: &[i64]) -> Result<Vec<u64>, RowError> {
    ids.iter()
        .enumerate()
        .map(|(index, &id)| u64::try_from(id).map_err(|_| RowError::NegativeId { id, index }))
        .collect()
}

/// The C view of the stats.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FtRowsStats {
    /// Ids served from the cache (or RAM).
    pub hits: u64,
    /// Distinct rows read.
    pub misses: u64,
    /// Read operations.
    pub reads: u64,
    /// Positions served by another position's read.
    pub deduplicated: u64,
    /// Cache bytes.
    pub cache_bytes: u64,
    /// Cache slots.
    pub slots: u64,
    /// Cache sets.
    pub sets: u64,
    /// Cache ways.
    pub ways: u64,
    /// Pool threads.
    pub threads: u64,
    /// Pinned scale bytes.
    pub scales_bytes: u64,
    /// Owned range start.
    pub lo: u64,
    /// Owned range end.
    pub hi: u64,
    /// Table rows.
    pub rows: u64,
    /// 1 when a packed shard serves misses.
    pub packed: u32,
    /// 1 in RAM mode.
    pub ram_mode: u32,
    /// 1 when reads bypass the page cache.
    pub direct: u32,
    /// Zero.
    pub reserved: u32,
}

impl From<&RowStats> for FtRowsStats {
    fn from(s: &RowStats) -> Self {
        Self {
            hits: s.hits,
            misses: s.misses,
            reads: s.reads,
            deduplicated: s.deduplicated,
            cache_bytes: s.cache_bytes,
            slots: s.slots,
            sets: s.sets,
            ways: s.ways,
            threads: s.threads,
            scales_bytes: s.scales_bytes,
            lo: s.lo,
            hi: s.hi,
            rows: s.rows,
            packed: u32::from(s.packed),
            ram_mode: u32::from(s.ram_mode),
            direct: u32::from(s.direct),
            reserved: 0,
        }
    }
}

/// The opaque handle C holds.
pub struct FtRows {
    pub(crate) store: RowStore,
}

/// A started prefetch C holds until `ft_rows_prefetch_wait` or
/// `ft_rows_prefetch_abandon`. It keeps what it reads through alive, so it
/// stays valid after its store is closed.
pub struct FtRowsPending {
    pub(crate) pending: RowPrefetch,
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::CStr;

    #[test]
    fn negative_ids_are_named() {
        assert_eq!(to_row_ids(&[0, 5]).expect("valid"), vec![0, 5]);
        let e = to_row_ids(&[1, -3]).expect_err("negative");
        assert_eq!(error_code(&e), FT_ROWS_ERR_OUT_OF_RANGE);
        assert!(e.to_string().contains("-3"));
    }

    #[test]
    fn guard_records_errors_and_catches_panics() {
        assert_eq!(guard(|| Ok(())), FT_ROWS_OK);
        assert_eq!(
            guard(|| Err((FT_ROWS_ERR_IO, "disk on fire".into()))),
            FT_ROWS_ERR_IO
        );
        // SAFETY: the pointer is this thread's NUL-terminated message.
        let msg = unsafe { CStr::from_ptr(last_error_ptr()) };
        assert_eq!(msg.to_str().expect("utf8"), "disk on fire");
        assert_eq!(guard(|| panic!("boom")), FT_ROWS_ERR_PANIC);
    }
}
