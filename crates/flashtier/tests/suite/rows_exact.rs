//! Exactness of `RowStore::lookup` against a naive reference, over random
//! batches with out-of-range, non-owned and repeated ids, in every serving
//! configuration.

use crate::rows_support;

use std::sync::Arc;

use flashtier::rows::pack::pack_shard;
use flashtier::rows::{RowError, RowPool, RowStore, RowStoreConfig, TableSource};
use flashtier_io::DirectMode;
use rows_support::{G, Rng, SEED, check, reference, table};

const ROWS: u64 = 3000;

fn configs() -> Vec<(&'static str, RowStoreConfig)> {
    let pool = RowPool::new(4).expect("pool");
    // Most configurations read buffered to keep the suite fast on a busy
    // disk; three read with O_DIRECT (the default policy).
    let base = RowStoreConfig {
        pool: Some(pool),
        direct: DirectMode::Off,
        ..Default::default()
    };
    vec![
        (
            "no cache, direct",
            RowStoreConfig {
                cache_bytes: 0,
                direct: DirectMode::Prefer,
                ..base.clone()
            },
        ),
        (
            "tiny cache 1-way",
            RowStoreConfig {
                cache_bytes: 16 << 10,
                ways: 1,
                ..base.clone()
            },
        ),
        (
            "cache 16-way, direct",
            RowStoreConfig {
                cache_bytes: 256 << 10,
                ways: 16,
                direct: DirectMode::Prefer,
                ..base.clone()
            },
        ),
        (
            "unpinned scales",
            RowStoreConfig {
                pin_scales: false,
                ..base.clone()
            },
        ),
        (
            "default cache, direct",
            RowStoreConfig {
                direct: DirectMode::Prefer,
                ..base.clone()
            },
        ),
        (
            "all inline",
            RowStoreConfig {
                inline_below: usize::MAX,
                ..base.clone()
            },
        ),
        (
            "io_uring (or posix) submit mode, direct",
            RowStoreConfig {
                backend: Some(std::sync::Arc::from(
                    flashtier_io::open_backend(flashtier_io::BackendKind::Uring, 16)
                        .expect("backend"),
                )),
                direct: DirectMode::Prefer,
                cache_bytes: 64 << 10,
                ..base.clone()
            },
        ),
        (
            "always pooled",
            RowStoreConfig {
                inline_below: 0,
                cache_bytes: 32 << 10,
                ..base
            },
        ),
    ]
}

fn exercise(store: &RowStore, rng: &mut Rng) {
    for round in 0..16 {
        let len = 1 + rng.below(if round % 5 == 0 { 400 } else { 60 }) as usize;
        check(store, &rng.batch(len, ROWS));
    }
    // Out of range: an error naming the id and its position, nothing written.
    let mut ids = rng.batch(20, ROWS);
    ids[7] = ROWS + 5;
    let mut w = vec![0xAAu8; ids.len() * 256];
    let mut s = vec![0xAAu8; ids.len() * 8];
    match store.lookup(&ids, &mut w, &mut s) {
        Err(RowError::IdOutOfRange { id, index, rows }) => {
            assert_eq!((id, index, rows), (ROWS + 5, 7, ROWS))
        }
        other => panic!("expected IdOutOfRange, got {other:?}"),
    }
    assert!(
        w.iter().chain(&s).all(|&b| b == 0xAA),
        "a failed batch writes nothing"
    );
    assert!(store.prefetch(&[ROWS]).is_err());
    // Wrong buffer sizes.
    assert!(matches!(
        store.lookup(&[1], &mut [0u8; 255], &mut [0u8; 8]),
        Err(RowError::BufferSize { .. })
    ));
}

