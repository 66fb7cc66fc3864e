//! Unscaled BF16 tables (Qwen4-Exp's PLE n-gram shards): read from the
//! safetensors tensor directly or from a packed shard, every cache budget
//! (0 included) serves each row's exact bytes; a corrupted packed block is
//! an error, a table of the wrong dtype is refused naming it.

use std::os::unix::fs::FileExt;
use std::path::Path;

use flashtier::rows::pack::pack_shard;
use flashtier::rows::{RowError, RowStore, RowStoreConfig, TableSource};

const ROWS: u64 = 300;
const VALUES: u64 = 24;

/// A safetensors file holding `name`, `dtype` `[ROWS, VALUES]` of 2-byte
/// values (a padding tensor first, so the table does not start at 0);
/// returns the table's bytes.
fn write_table(path: &Path, name: &str, dtype: &str) -> Vec<u8> {
    let table: Vec<u8> = (0..ROWS * VALUES * 2)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 7) as u8)
        .collect();
    let pad = 6u64;
    let header = format!(
        "{{\"pad\":{{\"dtype\":\"U8\",\"shape\":[{pad}],\"data_offsets\":[0,{pad}]}},\
         \"{name}\":{{\"dtype\":\"{dtype}\",\"shape\":[{ROWS},{VALUES}],\"data_offsets\":[{pad},{}]}}}}",
        pad + table.len() as u64
    );
    let mut header = header.into_bytes();
    while header.len() % 8 != 0 {
        header.push(b' ');
    }
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(&header);
    bytes.extend_from_slice(&[0u8; 6]);
    bytes.extend_from_slice(&table);
    std::fs::write(path, bytes).expect("write table");
    table
}

fn lookup(store: &RowStore, ids: &[u64]) -> Result<Vec<u8>, RowError> {
    let mut w = vec![0u8; ids.len() * (VALUES as usize) * 2];
    store.lookup(ids, &mut w, &mut [])?;
    Ok(w)
}

fn expected(table: &[u8], ids: &[u64]) -> Vec<u8> {
    let row = (VALUES * 2) as usize;
    ids.iter()
        .flat_map(|&id| table[id as usize * row..(id as usize + 1) * row].to_vec())
        .collect()
}

#[test]
fn bf16_rows_are_exact_from_the_tensor_and_the_packed_shard_at_every_budget() {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("model.safetensors");
    let name = "model.layers.0.ple.ple_embedding.ngram_embedding.shard_1.weight";
    let table = write_table(&file, name, "BF16");
    let src = TableSource::safetensors_unscaled(dir.path(), name).expect("source");
    assert_eq!(src.rows, ROWS);
    assert_eq!(
        (src.geometry.weight_bytes, src.geometry.scale_bytes),
        (48, 0)
    );
    let shard = dir.path().join("l0s1.rows");
    pack_shard(&src, 0, 0, ROWS, &shard, &mut |_| {}).expect("pack");
    let ids: Vec<u64> = (0..200u64).map(|i| (i * 37 + i / 3) % ROWS).collect();
    let want = expected(&table, &ids);
    for cache_bytes in [0u64, 4096, 1 << 20] {
        let cfg = RowStoreConfig {
            cache_bytes,
            ..Default::default()
        };
        let packed = RowStore::open_packed(&shard, cfg.clone()).expect("open packed");
        let direct = RowStore::open(src.clone(), cfg).expect("open source");
        direct.set_range(0, ROWS).expect("range");
        for store in [&packed, &direct] {
            for _ in 0..2 {
                assert_eq!(
                    lookup(store, &ids).expect("lookup"),
                    want,
                    "cache {cache_bytes}"
                );
            }
        }
        let s = packed.stats();
        println!("cache {cache_bytes}: {s:?}");
    }
}

#[test]
fn a_corrupt_packed_block_and_a_wrong_dtype_are_errors() {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("model.safetensors");
    let table = write_table(&file, "t", "BF16");
    let src = TableSource::safetensors_unscaled(&file, "t").expect("source");
    let shard = dir.path().join("t.rows");
    let header = pack_shard(&src, 2, 0, ROWS, &shard, &mut |_| {}).expect("pack");
    // Flip one byte of row 0's block (the first block after the header).
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&shard)
        .expect("open");
    let at = header.data_offset();
    let mut b = [0u8; 1];
    f.read_exact_at(&mut b, at).expect("read");
    f.write_all_at(&[b[0] ^ 0x40], at).expect("write");
    let store = RowStore::open_packed(
        &shard,
        RowStoreConfig {
            cache_bytes: 0,
            ..Default::default()
        },
    )
    .expect("open");
    let err = lookup(&store, &[0]).expect_err("a corrupt block must fail");
    println!("refused as expected: {err}");
    assert_eq!(
        lookup(&store, &[ROWS - 1]).expect("other block"),
        expected(&table, &[ROWS - 1])
    );

    write_table(&file, "t", "I16");
    let err = TableSource::safetensors_unscaled(&file, "t").expect_err("I16");
    assert!(err.to_string().contains("tensor t is I16"), "{err}");
}
