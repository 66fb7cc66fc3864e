//! The mapped backing never serves bytes that were not verified where they
//! are served: a store scribbled, truncated or rewritten under a mapped pool
//! gives typed errors (checksum, truncation), and one replaced by rename keeps
//! serving the old, exact records.

use crate::store_faults;

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use flashtier::experts::{Backing, ExpertPool, ExpertsError};
use flashtier_io::{IoError, PosixBackend};
use store_faults::{
    PAYLOAD, make_cold, open_pool, record, record_offset, replace_by_rename, scribble, truncate,
    write_store,
};

fn posix() -> Arc<PosixBackend> {
    Arc::new(PosixBackend::new(2).expect("posix"))
}

/// One step over `recs`: acquire, plan, run, finish.
fn step(pool: &mut ExpertPool, recs: &[usize]) -> Result<(), ExpertsError> {
    let need = pool.acquire(recs)?;
    let run = pool.plan(&need).and_then(|plan| pool.run(plan));
    let fin = pool.finish();
    run.and(fin)
}

fn assert_exact(pool: &mut ExpertPool, r: usize) {
    let bytes = pool.bytes(r).expect("ready");
    assert!(bytes == record(1, r).as_slice(), "record {r} bytes differ");
}

fn assert_checksum_error(err: &ExpertsError, r: usize) {
    match err {
        ExpertsError::Checksum {
            record,
            offset,
            len,
            ..
        } => assert_eq!(
            (*record, *offset, *len),
            (r, record_offset(r), PAYLOAD),
            "{err}"
        ),
        other => panic!("expected a checksum error for record {r}, got: {other}"),
    }
    let msg = err.to_string();
    assert!(msg.contains("e.ftstore"), "names the file: {msg}");
    assert!(
        msg.contains(&format!("offset {}", record_offset(r))),
        "names the offset: {msg}"
    );
    assert!(msg.contains("length 3000"), "names the length: {msg}");
}

fn mapped_pool(path: &Path, capacity: u64) -> ExpertPool {
    open_pool(path, Backing::Mapped, capacity, posix()).expect("pool")
}

#[test]
fn a_record_scribbled_while_cached_is_refused_at_its_next_admission() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("e.ftstore");
    write_store(&path, 1);
    let mut p = mapped_pool(&path, 4);
    let (a, b) = (3, 5);
    step(&mut p, &[a, b]).expect("clean step");
    assert_exact(&mut p, a);
    // The record is resident in the pool and its pages in the page cache.
    scribble(&path, record_offset(a) + 100, 16);
    let err = step(&mut p, &[a, b]).expect_err("scribbled record refused");
    assert_checksum_error(&err, a);
    assert!(!p.is_ready(a), "a refused record is not resident");
    assert_exact(&mut p, b);
    assert!(matches!(p.bytes(a), Err(ExpertsError::NotResident { .. })));
    // Evicted and coming back: refused again, from the page cache or a read.
    for other in [8, 9, 10, 11] {
        step(&mut p, &[other]).expect("other records");
    }
    let err = step(&mut p, &[a]).expect_err("refused on re-entry");
    assert_checksum_error(&err, a);
    assert!(p.stats().failed_reads >= 2);
    p.check_invariants().expect("invariants");
}

#[test]
fn a_record_is_verified_in_the_map_not_in_its_scratch_read() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("e.ftstore");
    write_store(&path, 1);
    let mut p = mapped_pool(&path, 4);
    make_cold(&path, &p);
    let r = 6;
    let need = p.acquire(&[r]).expect("acquire");
    let plan = p.plan(&need).expect("plan");
    if plan.reads().is_empty() {
        flashtier_io::skip::notice(
            "a_record_is_verified_in_the_map_not_in_its_scratch_read",
            "the file system kept the store's pages cached (fadvise DONTNEED ignored)",
        );
        return;
    }
    let flags = p.run_tracked(plan).expect("start the read");
    let deadline = Instant::now() + Duration::from_secs(10);
    while !flags.iter().all(|(_, f)| f.is_landed()) {
        assert!(Instant::now() < deadline, "read never landed");
        std::thread::sleep(Duration::from_millis(1));
    }
    // The scratch copy holds the old bytes; the map now shows the new ones.
    scribble(&path, record_offset(r) + 2000, 8);
    let err = p.wait_ready(r).expect_err("the mapped bytes are checked");
    assert_checksum_error(&err, r);
    assert!(!p.is_ready(r));
    p.finish().expect("finish");
}