#[test]
fn random_batches_match_the_reference_in_every_configuration() {
    let dir = tempfile::tempdir().expect("tempdir");
    let src = table(dir.path(), ROWS);
    let packed = dir.path().join("rank1.rows");
    pack_shard(&src, 4, 1000, 2500, &packed, &mut |_| {}).expect("pack");
    let seed = 0x1234_5678u64;
    println!("batch seed {seed:#x}");
    for (name, cfg) in configs() {
        println!("configuration: {name}");
        let store = RowStore::open(src.clone(), cfg.clone()).expect("open");
        let mut rng = Rng(seed);
        exercise(&store, &mut rng); // whole table owned, nothing pinned
        store.set_range(1000, 2500).expect("range");
        exercise(&store, &mut rng);
        assert!(store.attach_packed(&packed, 4).expect("attach"));
        assert!(store.stats().packed);
        exercise(&store, &mut rng);
        let only = RowStore::open_packed(&packed, cfg).expect("packed only");
        assert_eq!(only.range(), (1000, 2500));
        exercise(&only, &mut rng);
    }
}

#[test]
fn repeated_ids_are_read_once() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = RowStore::open(
        table(dir.path(), ROWS),
        RowStoreConfig {
            cache_bytes: 0,
            ..Default::default()
        },
    )
    .expect("open");
    store.set_range(0, ROWS).expect("range");
    let ids = vec![42u64; 100];
    check(&store, &ids);
    let st = store.stats();
    assert_eq!((st.misses, st.reads, st.deduplicated), (1, 1, 99));
    // Rows in one 4 KiB page share a read too: rows 16..32 are page 1.
    check(&store, &(16..32).collect::<Vec<_>>());
    assert_eq!(store.stats().reads, 2);
}

#[test]
fn prefetch_warms_what_the_next_lookup_needs() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = RowStore::open(table(dir.path(), ROWS), RowStoreConfig::default()).expect("open");
    store.set_range(0, 2000).expect("range");
    let hasher = flashtier::rows::EngramHasher::new(
        flashtier::rows::EngramHashConfig::with_primes(4, 300, 9),
    )
    .expect("hasher");
    assert!(hasher.total_rows() <= ROWS);
    let ids = hasher.ids(&[17, 4, 99, 17, 4]);
    store.prefetch(&ids).expect("prefetch");
    let before = store.stats();
    check(&store, &ids);
    let after = store.stats();
    assert_eq!(
        after.misses, before.misses,
        "every owned row was prefetched"
    );
    let owned = ids.iter().filter(|&&id| id < 2000).count() as u64;
    assert_eq!(after.hits - before.hits, owned);
}

/// One caller with the next batch's prefetch in flight while it looks up
/// the current one (Engram's order), on the pool and on a queued backend:
/// every lookup is exact, a waited prefetch leaves nothing to read, and an
/// abandoned one changes nothing but the cache.
#[test]
fn prefetch_start_runs_ahead_of_lookups_and_stays_exact() {
    let dir = tempfile::tempdir().expect("tempdir");
    let src = table(dir.path(), ROWS);
    let queued: Arc<dyn flashtier_io::StorageBackend> = Arc::from(
        flashtier_io::open_backend(flashtier_io::BackendKind::Uring, 16).expect("backend"),
    );
    for backend in [None, Some(queued)] {
        let store = RowStore::open(
            src.clone(),
            RowStoreConfig {
                cache_bytes: 4 << 20,
                backend,
                pool: Some(RowPool::new(4).expect("pool")),
                ..Default::default()
            },
        )
        .expect("open");
        store.set_range(100, 2500).expect("range");
        let mut rng = Rng(21);
        let mut next = rng.batch(150, ROWS);
        let mut ahead = store.prefetch_start(&next).expect("start");
        for _ in 0..12 {
            let now = std::mem::replace(&mut next, rng.batch(150, ROWS));
            let following = store.prefetch_start(&next).expect("start");
            ahead.wait().expect("prefetch");
            let before = store.stats();
            check(&store, &now);
            assert_eq!(
                store.stats().misses,
                before.misses,
                "the waited prefetch cached every owned row of the batch"
            );
            ahead = following;
        }
        // Abandon the last one: the store stays exact and serves it anyway.
        drop(ahead);
        check(&store, &next);
        assert!(matches!(
            store.prefetch_start(&[ROWS]),
            Err(RowError::IdOutOfRange {
                id: ROWS,
                index: 0,
                ..
            })
        ));
        // Nothing to prefetch (all cached or not owned): a no-op handle.
        store
            .prefetch_start(&[0, 1, next[0]])
            .expect("start")
            .wait()
            .expect("wait");
    }
}

