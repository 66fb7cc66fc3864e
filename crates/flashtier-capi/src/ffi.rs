//! The `extern "C"` entry points. Each one checks its pointers, builds
//! slices from the lengths the header documents, and runs inside
//! [`crate::guard`].

use std::ffi::{CStr, c_char, c_int};
use std::path::PathBuf;

use flashtier::rows::{RowGeometry, RowStore, RowStoreConfig, TableSource};
use std::sync::Arc;

use flashtier_io::{BackendKind, DirectMode, open_backend};

use crate::{
    FT_ROWS_ERR_INVALID_ARG, FT_ROWS_ERR_IO, FT_ROWS_FLAG_BUFFERED, FT_ROWS_FLAG_NO_PIN_SCALES,
    FT_ROWS_FLAG_RAM, FT_ROWS_FLAG_URING, FtRows, FtRowsPending, FtRowsStats, URING_QUEUE_DEPTH,
    guard, last_error_ptr, lift, to_row_ids,
};

type Fail = (i32, String);

fn invalid(what: &str) -> Fail {
    (FT_ROWS_ERR_INVALID_ARG, format!("invalid argument: {what}"))
}

/// A C string argument as a path or name.
fn text(p: *const c_char, what: &str) -> Result<String, Fail> {
    if p.is_null() {
        return Err(invalid(&format!("{what} is NULL")));
    }
    // SAFETY: non-null, and the header requires a NUL-terminated string that
    // stays valid for the duration of the call.
    let s = unsafe { CStr::from_ptr(p) };
    s.to_str()
        .map(str::to_string)
        .map_err(|_| invalid(&format!("{what} is not UTF-8")))
}

fn config(cache_bytes: u64, ways: u32, flags: u32) -> Result<RowStoreConfig, Fail> {
    let backend = if flags & FT_ROWS_FLAG_URING != 0 {
        let b = open_backend(BackendKind::Uring, URING_QUEUE_DEPTH)
            .map_err(|e| (FT_ROWS_ERR_IO, format!("opening the io_uring backend: {e}")))?;
        Some(Arc::from(b))
    } else {
        None
    };
    Ok(RowStoreConfig {
        backend,
        cache_bytes,
        ways: if ways == 0 { 4 } else { ways as usize },
        ram_mode: flags & FT_ROWS_FLAG_RAM != 0,
        direct: if flags & FT_ROWS_FLAG_BUFFERED != 0 {
            DirectMode::Off
        } else {
            DirectMode::Prefer
        },
        pin_scales: flags & FT_ROWS_FLAG_NO_PIN_SCALES == 0,
        ..RowStoreConfig::default()
    })
}

fn hand_out(store: RowStore, out: *mut *mut FtRows) -> Result<(), Fail> {
    let raw = Box::into_raw(Box::new(FtRows { store }));
    // SAFETY: `out` was checked non-null by the caller of this helper and the
    // header requires it to point to writable storage for one pointer.
    unsafe { out.write(raw) };
    Ok(())
}

/// Check `out`, build the table source with `source`, open a store over it
/// with the cache settings `(cache_bytes, ways, flags)` and hand it out
/// through `out`.
fn open_into(
    out: *mut *mut FtRows,
    (cache_bytes, ways, flags): (u64, u32, u32),
    source: impl FnOnce() -> Result<TableSource, Fail>,
) -> Result<(), Fail> {
    if out.is_null() {
        return Err(invalid("out is NULL"));
    }
    let src = source()?;
    hand_out(
        lift(RowStore::open(src, config(cache_bytes, ways, flags)?))?,
        out,
    )
}

fn store_ref<'a>(store: *const FtRows) -> Result<&'a FtRows, Fail> {
    // SAFETY: a non-null handle came from `hand_out` and, per the header,
    // is not closed while other calls on it run.
    unsafe { store.as_ref() }.ok_or_else(|| invalid("store is NULL"))
}

fn ids_of<'a>(ids: *const i64, count: u64) -> Result<&'a [i64], Fail> {
    let n = usize::try_from(count).map_err(|_| invalid("count too large"))?;
    if n == 0 {
        return Ok(&[]);
    }
    if ids.is_null() {
        return Err(invalid("ids is NULL"));
    }
    // SAFETY: non-null; the header requires `count` readable int64_t values.
    Ok(unsafe { std::slice::from_raw_parts(ids, n) })
}

