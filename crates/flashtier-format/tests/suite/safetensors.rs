//! The shared safetensors header parser on arbitrary and on generated
//! headers (the stable-toolchain twin of `fuzz/safetensors_header_parser`).

use std::path::Path;

use flashtier_format::safetensors::{
    LEN_WORD_BYTES, SafetensorsTensor, dtype_size_bytes, header_len, parse_header,
};
use proptest::prelude::*;

fn p() -> &'static Path {
    Path::new("t.safetensors")
}

/// What every parsed tensor satisfies in a `file_bytes`-byte file.
fn holds(tensors: &[SafetensorsTensor], file_bytes: u64) -> Result<(), TestCaseError> {
    for t in tensors {
        prop_assert!(t.offset + t.len_bytes <= file_bytes);
        if let Some(size) = dtype_size_bytes(&t.dtype) {
            let want = t.shape.iter().try_fold(size, |a, &d| a.checked_mul(d));
            prop_assert_eq!(want, Some(t.len_bytes));
        }
    }
    Ok(())
}

/// A file of `tensors` (name, dtype, shape) packed back to back, as the
/// safetensors writer lays them out.
fn file(tensors: &[(String, &str, Vec<u64>)]) -> Vec<u8> {
    let mut header = serde_json::Map::new();
    let mut at = 0u64;
    for (name, dtype, shape) in tensors {
        let len = shape.iter().product::<u64>() * dtype_size_bytes(dtype).unwrap_or(1);
        header.insert(
            name.clone(),
            serde_json::json!({ "dtype": dtype, "shape": shape, "data_offsets": [at, at + len] }),
        );
        at += len;
    }
    let json = serde_json::Value::Object(header).to_string();
    let mut b = (json.len() as u64).to_le_bytes().to_vec();
    b.extend_from_slice(json.as_bytes());
    b.resize(b.len() + at as usize, 0);
    b
}

fn parse(b: &[u8]) -> Option<Vec<SafetensorsTensor>> {
    let word = *b.first_chunk::<8>()?;
    let n = header_len(p(), word, b.len() as u64).ok()?;
    let json = &b[LEN_WORD_BYTES as usize..(LEN_WORD_BYTES + n) as usize];
    parse_header(p(), json, b.len() as u64).ok()
}

proptest! {
    #[test]
    fn fuzz_random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..600)) {
        if let Some(t) = parse(&bytes) {
            holds(&t, bytes.len() as u64)?;
        }
        if let Ok(t) = parse_header(p(), &bytes, bytes.len() as u64 + 8) {
            holds(&t, bytes.len() as u64 + 8)?;
        }
    }

    #[test]
    fn written_files_parse_back_and_mutations_never_panic(
        specs in proptest::collection::vec(
            (prop::sample::select(vec!["BF16", "F32", "U8", "F8_E4M3", "I64", "X7"]),
             proptest::collection::vec(0u64..5, 0..3)),
            1..5),
        flips in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..4),
    ) {
        let tensors: Vec<(String, &str, Vec<u64>)> = specs
            .into_iter()
            .enumerate()
            .map(|(i, (d, s))| (format!("t{i}"), d, s))
            .collect();
        let mut b = file(&tensors);
        let got = parse(&b).expect("a written file parses");
        prop_assert_eq!(got.len(), tensors.len());
        for (t, (name, dtype, shape)) in got.iter().zip(&tensors) {
            prop_assert_eq!((&t.name, t.dtype.as_str(), &t.shape), (name, *dtype, shape));
        }
        holds(&got, b.len() as u64)?;
        for (at, v) in flips {
            let i = at.index(b.len());
            b[i] ^= v;
        }
        if let Some(t) = parse(&b) {
            holds(&t, b.len() as u64)?;
        }
    }
}
