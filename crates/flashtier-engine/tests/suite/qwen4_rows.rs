//! Qwen4-Exp's PLE rows through the row store: packed once from the
//! checkpoint's n-gram shards, served at every cache budget (0 included)
//! with the same output bits as reading the checkpoint directly; the
//! counters show the cache working; a corrupted shard block is an error;
//! shards packed beforehand ([`pack_ple_rows`]) are the files the engine
//! opens, used as they are.
#![allow(
    clippy::unwrap_used,
    reason = "test helpers: a broken fixture must fail the test loudly"
)]

use crate::common;

use std::collections::BTreeMap;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::Path;

use flashtier_engine::Generation;
use flashtier_engine::family::qwen4::{PleRowOptions, Qwen4Model, pack_ple_rows};
use flashtier_engine::load::LoadOptions;
use flashtier_io::persist::Wait;

use common::{fixture, pack, reference};

const NEW_TOKENS: usize = 8;

fn generate(store: &std::path::Path, rows: Option<&PleRowOptions>) -> (Generation, Qwen4Model) {
    let dir = fixture("qwen4_exp");
    let r = reference(&dir);
    let mut m = Qwen4Model::open_with_rows(&dir, store, &LoadOptions::store(store), rows).unwrap();
    let out = m.generate(&r.prompt, NEW_TOKENS, &[], true).unwrap();
    (out, m)
}

#[test]
fn rows_from_the_row_store_give_the_same_bits_at_every_budget() {
    let dir = fixture("qwen4_exp");
    let r = reference(&dir);
    let tmp = tempfile::tempdir().unwrap();
    let store = pack(&dir, tmp.path()).out;
    let (want, plain) = generate(&store, None);
    assert_eq!(want.generated_ids, r.greedy);
    assert!(plain.row_stats().is_none() && want.decode_rows.is_none());
    let rows_dir = tmp.path().join("rows");
    // The tables: 6 shards of 16-byte rows, 1 to 2 blocks each.
    for budget in [0u64, 4096, 6 * 4096, 1 << 20] {
        let opts = PleRowOptions {
            dir: rows_dir.clone(),
            budget_bytes: budget,
        };
        let (got, m) = generate(&store, Some(&opts));
        assert_eq!(got.generated_ids, want.generated_ids, "budget {budget}");
        assert_eq!(got.prompt_logits, want.prompt_logits, "budget {budget}");
        let s = m.row_stats().unwrap();
        let d = got.decode_rows.unwrap();
        println!("budget {budget}: all {s:?}; decode {d:?}");
        assert_eq!(s.lookups, plain.ple_rows_read());
        assert!(d.lookups > 0 && d.lookups < s.lookups);
        if budget == 0 {
            assert_eq!(s.hits, 0, "no cache, no hits");
            assert!(
                s.misses > 0 && s.bytes_read >= 4096 * (NEW_TOKENS as u64),
                "{s:?}"
            );
        }
        if budget == 1 << 20 {
            // Every table fits: the decode steps' rows were read ahead
            // (prefetch) or cached before, and served from the cache.
            assert_eq!(d.hits, d.lookups, "{d:?}");
        }
    }
    let shards: Vec<_> = std::fs::read_dir(&rows_dir).unwrap().collect();
    assert_eq!(
        shards.len(),
        6,
        "one packed shard per PLE layer and table shard"
    );
}

#[test]
fn a_corrupt_row_shard_is_an_error_not_wrong_rows() {
    let dir = fixture("qwen4_exp");
    let r = reference(&dir);
    let tmp = tempfile::tempdir().unwrap();
    let store = pack(&dir, tmp.path()).out;
    let opts = PleRowOptions {
        dir: tmp.path().join("rows"),
        budget_bytes: 0,
    };
    generate(&store, Some(&opts));
    for entry in std::fs::read_dir(&opts.dir).unwrap() {
        let path = entry.unwrap().path();
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .unwrap();
        // Every row of the first block.
        for at in (4096..4096 + 2048).step_by(16) {
            f.write_all_at(&[0x5a], at).unwrap();
        }
    }
    let mut m =
        Qwen4Model::open_with_rows(&dir, &store, &LoadOptions::store(&store), Some(&opts)).unwrap();
    let err = m.generate(&r.prompt, 1, &[], false).unwrap_err();
    println!("refused as expected: {err}");
    assert!(err.to_string().contains("checksum"), "{err}");
}

/// Each file in `dir` by name: its inode and bytes.
fn files(dir: &Path) -> BTreeMap<String, (u64, Vec<u8>)> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let p = e.unwrap().path();
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            let ino = std::fs::metadata(&p).unwrap().ino();
            (name, (ino, std::fs::read(&p).unwrap()))
        })
        .collect()
}

/// `pack_ple_rows` writes exactly the files (names and bytes) the engine
/// packs for itself; a model opened on them reads them as they are (the
/// same inodes: nothing packed again) and decodes the same bits.
#[test]
fn shards_packed_beforehand_are_the_ones_the_engine_opens() {
    let dir = fixture("qwen4_exp");
    let tmp = tempfile::tempdir().unwrap();
    let store = pack(&dir, tmp.path()).out;
    let (want, _) = generate(&store, None);
    let packed_dir = tmp.path().join("packed");
    let mut last = (0, 0);
    let packed = pack_ple_rows(&dir, &packed_dir, Wait::Fail, &mut |done, total| {
        assert!(done <= total && done >= last.0, "{done} of {total}");
        last = (done, total);
    })
    .unwrap();
    assert_eq!(packed.len(), 6, "2 PLE layers of 3 shards");
    assert_eq!(last.0, last.1, "the progress ends at the total");
    assert_eq!(
        last.1,
        packed.iter().map(|(s, _)| s.table_bytes).sum::<u64>()
    );
    let before = files(&packed_dir);
    let auto = PleRowOptions {
        dir: tmp.path().join("auto"),
        budget_bytes: 0,
    };
    generate(&store, Some(&auto));
    let auto_files = files(&auto.dir);
    assert_eq!(
        before.keys().collect::<Vec<_>>(),
        auto_files.keys().collect::<Vec<_>>()
    );
    for (name, (_, bytes)) in &before {
        assert_eq!(&auto_files[name].1, bytes, "{name}");
    }
    let opts = PleRowOptions {
        dir: packed_dir.clone(),
        budget_bytes: 0,
    };
    let (got, _) = generate(&store, Some(&opts));
    assert_eq!(
        files(&packed_dir),
        before,
        "the packed shards were used as they are"
    );
    assert_eq!(got.generated_ids, want.generated_ids);
    assert_eq!(got.prompt_logits, want.prompt_logits);
}