fn out_bytes<'a>(p: *mut u8, len: usize, what: &str) -> Result<&'a mut [u8], Fail> {
    if len == 0 {
        return Ok(&mut []);
    }
    if p.is_null() {
        return Err(invalid(&format!("{what} is NULL")));
    }
    // SAFETY: non-null; the header requires `count * row part bytes`
    // writable bytes not aliased by any other argument during the call.
    Ok(unsafe { std::slice::from_raw_parts_mut(p, len) })
}

/// See `ft_rows_open` in the header.
///
/// # Safety
/// Pointers must satisfy the header's contract for `ft_rows_open`: NULL or
/// valid for the documented lengths, handles from `ft_rows_open*` not yet
/// closed.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ft_rows_open(
    path: *const c_char,
    rows: u64,
    weight_offset: u64,
    scale_offset: u64,
    weight_bytes: u32,
    scale_bytes: u32,
    cache_bytes: u64,
    ways: u32,
    flags: u32,
    out: *mut *mut FtRows,
) -> c_int {
    guard(|| {
        open_into(out, (cache_bytes, ways, flags), || {
            let path = PathBuf::from(text(path, "path")?);
            let g = if weight_bytes == 0 && scale_bytes == 0 {
                RowGeometry::ENGRAM
            } else {
                RowGeometry {
                    weight_bytes,
                    scale_bytes,
                }
            };
            lift(TableSource::raw(
                &path,
                rows,
                weight_offset,
                scale_offset,
                g,
            ))
        })
    })
}

/// See `ft_rows_open_safetensors` in the header.
///
/// # Safety
/// Pointers must satisfy the header's contract for `ft_rows_open_safetensors`: NULL or
/// valid for the documented lengths, handles from `ft_rows_open*` not yet
/// closed.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ft_rows_open_safetensors(
    model: *const c_char,
    tensor: *const c_char,
    scales: *const c_char,
    cache_bytes: u64,
    ways: u32,
    flags: u32,
    out: *mut *mut FtRows,
) -> c_int {
    guard(|| {
        open_into(out, (cache_bytes, ways, flags), || {
            let model = PathBuf::from(text(model, "model")?);
            lift(TableSource::safetensors(
                &model,
                &text(tensor, "tensor")?,
                &text(scales, "scales")?,
            ))
        })
    })
}

/// See `ft_rows_set_range` in the header.
///
/// # Safety
/// Pointers must satisfy the header's contract for `ft_rows_set_range`: NULL or
/// valid for the documented lengths, handles from `ft_rows_open*` not yet
/// closed.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ft_rows_set_range(store: *mut FtRows, lo: u64, hi: u64) -> c_int {
    guard(|| lift(store_ref(store)?.store.set_range(lo, hi)))
}

/// See `ft_rows_attach_packed` in the header.
///
/// # Safety
/// Pointers must satisfy the header's contract for `ft_rows_attach_packed`: NULL or
/// valid for the documented lengths, handles from `ft_rows_open*` not yet
/// closed.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ft_rows_attach_packed(
    store: *mut FtRows,
    path: *const c_char,
    layer: u64,
    attached: *mut c_int,
) -> c_int {
    guard(|| {
        let s = store_ref(store)?;
        let path = PathBuf::from(text(path, "path")?);
        let ok = lift(s.store.attach_packed(&path, layer))?;
        if !attached.is_null() {
            // SAFETY: non-null; the header requires a writable int.
            unsafe { attached.write(c_int::from(ok)) };
        }
        Ok(())
    })
}

/// See `ft_rows_lookup` in the header.
///
/// # Safety
/// Pointers must satisfy the header's contract for `ft_rows_lookup`: NULL or
/// valid for the documented lengths, handles from `ft_rows_open*` not yet
/// closed.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ft_rows_lookup(
    store: *mut FtRows,
    ids: *const i64,
    count: u64,
    weights: *mut u8,
    scales: *mut u8,
) -> c_int {
    guard(|| {
        let s = store_ref(store)?;
        let ids = lift(to_row_ids(ids_of(ids, count)?))?;
        let g = s.store.geometry();
        let w = out_bytes(weights, ids.len() * g.w(), "weights")?;
        let sc = out_bytes(scales, ids.len() * g.s(), "scales")?;
        lift(s.store.lookup(&ids, w, sc))
    })
}