#[test]
fn weights_at_the_end_of_an_unaligned_file() {
    // Scales first, weights last: the last rows' aligned window runs past
    // the end of the file and must still come back exact.
    let dir = tempfile::tempdir().expect("tempdir");
    let rows = 37u64;
    let mut bytes = Vec::new();
    for id in 0..rows {
        bytes.extend_from_slice(&reference(id, 0, rows)[256..]);
    }
    for id in 0..rows {
        bytes.extend_from_slice(&reference(id, 0, rows)[..256]);
    }
    let path = dir.path().join("tail.bin");
    std::fs::write(&path, &bytes).expect("write");
    let src = TableSource::raw(&path, rows, rows * 8, 0, G).expect("source");
    let store = RowStore::open(src, RowStoreConfig::default()).expect("open");
    let ids: Vec<u64> = (0..rows).rev().collect();
    check(&store, &ids);
    store.set_range(0, rows).expect("range");
    let store2 = RowStore::open(
        TableSource::raw(&path, rows, rows * 8, 0, G).expect("source"),
        RowStoreConfig::default(),
    )
    .expect("open");
    check(&store2, &ids);
}

#[test]
fn ram_mode_is_exact_or_names_the_memlock_limit() {
    let dir = tempfile::tempdir().expect("tempdir");
    let cfg = RowStoreConfig {
        ram_mode: true,
        ..Default::default()
    };
    match RowStore::open(table(dir.path(), ROWS), cfg) {
        Ok(store) => {
            store.set_range(500, 1500).expect("range");
            assert!(store.stats().ram_mode);
            let mut rng = Rng(SEED);
            for _ in 0..10 {
                check(&store, &rng.batch(200, ROWS));
            }
            assert!(store.attach_packed(&dir.path().join("x"), 0).is_err());
        }
        Err(RowError::Lock(e)) => {
            let msg = e.to_string();
            println!("RAM mode refused here: {msg}");
            assert!(msg.contains("RLIMIT_MEMLOCK"), "{msg}");
        }
        Err(e) => panic!("unexpected error {e}"),
    }
}

#[test]
fn safetensors_source_pack_and_dequant() {
    use flashtier::rows::fp8::dequant_row_f32;
    use flashtier::rows::source::write_safetensors;
    use flashtier_format::fp8::e4m3_to_f32;
    let dir = tempfile::tempdir().expect("tempdir");
    let rows = 500u64;
    let (mut w, mut s) = (Vec::new(), Vec::new());
    for id in 0..rows {
        let r = reference(id, 0, rows);
        w.extend_from_slice(&r[..256]);
        s.extend_from_slice(&r[256..]);
    }
    let model = dir.path().join("model");
    std::fs::create_dir(&model).expect("mkdir");
    write_safetensors(
        &model.join("model-00001.safetensors"),
        &[
            ("layers.2.engram.weight", "F8_E4M3", vec![rows, 256], &w),
            ("layers.2.engram.scale", "F32", vec![rows, 2], &s),
        ],
    )
    .expect("write");
    let src = TableSource::safetensors(&model, "layers.2.engram.weight", "layers.2.engram.scale")
        .expect("source");
    let store = RowStore::open(src.clone(), RowStoreConfig::default()).expect("open");
    let (lo, hi) = flashtier::rows::owned_range(rows, 1, 2).expect("range");
    store.set_range(lo, hi).expect("range");
    let shard = dir.path().join("l2.rows");
    pack_shard(&src, 2, lo, hi, &shard, &mut |_| {}).expect("pack");
    assert!(store.attach_packed(&shard, 2).expect("attach"));
    let ids: Vec<u64> = (0..rows).step_by(7).collect();
    check(&store, &ids);
    let mut ow = vec![0u8; 256];
    let mut os = vec![0u8; 8];
    store.lookup(&[hi - 1], &mut ow, &mut os).expect("lookup");
    let mut out = vec![0f32; 256];
    dequant_row_f32(&ow, &os, src.scale_format, &mut out).expect("dequant");
    let sc = [
        f32::from_le_bytes(os[..4].try_into().expect("4")),
        f32::from_le_bytes(os[4..].try_into().expect("4")),
    ];
    for (i, v) in out.iter().enumerate() {
        let want = e4m3_to_f32(ow[i]) * sc[i / 128];
        assert!(v.to_bits() == want.to_bits() || (v.is_nan() && want.is_nan()));
    }
}

