//! Fault injection through the simulated backend: a failed read fails its
//! lookup with an error naming file and offset; short reads and latency
//! change nothing; and no fault ever turns into wrong bytes.

use crate::rows_support;

use std::sync::Arc;

use flashtier::rows::pack::pack_shard;
use flashtier::rows::{RowError, RowPool, RowStore, RowStoreConfig};
use flashtier_io::sim::{Fault, FaultPlan, OpKind, SimBackend};
use flashtier_io::{IoError, StorageBackend};
use rows_support::{G, Rng, check, reference, table};

const ROWS: u64 = 3000;

fn cfg(sim: SimBackend) -> RowStoreConfig {
    let backend: Arc<dyn StorageBackend> = Arc::new(sim);
    RowStoreConfig {
        backend: Some(backend),
        cache_bytes: 0,
        pool: Some(RowPool::new(4).expect("pool")),
        ..Default::default()
    }
}

#[test]
fn short_reads_and_latency_keep_rows_exact() {
    let dir = tempfile::tempdir().expect("tempdir");
    let src = table(dir.path(), ROWS);
    let plan = FaultPlan::seeded(11)
        .short_reads(1.0)
        .latency(0.1, std::time::Duration::from_micros(200));
    let store =
        RowStore::open(src.clone(), cfg(SimBackend::new(plan, 4).expect("sim"))).expect("open");
    store.set_range(0, ROWS).expect("range");
    let mut rng = Rng(3);
    for _ in 0..10 {
        check(&store, &rng.batch(100, ROWS));
    }
}

#[test]
fn eio_fails_the_lookup_and_never_serves_wrong_bytes() {
    let dir = tempfile::tempdir().expect("tempdir");
    let src = table(dir.path(), ROWS);
    let shard = dir.path().join("p.rows");
    pack_shard(&src, 0, 0, ROWS, &shard, &mut |_| {}).expect("pack");
    let plan = FaultPlan::seeded(12).read_eio(0.05);
    let store = RowStore::open(src, cfg(SimBackend::new(plan, 4).expect("sim"))).expect("open");
    // Attaching may itself hit a fault; retry until the header and table load.
    let mut attached = false;
    for _ in 0..50 {
        if store.set_range(0, ROWS).is_ok() && store.attach_packed(&shard, 0).is_ok() {
            attached = true;
            break;
        }
    }
    assert!(attached, "attach kept failing at a 5% fault rate");
    let mut rng = Rng(5);
    let (mut ok, mut failed) = (0, 0);
    for _ in 0..60 {
        let ids = rng.batch(40, ROWS);
        let mut w = vec![0u8; ids.len() * 256];
        let mut s = vec![0u8; ids.len() * 8];
        match store.lookup(&ids, &mut w, &mut s) {
            Ok(()) => {
                ok += 1;
                for (i, &id) in ids.iter().enumerate() {
                    let want = reference(id, 0, ROWS);
                    assert_eq!(&w[i * 256..(i + 1) * 256], &want[..256]);
                    assert_eq!(&s[i * 8..(i + 1) * 8], &want[256..]);
                }
            }
            Err(RowError::Io(IoError::Read { path, len, .. })) => {
                failed += 1;
                assert_eq!(path, shard);
                assert_eq!(len, 4096);
            }
            Err(e) => panic!("unexpected error {e}"),
        }
    }
    println!("{ok} batches served, {failed} failed by injected EIO");
    assert!(ok > 0 && failed > 0);
}

#[test]
fn nth_read_failure_is_reported_and_the_next_batch_recovers() {
    let dir = tempfile::tempdir().expect("tempdir");
    let src = table(dir.path(), ROWS);
    // Read 1 pins scales; read 3 is the second miss read.
    let plan = FaultPlan::seeded(13).fail_nth(OpKind::Read, 3, Fault::Eio);
    let store = RowStore::open(src, cfg(SimBackend::new(plan, 2).expect("sim"))).expect("open");
    store.set_range(0, ROWS).expect("range");
    check(&store, &[5]);
    let mut w = vec![0u8; 256];
    let mut s = vec![0u8; 8];
    let e = store
        .lookup(&[2900], &mut w, &mut s)
        .expect_err("the injected EIO");
    assert!(e.to_string().contains("table.bin"), "{e}");
    check(&store, &[2900, 7, 2900]);
    assert_eq!(G.stride(), 264);
}

#[test]
fn failed_prefetch_reports_on_wait_and_caches_nothing_wrong() {
    let dir = tempfile::tempdir().expect("tempdir");
    let src = table(dir.path(), ROWS);
    // Read 1 pins scales; read 2 is the first prefetch read.
    let plan = FaultPlan::seeded(14).fail_nth(OpKind::Read, 2, Fault::Eio);
    let store = RowStore::open(
        src,
        RowStoreConfig {
            cache_bytes: 1 << 20,
            ..cfg(SimBackend::new(plan, 4).expect("sim"))
        },
    )
    .expect("open");
    store.set_range(0, ROWS).expect("range");
    let ids = [40u64, 41, 2000, 2999];
    let started = store.prefetch_start(&ids).expect("submitted");
    let e = started.wait().expect_err("the injected EIO");
    assert!(e.to_string().contains("table.bin"), "{e}");
    // The failed row is read again by the lookup; every row is exact.
    check(&store, &ids);
    store
        .prefetch_start(&ids)
        .expect("start")
        .wait()
        .expect("all cached now");
}