/// See `ft_rows_prefetch` in the header.
///
/// # Safety
/// Pointers must satisfy the header's contract for `ft_rows_prefetch`: NULL or
/// valid for the documented lengths, handles from `ft_rows_open*` not yet
/// closed.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ft_rows_prefetch(
    store: *mut FtRows,
    ids: *const i64,
    count: u64,
) -> c_int {
    guard(|| {
        let s = store_ref(store)?;
        let ids = lift(to_row_ids(ids_of(ids, count)?))?;
        lift(s.store.prefetch(&ids))
    })
}

/// See `ft_rows_prefetch_start` in the header.
///
/// # Safety
/// Pointers must satisfy the header's contract for `ft_rows_prefetch_start`:
/// NULL or valid for the documented lengths, handles from `ft_rows_open*`
/// not yet closed, `out` writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ft_rows_prefetch_start(
    store: *mut FtRows,
    ids: *const i64,
    count: u64,
    out: *mut *mut FtRowsPending,
) -> c_int {
    guard(|| {
        if out.is_null() {
            return Err(invalid("out is NULL"));
        }
        let s = store_ref(store)?;
        let ids = lift(to_row_ids(ids_of(ids, count)?))?;
        let pending = lift(s.store.prefetch_start(&ids))?;
        let raw = Box::into_raw(Box::new(FtRowsPending { pending }));
        // SAFETY: non-null (checked above); the header requires storage for
        // one pointer.
        unsafe { out.write(raw) };
        Ok(())
    })
}

/// Take back a prefetch handle C was given.
///
/// # Safety
/// `p` is NULL or a pointer returned by `ft_rows_prefetch_start` that has
/// not been taken back yet.
unsafe fn take_prefetch(p: *mut FtRowsPending) -> Option<Box<FtRowsPending>> {
    // SAFETY: non-null, so by this function's contract it came from
    // `Box::into_raw` in `ft_rows_prefetch_start` and is taken back once.
    (!p.is_null()).then(|| unsafe { Box::from_raw(p) })
}

/// See `ft_rows_prefetch_wait` in the header.
///
/// # Safety
/// `p` is NULL or a handle from `ft_rows_prefetch_start` not yet waited on
/// or abandoned; it is freed here.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ft_rows_prefetch_wait(p: *mut FtRowsPending) -> c_int {
    // SAFETY: the header requires `p` to be NULL or a handle not yet
    // waited on or abandoned.
    let handle = unsafe { take_prefetch(p) };
    guard(|| match handle {
        Some(h) => lift(h.pending.wait()),
        None => Ok(()),
    })
}

/// See `ft_rows_prefetch_abandon` in the header.
///
/// # Safety
/// `p` is NULL or a handle from `ft_rows_prefetch_start` not yet waited on
/// or abandoned; it is freed here.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ft_rows_prefetch_abandon(p: *mut FtRowsPending) {
    // SAFETY: as for `ft_rows_prefetch_wait`.
    let handle = unsafe { take_prefetch(p) };
    let _ = guard(|| {
        drop(handle);
        Ok(())
    });
}

/// See `ft_rows_stats` in the header.
///
/// # Safety
/// Pointers must satisfy the header's contract for `ft_rows_stats`: NULL or
/// valid for the documented lengths, handles from `ft_rows_open*` not yet
/// closed.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ft_rows_stats(store: *const FtRows, out: *mut FtRowsStats) -> c_int {
    guard(|| {
        let s = store_ref(store)?;
        if out.is_null() {
            return Err(invalid("out is NULL"));
        }
        let stats = FtRowsStats::from(&s.store.stats());
        // SAFETY: non-null; the header requires a writable ft_rows_stats_t.
        unsafe { out.write(stats) };
        Ok(())
    })
}

/// See `ft_rows_close` in the header.
///
/// # Safety
/// Pointers must satisfy the header's contract for `ft_rows_close`: NULL or
/// valid for the documented lengths, handles from `ft_rows_open*` not yet
/// closed.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ft_rows_close(store: *mut FtRows) {
    if store.is_null() {
        return;
    }
    let _ = guard(|| {
        // SAFETY: the handle came from `Box::into_raw` in `hand_out`, and the
        // header forbids using it after (or concurrently with) close.
        drop(unsafe { Box::from_raw(store) });
        Ok(())
    });
}

/// See `ft_rows_last_error` in the header.
///
/// # Safety
/// Pointers must satisfy the header's contract for `ft_rows_last_error`: NULL or
/// valid for the documented lengths, handles from `ft_rows_open*` not yet
/// closed.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ft_rows_last_error() -> *const c_char {
    last_error_ptr()
}
