//! Checked-in store images: one valid file and one per kind of damage, each
//! expecting its own error. `FLASHTIER_REGEN_FIXTURES=1 cargo test -p
//! flashtier-format --test suite fixtures::` rewrites them; otherwise the valid one
//! must equal what today's writer produces (the format has not drifted).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use flashtier_format::{
    Dtype, FORMAT_VERSION, FormatError, HEADER_BYTES, Manifest, RecordKey, RecordLayout, Store,
    StoreKind, StoreWriterPlan, TensorLayout,
};

fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

/// Three expert records of a BF16 matrix followed by F32 scales.
fn valid_image() -> Vec<u8> {
    let tensors = vec![
        TensorLayout {
            name: "gate_proj.weight".into(),
            dtype: Dtype::Bf16,
            shape: vec![16, 32],
            offset: 0,
            len_bytes: 1024,
        },
        TensorLayout {
            name: "gate_proj.weight_scale_inv".into(),
            dtype: Dtype::F32,
            shape: vec![1, 1],
            offset: 4096,
            len_bytes: 4,
        },
    ];
    let manifest = Manifest {
        format_version: FORMAT_VERSION,
        kind: StoreKind::Experts,
        key_fields: ["layer".into(), "expert".into()],
        dtype: Dtype::Bf16,
        record: RecordLayout {
            payload_bytes: 4100,
            tensors,
        },
        keys: vec![
            RecordKey::new(0, 0),
            RecordKey::new(0, 1),
            RecordKey::new(1, 0),
        ],
        source: None,
        model: None,
        extra: BTreeMap::new(),
    };
    let plan = StoreWriterPlan::new(manifest).expect("plan");
    let records: Vec<Vec<u8>> = (0..3u8)
        .map(|r| {
            (0..4100u32)
                .map(|i| (i as u8).wrapping_mul(7) ^ r)
                .collect()
        })
        .collect();
    plan.image(&records).expect("image")
}

fn reseal(image: &mut [u8]) {
    let sum = flashtier_format::xxh3_64(&image[..HEADER_BYTES - 8]);
    image[HEADER_BYTES - 8..HEADER_BYTES].copy_from_slice(&sum.to_le_bytes());
}

/// (file name, damaged image) for every fixture.
fn fixtures() -> Vec<(&'static str, Vec<u8>)> {
    let valid = valid_image();
    let mut flipped = valid.clone();
    flipped[4096 + 8192 + 100] ^= 0x01; // record 1 (at 4096 + 1 * stride), inside its payload
    let truncated = valid[..valid.len() - 4096].to_vec();
    let mut bad_magic = valid.clone();
    bad_magic[..8].copy_from_slice(b"GGUF\0\0\0\0");
    let mut unknown_version = valid.clone();
    unknown_version[8..12].copy_from_slice(&2u32.to_le_bytes());
    let mut unaligned = valid.clone();
    unaligned[32..40].copy_from_slice(&8000u64.to_le_bytes());
    reseal(&mut unaligned);
    let mut overflow = valid.clone();
    overflow[80..88].copy_from_slice(&(1u64 << 20).to_le_bytes()); // manifest_len
    reseal(&mut overflow);
    vec![
        ("valid.ftstore", valid),
        ("flipped_record_byte.ftstore", flipped),
        ("truncated.ftstore", truncated),
        ("bad_magic.ftstore", bad_magic),
        ("unknown_version.ftstore", unknown_version),
        ("unaligned_stride.ftstore", unaligned),
        ("manifest_overflows_file.ftstore", overflow),
    ]
}

fn open(name: &str) -> Result<Store, FormatError> {
    Store::open(&dir().join(name))
}

#[test]
fn fixtures_are_current() {
    if std::env::var_os("FLASHTIER_REGEN_FIXTURES").is_some() {
        for (name, bytes) in fixtures() {
            std::fs::write(dir().join(name), bytes).expect("write fixture");
        }
    }
    let on_disk = std::fs::read(dir().join("valid.ftstore")).expect("read valid fixture");
    assert!(
        on_disk == valid_image(),
        "the writer no longer produces tests/fixtures/valid.ftstore: the format changed"
    );
}

#[test]
fn the_valid_fixture_reads_back() {
    let path = dir().join("valid.ftstore");
    let store = open("valid.ftstore").expect("valid");
    let image = std::fs::read(&path).expect("file");
    for i in 0..store.record_count() {
        let mut buf = vec![0u8; store.payload_bytes() as usize];
        store.read_record(&image[..], i, &mut buf).expect("record");
    }
    assert_eq!(store.index_of(RecordKey::new(1, 0)).expect("key"), 2);
}

#[test]
fn a_flipped_record_byte_is_a_record_checksum_error() {
    let path = dir().join("flipped_record_byte.ftstore");
    let store = open("flipped_record_byte.ftstore").expect("header and tables are intact");
    let image = std::fs::read(&path).expect("file");
    let mut buf = vec![0u8; store.payload_bytes() as usize];
    store
        .read_record(&image[..], 0, &mut buf)
        .expect("record 0 is intact");
    let err = store
        .read_record(&image[..], 1, &mut buf)
        .expect_err("record 1 is damaged");
    assert!(
        matches!(err, FormatError::RecordChecksum { index: 1, ref key, .. } if key == "layer=0 expert=1"),
        "{err}"
    );
}

#[test]
fn a_truncated_file_is_a_truncated_error() {
    let err = open("truncated.ftstore").expect_err("truncated");
    assert!(
        matches!(
            err,
            FormatError::Truncated {
                field: "file_len",
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("truncated.ftstore"), "{err}");
}

#[test]
fn a_bad_magic_is_a_bad_magic_error() {
    let err = open("bad_magic.ftstore").expect_err("bad magic");
    assert!(
        matches!(err, FormatError::BadMagic { found, .. } if &found[..4] == b"GGUF"),
        "{err}"
    );
}

#[test]
fn an_unknown_version_is_an_unknown_version_error() {
    let err = open("unknown_version.ftstore").expect_err("version 2");
    assert!(
        matches!(
            err,
            FormatError::UnknownVersion {
                found: 2,
                supported: 1,
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn an_unaligned_stride_is_an_unaligned_stride_error() {
    let err = open("unaligned_stride.ftstore").expect_err("stride 8000");
    assert!(
        matches!(err, FormatError::UnalignedStride { stride: 8000, .. }),
        "{err}"
    );
}

#[test]
fn a_manifest_past_the_end_is_a_table_overflow_error() {
    let err = open("manifest_overflows_file.ftstore").expect_err("overflow");
    assert!(
        matches!(
            err,
            FormatError::TableOverflow {
                table: "manifest",
                ..
            }
        ),
        "{err}"
    );
}