#[test]
fn ranges_are_validated_and_fixed_once_scales_are_pinned() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = RowStore::open(table(dir.path(), ROWS), RowStoreConfig::default()).expect("open");
    assert!(matches!(
        store.set_range(10, 5),
        Err(RowError::InvalidRange { .. })
    ));
    assert!(matches!(
        store.set_range(0, ROWS + 1),
        Err(RowError::InvalidRange { .. })
    ));
    store.set_range(100, 200).expect("range");
    assert_eq!(store.stats().scales_bytes, 800);
    store.set_range(100, 200).expect("same range again");
    assert!(matches!(
        store.set_range(0, 100),
        Err(RowError::RangeFixed { .. })
    ));
    check(&store, &[99, 100, 150, 199, 200]);
    let _ = Arc::new(0);
}

/// A table without scales (`scale_bytes: 0`) and one with odd sizes are
/// served exactly through the cache: hits and misses alike.
#[test]
fn other_geometries_are_exact_through_the_cache() {
    let dir = tempfile::tempdir().expect("tempdir");
    for (k, g) in [
        flashtier::rows::RowGeometry {
            weight_bytes: 100,
            scale_bytes: 0,
        },
        flashtier::rows::RowGeometry {
            weight_bytes: 37,
            scale_bytes: 5,
        },
    ]
    .into_iter()
    .enumerate()
    {
        let path = dir.path().join(format!("t{k}.bin"));
        let src = flashtier::rows::pack::write_synthetic_table(&path, 500, g, 9).expect("table");
        let store = RowStore::open(
            src,
            RowStoreConfig {
                cache_bytes: 1 << 20,
                pool: Some(RowPool::new(2).expect("pool")),
                ..Default::default()
            },
        )
        .expect("open");
        let ids: Vec<u64> = (0..120u64).map(|i| (i * 41) % 500).collect();
        for round in 0..2 {
            let (mut w, mut s) = (
                vec![0xAAu8; ids.len() * g.w()],
                vec![0xAAu8; ids.len() * g.s()],
            );
            store.lookup(&ids, &mut w, &mut s).expect("lookup");
            for (i, &id) in ids.iter().enumerate() {
                let mut row = vec![0u8; g.stride()];
                flashtier::rows::pack::synthetic_row(9, id, g, &mut row);
                assert_eq!(
                    &w[i * g.w()..(i + 1) * g.w()],
                    &row[..g.w()],
                    "{g:?} round {round} id {id}"
                );
                assert_eq!(
                    &s[i * g.s()..(i + 1) * g.s()],
                    &row[g.w()..],
                    "{g:?} round {round} id {id}"
                );
            }
        }
        assert!(
            store.stats().hits >= ids.len() as u64,
            "{g:?}: the second round hits"
        );
    }
}
