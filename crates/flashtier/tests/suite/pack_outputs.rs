//! The row-shard packer and the low-bit companion writer never overwrite
//! their inputs or files of another kind, serialise concurrent writers of
//! one output, and leave no temp file when they fail.
#![allow(
    clippy::unwrap_used,
    reason = "tests: a failed setup step must fail the test loudly"
)]

use std::path::{Path, PathBuf};

use flashtier::experts::lowbit::{LowbitError, LowbitSpec};
use flashtier::experts::lowbit_pack::{companion_path, write_companion};
use flashtier::experts::testing::write_store;
use flashtier::rows::pack::{pack_shard, write_shard, write_synthetic_table};
use flashtier::rows::{RowError, RowGeometry, TableSource};
use flashtier_format::Store;
use flashtier_format::row_shard::RowShardHeader;
use flashtier_io::PersistError;
use flashtier_io::persist::Wait;

const G: RowGeometry = RowGeometry {
    weight_bytes: 256,
    scale_bytes: 8,
};

/// Names in `dir`, sorted.
fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

fn table(dir: &Path, rows: u64, seed: u64) -> TableSource {
    write_synthetic_table(&dir.join("table.bin"), rows, G, seed).unwrap()
}

fn pack(src: &TableSource, out: &Path) -> Result<RowShardHeader, RowError> {
    pack_shard(src, 0, 0, src.rows, out, &mut |_| {})
}

#[test]
fn pack_rows_refuses_its_own_table_by_path_symlink_or_hard_link() {
    let dir = tempfile::tempdir().unwrap();
    let src = table(dir.path(), 300, 1);
    let before = std::fs::read(&src.weights.path).unwrap();
    let sym = dir.path().join("sym.rows");
    std::os::unix::fs::symlink(&src.weights.path, &sym).unwrap();
    let hard = dir.path().join("hard.rows");
    std::fs::hard_link(&src.weights.path, &hard).unwrap();
    for out in [src.weights.path.clone(), sym, hard] {
        let err = pack(&src, &out).expect_err("the table as output must be refused");
        assert!(
            matches!(err, RowError::Persist(PersistError::OutputIsInput { .. })),
            "{err}"
        );
        assert!(err.to_string().contains("table.bin"), "{err}");
        assert_eq!(std::fs::read(&src.weights.path).unwrap(), before);
    }
    assert_eq!(names(dir.path()), ["hard.rows", "sym.rows", "table.bin"]);
}

#[test]
fn pack_rows_replaces_an_older_shard_but_no_other_file() {
    let dir = tempfile::tempdir().unwrap();
    let src = table(dir.path(), 300, 2);
    let out = dir.path().join("l0.rows");
    std::fs::write(&out, "not a shard\n").unwrap();
    let err = pack(&src, &out).expect_err("a text file must not be replaced");
    assert!(
        matches!(err, RowError::Persist(PersistError::NotReplaceable { .. })),
        "{err}"
    );
    assert!(err.to_string().contains("l0.rows"), "{err}");
    assert_eq!(std::fs::read(&out).unwrap(), b"not a shard\n");
    std::fs::remove_file(&out).unwrap();
    pack(&src, &out).unwrap();
    let first = std::fs::read(&out).unwrap();
    let h = pack_shard(&src, 0, 100, 200, &out, &mut |_| {}).unwrap();
    assert_eq!((h.lo, h.hi), (100, 200));
    assert_ne!(std::fs::read(&out).unwrap(), first);
    assert_eq!(names(dir.path()), ["l0.rows", "table.bin"]);
}

#[test]
fn concurrent_row_packs_of_one_output_equal_a_single_pack() {
    let dir = tempfile::tempdir().unwrap();
    let src = table(dir.path(), 40_000, 3);
    let single = dir.path().join("single.rows");
    pack(&src, &single).unwrap();
    let want = std::fs::read(&single).unwrap();
    let out = dir.path().join("l0.rows");
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..4).map(|_| s.spawn(|| pack(&src, &out))).collect();
        for h in handles {
            h.join().unwrap().unwrap();
        }
    });
    assert!(
        std::fs::read(&out).unwrap() == want,
        "not a single pack's shard"
    );
    assert_eq!(names(dir.path()), ["l0.rows", "single.rows", "table.bin"]);
}

#[test]
fn a_row_pack_failing_midway_leaves_no_temp_file_and_no_output() {
    let dir = tempfile::tempdir().unwrap();
    let out_dir = dir.path().join("out");
    std::fs::create_dir(&out_dir).unwrap();
    let out = out_dir.join("l0.rows");
    let header = RowShardHeader::new(0, 0, 100, 100, G.weight_bytes, G.scale_bytes).unwrap();
    let mut fill = |_: u64, _: u64, _: &mut Vec<u8>| -> Result<(), RowError> {
        Err(RowError::Config("the source failed".into()))
    };
    let err = write_shard(&out, header, Wait::Block, &mut fill, &mut |_| {}).unwrap_err();
    assert!(err.to_string().contains("the source failed"), "{err}");
    assert!(names(&out_dir).is_empty(), "{:?}", names(&out_dir));
}

fn exact_store(dir: &Path) -> PathBuf {
    let path = dir.join("experts.ftstore");
    write_store(&path, 2, 3, 512).unwrap();
    path
}

#[test]
fn a_companion_never_replaces_its_source_an_exact_store_or_another_file() {
    let dir = tempfile::tempdir().unwrap();
    let exact = exact_store(dir.path());
    let image = std::fs::read(&exact).unwrap();
    let spec = LowbitSpec::new(3, 64).unwrap();
    let companion = |out: &Path| write_companion(&exact, out, spec, &mut |_, _| {});
    let err = companion(&exact).expect_err("the source as output must be refused");
    assert!(
        matches!(
            err,
            LowbitError::Persist(PersistError::OutputIsInput { .. })
        ),
        "{err}"
    );
    let other = dir.path().join("other.ftstore");
    write_store(&other, 1, 2, 512).unwrap();
    let err = companion(&other).expect_err("an exact store must not be replaced");
    assert!(err.to_string().contains("exact expert store"), "{err}");
    let notes = dir.path().join("notes.q3.ftstore");
    std::fs::write(&notes, "notes\n").unwrap();
    let err = companion(&notes).expect_err("a text file must not be replaced");
    assert!(err.to_string().contains("notes.q3.ftstore"), "{err}");
    assert_eq!(std::fs::read(&notes).unwrap(), b"notes\n");
    assert_eq!(std::fs::read(&exact).unwrap(), image);
    // An older companion is replaced.
    let out = companion_path(&exact, 3);
    companion(&out).unwrap();
    let first = std::fs::read(&out).unwrap();
    companion(&out).unwrap();
    assert_eq!(std::fs::read(&out).unwrap(), first);
    assert_eq!(Store::open(&out).unwrap().record_count(), 6);
    assert_eq!(
        names(dir.path()),
        [
            "experts.ftstore",
            "experts.q3.ftstore",
            "notes.q3.ftstore",
            "other.ftstore"
        ]
    );
}