fn assert_truncated(err: &ExpertsError, r: usize, cut: u64) {
    match err {
        ExpertsError::Read {
            record,
            source:
                IoError::Truncated {
                    offset,
                    len,
                    file_bytes,
                    ..
                },
            ..
        } => assert_eq!(
            (*record, *offset, *len, *file_bytes),
            (r, record_offset(r), PAYLOAD, cut)
        ),
        other => panic!("expected a truncation error for record {r}, got: {other}"),
    }
    let msg = err.to_string();
    assert!(
        msg.contains("e.ftstore") && msg.contains(&format!("now {cut} bytes")),
        "{msg}"
    );
}

#[test]
fn a_store_truncated_under_a_mapped_pool_is_a_typed_error_not_sigbus() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("e.ftstore");
    write_store(&path, 1);
    let mut p = mapped_pool(&path, 6);
    let (low, cut_in_two, past_end) = (1, 14, 15);
    step(&mut p, &[low, cut_in_two, past_end]).expect("clean step");
    let cut = record_offset(cut_in_two) + 1000;
    truncate(&path, cut);
    // Hits on ready records, checked against the file's length first: the
    // last record's pages lie wholly past the end (touching them would raise
    // SIGBUS), the other's end is cut off (its tail would read as zeros).
    let err = step(&mut p, &[past_end]).expect_err("record past the end");
    assert_truncated(&err, past_end, cut);
    let err = step(&mut p, &[cut_in_two]).expect_err("record cut in two");
    assert_truncated(&err, cut_in_two, cut);
    assert!(!p.is_ready(past_end) && !p.is_ready(cut_in_two));
    // Records the file still covers are served exactly.
    step(&mut p, &[low]).expect("a covered record");
    assert_exact(&mut p, low);
    // A record past the end that was not resident: its read comes back short.
    let err = step(&mut p, &[past_end]).expect_err("past the end");
    assert!(
        matches!(
            &err,
            ExpertsError::Read {
                source: IoError::ShortRead { .. } | IoError::Truncated { .. },
                ..
            }
        ),
        "{err}"
    );
    // Cut below a ready record outside any step: `bytes` checks the length.
    let cut = record_offset(low);
    truncate(&path, cut);
    let err = p.bytes(low).expect_err("cut below a ready record");
    assert_truncated(&err, low, cut);
    p.check_invariants().expect("invariants");
}

#[test]
fn a_store_replaced_by_rename_keeps_serving_the_old_records() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("e.ftstore");
    write_store(&path, 1);
    let mut p = mapped_pool(&path, 4);
    step(&mut p, &[0, 1]).expect("clean step");
    replace_by_rename(&path, 2);
    // Hits, misses and re-entries all read the old inode.
    for recs in [[0, 1], [2, 3], [4, 5], [0, 1]] {
        step(&mut p, &recs).expect("the mapped inode is unchanged");
        for r in recs {
            assert_exact(&mut p, r);
        }
    }
    assert_eq!(p.stats().failed_reads, 0);
}

#[test]
fn a_settled_store_is_not_rechecked_until_it_changes() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("e.ftstore");
    write_store(&path, 1);
    // Past the settle window, equal timestamps mean an unchanged file.
    std::thread::sleep(flashtier_io::mapped::SETTLE + Duration::from_millis(100));
    let mut p = mapped_pool(&path, 4);
    step(&mut p, &[2, 7]).expect("clean step");
    for _ in 0..3 {
        step(&mut p, &[2, 7]).expect("hits");
    }
    assert_eq!(
        p.stats().rechecked_hits,
        0,
        "an unchanged store costs no re-check"
    );
    scribble(&path, record_offset(7), 1);
    let err = step(&mut p, &[2, 7]).expect_err("change noticed");
    assert_checksum_error(&err, 7);
    assert!(p.stats().rechecked_hits >= 2);
    assert_exact(&mut p, 2);
}
