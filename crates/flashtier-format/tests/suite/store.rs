//! Store files end to end in memory: round trips, each corruption's typed
//! error, and a proptest-driven fuzz of the header + manifest parser.

use std::path::Path;

use flashtier_format::{
    Dtype, FormatError, HEADER_BYTES, Manifest, RecordKey, Store, StoreKind, StoreWriterPlan,
};
use proptest::prelude::*;

fn path() -> &'static Path {
    Path::new("mem.ftstore")
}

fn keys(n: u32) -> Vec<RecordKey> {
    (0..n).map(|i| RecordKey::new(i / 4, i % 4)).collect()
}

fn sample_image(records: u32, payload: u64) -> (Vec<u8>, Vec<Vec<u8>>) {
    let m = Manifest::single_tensor(StoreKind::Experts, Dtype::U8, payload, keys(records));
    let plan = StoreWriterPlan::new(m).expect("plan");
    let recs: Vec<Vec<u8>> = (0..records)
        .map(|r| {
            (0..payload)
                .map(|i| (i as u32 ^ r.wrapping_mul(97)) as u8)
                .collect()
        })
        .collect();
    (plan.image(&recs).expect("image"), recs)
}

#[test]
fn every_record_reads_back_and_verifies() {
    let (image, recs) = sample_image(9, 5000);
    let store = Store::from_bytes(path(), &image).expect("open");
    assert_eq!(store.record_count(), 9);
    assert_eq!(store.stride_bytes(), 8192);
    for (i, want) in recs.iter().enumerate() {
        let i = i as u64;
        let key = store.key_of(i).expect("key");
        assert_eq!(store.index_of(key).expect("index"), i);
        let mut buf = vec![0u8; 5000];
        store.read_record(&image[..], i, &mut buf).expect("read");
        assert_eq!(&buf, want);
    }
    assert!(matches!(
        store.record_offset(9),
        Err(FormatError::RecordOutOfRange { .. })
    ));
    assert!(matches!(
        store.index_of(RecordKey::new(99, 0)),
        Err(FormatError::KeyNotFound { .. })
    ));
    assert!(matches!(
        store.expect_kind(StoreKind::Kv),
        Err(FormatError::WrongKind { .. })
    ));
}

/// `Store::open` of a FIFO fails at once, naming the path, instead of
/// blocking until a writer opens the pipe; a device and a directory are
/// refused the same way.
#[test]
fn a_fifo_device_or_directory_is_no_store() {
    use flashtier_format::OpenError;
    let dir = tempfile::tempdir().expect("tempdir");
    let fifo = dir.path().join("pipe.ftstore");
    rustix::fs::mkfifoat(
        rustix::fs::CWD,
        &fifo,
        rustix::fs::Mode::from_raw_mode(0o600),
    )
    .expect("mkfifo");
    let (tx, rx) = std::sync::mpsc::channel();
    let p = fifo.clone();
    std::thread::spawn(move || {
        let _ = tx.send(Store::open(&p).map(|_| ()));
    });
    let err = rx
        .recv_timeout(std::time::Duration::from_secs(5))
        .expect("Store::open blocked on a FIFO")
        .expect_err("a FIFO");
    assert!(
        matches!(
            err,
            FormatError::Open(OpenError::NotRegular { ref path, what: "a FIFO (named pipe)" })
                if *path == fifo
        ),
        "{err}"
    );
    assert!(err.to_string().contains("pipe.ftstore is a FIFO"), "{err}");
    for (path, what) in [
        (Path::new("/dev/null"), "a character device"),
        (dir.path(), "a directory"),
    ] {
        let err = Store::open(path).expect_err("not a store");
        assert!(
            matches!(err, FormatError::Open(OpenError::NotRegular { what: w, .. }) if w == what),
            "{err}"
        );
    }
    let err = Store::open(&dir.path().join("absent")).expect_err("absent");
    assert!(
        matches!(err, FormatError::Open(OpenError::Os { .. })),
        "{err}"
    );
}

/// A wrong magic is shown as hex bytes, not as a Rust array.
#[test]
fn a_bad_magic_is_named_in_hex() {
    let (mut image, _) = sample_image(1, 64);
    image[..8].copy_from_slice(b"NOTSTORE");
    let err = Store::from_bytes(path(), &image).expect_err("bad magic");
    let msg = err.to_string();
    assert!(
        msg.contains("magic 4e 4f 54 53 54 4f 52 45, expected FTSTORE\\0"),
        "{msg}"
    );
}

#[test]
fn a_flipped_record_byte_names_index_and_key() {
    let (mut image, _) = sample_image(6, 4096);
    let store = Store::from_bytes(path(), &image).expect("open");
    let off = store.record_offset(5).expect("offset") as usize;
    image[off + 17] ^= 0x40;
    let mut buf = vec![0u8; 4096];
    let err = store
        .read_record(&image[..], 5, &mut buf)
        .expect_err("corrupt");
    let msg = err.to_string();
    assert!(
        matches!(err, FormatError::RecordChecksum { index: 5, .. }),
        "{msg}"
    );
    assert!(
        msg.contains("layer=1 item=1") && msg.contains("mem.ftstore"),
        "{msg}"
    );
    let err = store.verify_record(0, &buf[..100]).expect_err("short");
    assert!(matches!(err, FormatError::RecordLength { .. }));
}

