//! Every way a packed shard can fail to match: each is an error, and no row
//! of such a shard is ever served. A missing shard falls back to the source.

use crate::rows_support;

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use flashtier::rows::pack::pack_shard;
use flashtier::rows::{RowError, RowGeometry, RowStore, RowStoreConfig, TableSource};
use flashtier_format::row_shard::RowShardError;
use rows_support::{Rng, check, table};

const ROWS: u64 = 2000;
const LO: u64 = 500;
const HI: u64 = 1500;

struct Fixture {
    _dir: tempfile::TempDir,
    src: TableSource,
    shard: PathBuf,
}

fn fixture() -> Fixture {
    let dir = tempfile::tempdir().expect("tempdir");
    let src = table(dir.path(), ROWS);
    let shard = dir.path().join("l3.rows");
    pack_shard(&src, 3, LO, HI, &shard, &mut |_| {}).expect("pack");
    Fixture {
        src,
        shard,
        _dir: dir,
    }
}

fn store(f: &Fixture, lo: u64, hi: u64) -> RowStore {
    let s = RowStore::open(f.src.clone(), RowStoreConfig::default()).expect("open");
    s.set_range(lo, hi).expect("range");
    s
}

fn copy_of(f: &Fixture, name: &str) -> PathBuf {
    let p = f.shard.with_file_name(name);
    std::fs::copy(&f.shard, &p).expect("copy");
    p
}

fn flip(path: &Path, offset: u64) {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .expect("open");
    let mut b = [0u8; 1];
    file.read_exact_at(&mut b, offset).expect("read");
    b[0] ^= 0x10;
    file.write_all_at(&b, offset).expect("write");
}

fn shard_err(r: Result<bool, RowError>) -> RowShardError {
    match r {
        Err(RowError::Shard(e)) => {
            println!("refused as expected: {e}");
            e
        }
        other => panic!("expected a shard error, got {other:?}"),
    }
}

#[test]
fn matching_shard_serves_exact_rows() {
    let f = fixture();
    let s = store(&f, LO, HI);
    assert!(s.attach_packed(&f.shard, 3).expect("attach"));
    let mut rng = Rng(7);
    for _ in 0..10 {
        check(&s, &rng.batch(150, ROWS));
    }
    assert!(s.stats().packed);
}

#[test]
fn wrong_layer_is_refused() {
    let f = fixture();
    let e = shard_err(store(&f, LO, HI).attach_packed(&f.shard, 4));
    assert!(matches!(
        e,
        RowShardError::Mismatch {
            field: "layer",
            expected: 4,
            found: 3,
            ..
        }
    ));
}

#[test]
fn wrong_range_is_refused() {
    let f = fixture();
    let e = shard_err(store(&f, LO + 1, HI).attach_packed(&f.shard, 3));
    assert!(matches!(e, RowShardError::Mismatch { field: "lo", .. }));
    let e = shard_err(store(&f, LO, HI + 1).attach_packed(&f.shard, 3));
    assert!(matches!(e, RowShardError::Mismatch { field: "hi", .. }));
}

#[test]
fn wrong_table_or_geometry_is_refused() {
    let f = fixture();
    let bigger = rows_support::table(f.shard.parent().expect("dir"), ROWS + 1);
    let s = RowStore::open(bigger, RowStoreConfig::default()).expect("open");
    s.set_range(LO, HI).expect("range");
    assert!(matches!(
        shard_err(s.attach_packed(&f.shard, 3)),
        RowShardError::Mismatch { field: "rows", .. }
    ));
    let g = RowGeometry {
        weight_bytes: 128,
        scale_bytes: 8,
    };
    let raw = TableSource::raw(&f.src.weights.path, ROWS, 0, 0, g).expect("fits");
    let s = RowStore::open(raw, RowStoreConfig::default()).expect("open");
    s.set_range(LO, HI).expect("range");
    let e = shard_err(s.attach_packed(&f.shard, 3));
    assert!(matches!(
        e,
        RowShardError::Mismatch {
            field: "row_weight_bytes",
            ..
        }
    ));
}

