//! Eight threads looking up at once through a small, constantly evicting
//! cache: every row comes back whole and exact (no torn rows).

use crate::rows_support;

use std::sync::Arc;

use flashtier::rows::pack::pack_shard;
use flashtier::rows::{RowPool, RowStore, RowStoreConfig};
use rows_support::{Rng, check, table};

const ROWS: u64 = 4000;

fn hammer(store: &Arc<RowStore>) {
    std::thread::scope(|scope| {
        for t in 0..8u64 {
            let store = store.clone();
            scope.spawn(move || {
                let mut rng = Rng(0xC0FFEE + t);
                for round in 0..30 {
                    let len = if round % 10 == 0 {
                        300
                    } else {
                        1 + rng.below(64) as usize
                    };
                    check(&store, &rng.batch(len, ROWS));
                }
            });
        }
    });
}

#[test]
fn eight_threads_never_see_a_torn_row() {
    let dir = tempfile::tempdir().expect("tempdir");
    let src = table(dir.path(), ROWS);
    let shard = dir.path().join("s.rows");
    pack_shard(&src, 0, 1000, 3500, &shard, &mut |_| {}).expect("pack");
    let pool = RowPool::new(6).expect("pool");
    for ways in [1usize, 16] {
        // ~100 slots for 2500 owned rows: nearly every miss evicts a row
        // other threads are reading. Buffered reads: this test is about the
        // cache under concurrency, and the page cache keeps its thousands of
        // misses fast (the direct path is covered in rows_exact).
        let cfg = RowStoreConfig {
            cache_bytes: 28 << 10,
            ways,
            pool: Some(pool.clone()),
            inline_below: 4,
            direct: flashtier_io::DirectMode::Off,
            ..Default::default()
        };
        let store = Arc::new(RowStore::open(src.clone(), cfg.clone()).expect("open"));
        store.set_range(1000, 3500).expect("range");
        hammer(&store);
        assert!(store.attach_packed(&shard, 0).expect("attach"));
        hammer(&store);
        let st = store.stats();
        println!("ways {ways}: {st:?}");
        assert!(st.hits > 0 && st.misses > 0);
    }
}