#[test]
fn tables_are_checksummed() {
    let (image, _) = sample_image(3, 100);
    let h = Store::from_bytes(path(), &image)
        .expect("open")
        .header()
        .clone();
    let mut bad = image.clone();
    bad[h.checksum_table_offset as usize] ^= 1;
    assert!(matches!(
        Store::from_bytes(path(), &bad),
        Err(FormatError::TableChecksum {
            table: "checksum_table",
            ..
        })
    ));
    let mut bad = image;
    bad[h.manifest_offset as usize + 3] ^= 1;
    assert!(matches!(
        Store::from_bytes(path(), &bad),
        Err(FormatError::TableChecksum {
            table: "manifest",
            ..
        })
    ));
}

#[test]
fn truncated_and_extended_files_are_refused() {
    let (image, _) = sample_image(3, 100);
    assert!(matches!(
        Store::from_bytes(path(), &image[..image.len() - 4096]),
        Err(FormatError::Truncated {
            field: "file_len",
            ..
        })
    ));
    assert!(matches!(
        Store::from_bytes(path(), &image[..100]),
        Err(FormatError::Truncated {
            field: "header",
            ..
        })
    ));
    let mut long = image;
    long.push(0);
    assert!(matches!(
        Store::from_bytes(path(), &long),
        Err(FormatError::TrailingBytes { .. })
    ));
}

/// Re-seal a header after editing its fields, so the parser gets past the
/// checksum and meets the edited geometry.
fn reseal(image: &mut [u8]) {
    let sum = flashtier_format::xxh3_64(&image[..HEADER_BYTES - 8]);
    image[HEADER_BYTES - 8..HEADER_BYTES].copy_from_slice(&sum.to_le_bytes());
}

#[test]
fn a_manifest_that_disagrees_with_the_header_is_refused() {
    let m = Manifest::single_tensor(StoreKind::Rows, Dtype::U8, 64, keys(2));
    let plan = StoreWriterPlan::new(m).expect("plan");
    let mut image = plan.image(&[vec![1u8; 64], vec![2u8; 64]]).expect("image");
    // Claim kind = experts in the header; the manifest says rows.
    image[12] = 1;
    reseal(&mut image);
    assert!(matches!(
        Store::from_bytes(path(), &image),
        Err(FormatError::ManifestMismatch { field: "kind", .. })
    ));
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    /// Random bytes never panic the parser (and never parse as a store
    /// unless they start with the magic and a valid checksum).
    #[test]
    fn fuzz_random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..9000)) {
        let _ = Store::from_bytes(path(), &bytes);
    }

    /// Mutations of a valid image never panic and never yield a store whose
    /// records differ from what was written.
    #[test]
    fn fuzz_mutated_images_never_panic(
        edits in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8),
        reseal_header in any::<bool>(),
    ) {
        let (mut image, recs) = sample_image(5, 3000);
        for (at, v) in edits {
            let i = at.index(image.len());
            image[i] = v;
        }
        if reseal_header {
            reseal(&mut image);
        }
        if let Ok(store) = Store::from_bytes(path(), &image) {
            for i in 0..store.record_count() {
                let mut buf = vec![0u8; store.payload_bytes() as usize];
                if store.read_record(&image[..], i, &mut buf).is_ok() {
                    prop_assert_eq!(&buf, &recs[i as usize]);
                }
            }
        }
    }

    /// Header words set to arbitrary values (and re-sealed) never panic.
    #[test]
    fn fuzz_header_words_never_panic(word in 3usize..14, value in any::<u64>()) {
        let (mut image, _) = sample_image(4, 5000);
        let at = 8 * word;
        image[at..at + 8].copy_from_slice(&value.to_le_bytes());
        reseal(&mut image);
        let _ = Store::from_bytes(path(), &image);
    }
}

/// KV and row-shard messages: magics in hex, user input as typed.
#[test]
fn kv_and_row_shard_messages_carry_no_debug_text() {
    use flashtier_format::kv::{BlockOrder, KV_HEADER_BYTES, KvHeader};
    use flashtier_format::row_shard::RowShardHeader;
    let e = "zigzag".parse::<BlockOrder>().expect_err("order");
    assert_eq!(e, "unknown block order zigzag (per-layer | block-major)");
    let mut page = vec![0u8; KV_HEADER_BYTES];
    page[..8].copy_from_slice(b"NOTAKVST");
    let e = KvHeader::decode(&page).expect_err("magic").to_string();
    assert_eq!(
        e,
        "bad KV store magic 4e 4f 54 41 4b 56 53 54 (expected FTKVSTOR)"
    );
    let e = RowShardHeader::decode(path(), &page)
        .expect_err("magic")
        .to_string();
    assert!(
        e.ends_with("magic 4e 4f 54 41 4b 56 53 54, expected FTROWSH1)"),
        "{e}"
    );
}
