//! Unit tests of the manifest encoding (moved out of src/ to keep files short).

use std::collections::BTreeMap;
use std::path::Path;

use flashtier_format::FormatError;
use flashtier_format::header::{FORMAT_VERSION, StoreKind};
use flashtier_format::manifest::{Dtype, Manifest, RecordKey, RecordLayout, TensorLayout};

use proptest::prelude::*;

fn path() -> &'static Path {
    Path::new("m.json")
}

fn sample(tensors: Vec<TensorLayout>, keys: Vec<RecordKey>) -> Manifest {
    let payload = tensors.last().map_or(0, |t| t.offset + t.len_bytes);
    Manifest {
        format_version: FORMAT_VERSION,
        kind: StoreKind::Experts,
        key_fields: ["layer".into(), "expert".into()],
        dtype: Dtype::Bf16,
        record: RecordLayout {
            payload_bytes: payload,
            tensors,
        },
        keys,
        source: None,
        model: None,
        extra: BTreeMap::new(),
    }
}

fn tensor(name: &str, dtype: Dtype, shape: Vec<u64>, offset: u64) -> TensorLayout {
    let len_bytes = shape.iter().product::<u64>() * dtype.size_bytes();
    TensorLayout {
        name: name.into(),
        dtype,
        shape,
        offset,
        len_bytes,
    }
}

/// Manifest errors spell shapes and sizes as plain text, not Rust's
/// `[2, 3]`, `Some(12)` or a quoted name.
#[test]
fn manifest_errors_carry_no_debug_text() {
    let mut m = sample(
        vec![tensor("a", Dtype::Bf16, vec![2, 3], 0)],
        vec![RecordKey::new(0, 0)],
    );
    m.record.tensors[0].len_bytes = 10;
    m.record.payload_bytes = 10;
    let msg = m.validate(path()).expect_err("length").to_string();
    assert!(
        msg.ends_with("10 bytes, but shape 2x3 of BF16 needs 12"),
        "{msg}"
    );
    let huge = TensorLayout {
        name: "a".into(),
        dtype: Dtype::Bf16,
        shape: vec![u64::MAX, 2],
        offset: 0,
        len_bytes: 4,
    };
    let m = sample(vec![huge], vec![RecordKey::new(0, 0)]);
    let msg = m.validate(path()).expect_err("overflow").to_string();
    assert!(msg.ends_with("needs more than 2^64"), "{msg}");
    let m = sample(
        vec![
            tensor("a", Dtype::Bf16, vec![2], 0),
            tensor("a", Dtype::Bf16, vec![2], 4),
        ],
        vec![RecordKey::new(0, 0)],
    );
    let msg = m.validate(path()).expect_err("repeated").to_string();
    assert!(msg.ends_with("name: a is repeated"), "{msg}");
}

#[test]
fn rules_are_enforced() {
    let ok = sample(
        vec![
            tensor("a", Dtype::Bf16, vec![4, 8], 0),
            tensor("b", Dtype::F32, vec![4], 4096),
        ],
        vec![RecordKey::new(0, 0), RecordKey::new(0, 1)],
    );
    ok.validate(path()).expect("valid");
    let mut m = ok.clone();
    m.record.tensors[1].len_bytes += 1;
    assert!(matches!(
        m.validate(path()),
        Err(FormatError::ManifestInvalid { .. })
    ));
    let mut m = ok.clone();
    m.record.tensors[1].offset = 10;
    m.record.payload_bytes = 26;
    assert!(matches!(
        m.validate(path()),
        Err(FormatError::ManifestInvalid { .. })
    ));
    let mut m = ok.clone();
    m.keys[1] = RecordKey::new(0, 0);
    assert!(matches!(
        m.validate(path()),
        Err(FormatError::ManifestInvalid { .. })
    ));
    let mut m = ok;
    m.record.payload_bytes += 1;
    assert!(matches!(
        m.validate(path()),
        Err(FormatError::ManifestInvalid { .. })
    ));
}

#[test]
fn dtype_names_round_trip() {
    for d in [
        Dtype::Bf16,
        Dtype::F16,
        Dtype::F32,
        Dtype::F8E4M3,
        Dtype::U8,
    ] {
        assert_eq!(Dtype::from_name(d.name()), Some(d));
    }
    assert_eq!(Dtype::from_name("I64"), None);
}

fn arb_dtype() -> impl Strategy<Value = Dtype> {
    prop_oneof![
        Just(Dtype::Bf16),
        Just(Dtype::F16),
        Just(Dtype::F32),
        Just(Dtype::F8E4M3),
        Just(Dtype::U8)
    ]
}

proptest! {
    #[test]
    fn manifests_round_trip(
        shapes in proptest::collection::vec((arb_dtype(), proptest::collection::vec(1u64..64, 1..4), 0u64..5000), 1..6),
        keys in proptest::collection::btree_set((0u32..100, 0u32..300), 0..50),
        extra in proptest::collection::btree_map("[a-z]{1,8}", any::<i64>(), 0..3),
    ) {
        let mut off = 0;
        let mut tensors = Vec::new();
        for (i, (dtype, shape, gap)) in shapes.into_iter().enumerate() {
            off += gap;
            let t = tensor(&format!("t{i}"), dtype, shape, off);
            off += t.len_bytes;
            tensors.push(t);
        }
        let keys = keys.into_iter().map(|(l, e)| RecordKey::new(l, e)).collect();
        let mut m = sample(tensors, keys);
        m.extra = extra.into_iter().map(|(k, v)| (k, serde_json::Value::from(v))).collect();
        let back = Manifest::from_bytes(path(), &m.to_bytes()).expect("parse");
        prop_assert_eq!(back, m);
    }
}