#[test]
fn truncated_shard_is_refused() {
    let f = fixture();
    for keep in [0u64, 100, 4096, 8192 + 17] {
        let p = copy_of(&f, &format!("cut{keep}.rows"));
        std::fs::OpenOptions::new()
            .write(true)
            .open(&p)
            .expect("open")
            .set_len(keep)
            .expect("truncate");
        let e = shard_err(store(&f, LO, HI).attach_packed(&p, 3));
        assert!(
            matches!(
                e,
                RowShardError::TooShort { .. } | RowShardError::Truncated { .. }
            ),
            "cut at {keep}: {e}"
        );
    }
    // Cut just the end of the checksum table.
    let p = copy_of(&f, "cut-end.rows");
    let len = std::fs::metadata(&p).expect("stat").len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&p)
        .expect("open")
        .set_len(len - 1)
        .expect("truncate");
    assert!(matches!(
        shard_err(store(&f, LO, HI).attach_packed(&p, 3)),
        RowShardError::Truncated { .. }
    ));
}

#[test]
fn corrupt_header_or_checksum_table_is_refused() {
    let f = fixture();
    let p = copy_of(&f, "hdr.rows");
    flip(&p, 30); // inside `lo`
    assert!(matches!(
        shard_err(store(&f, LO, HI).attach_packed(&p, 3)),
        RowShardError::HeaderChecksum { .. }
    ));
    let p = copy_of(&f, "magic.rows");
    flip(&p, 0);
    assert!(matches!(
        shard_err(store(&f, LO, HI).attach_packed(&p, 3)),
        RowShardError::BadMagic { .. }
    ));
    let p = copy_of(&f, "sums.rows");
    let blocks = (HI - LO).div_ceil(15);
    flip(&p, 4096 + blocks * 4096 + 5);
    assert!(matches!(
        shard_err(store(&f, LO, HI).attach_packed(&p, 3)),
        RowShardError::ChecksumTable { .. }
    ));
}

#[test]
fn corrupt_row_block_is_never_served() {
    let f = fixture();
    let p = copy_of(&f, "rot.rows");
    // Row LO + 20 is block 1, slot 5: flip a byte of its weight.
    flip(&p, 4096 + 4096 + 5 * 264 + 3);
    let s = store(&f, LO, HI);
    assert!(s.attach_packed(&p, 3).expect("header and table are intact"));
    let mut w = vec![0u8; 3 * 256];
    let mut sc = vec![0u8; 3 * 8];
    match s.lookup(&[LO, LO + 20, LO + 400], &mut w, &mut sc) {
        Err(RowError::Shard(RowShardError::BlockChecksum { block, offset, .. })) => {
            assert_eq!((block, offset), (1, 8192));
        }
        other => panic!("expected a block checksum error, got {other:?}"),
    }
    // Another row of the same block is refused too; other blocks still serve.
    assert!(s.lookup(&[LO + 16], &mut w[..256], &mut sc[..8]).is_err());
    check(&s, &[LO, LO + 400, HI - 1]);
}

#[test]
fn missing_shard_falls_back_to_the_source() {
    let f = fixture();
    let s = store(&f, LO, HI);
    let missing = f.shard.with_file_name("nope.rows");
    assert!(!s.attach_packed(&missing, 3).expect("missing is fine"));
    assert!(!s.stats().packed);
    check(&s, &[LO, LO + 1, HI - 1, 0, ROWS - 1]);
}

#[test]
fn range_is_fixed_once_a_shard_is_attached() {
    let f = fixture();
    let s = RowStore::open(
        f.src.clone(),
        RowStoreConfig {
            pin_scales: false,
            ..Default::default()
        },
    )
    .expect("open");
    s.set_range(LO, HI).expect("range");
    s.set_range(LO, HI + 1).expect("nothing pinned yet");
    s.set_range(LO, HI).expect("back");
    assert!(s.attach_packed(&f.shard, 3).expect("attach"));
    assert!(matches!(
        s.set_range(0, ROWS),
        Err(RowError::RangeFixed { .. })
    ));
}
