//! Fuzz the safetensors header parser shared by the checkpoint reader and
//! the row store's table sources: any bytes either parse into tensors whose
//! bytes lie inside the file, each as long as its shape and dtype say where
//! the dtype's size is known, or give a typed error naming the file. Never a
//! panic.
#![no_main]

use std::path::Path;

use flashtier_format::safetensors::{
    LEN_WORD_BYTES, MAX_HEADER_BYTES, SafetensorsError, SafetensorsTensor, dtype_size_bytes,
    header_len, parse_header,
};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let path = Path::new("fuzz.safetensors");
    let file_bytes = data.len() as u64;
    // The bytes as a whole file, and the bytes as the JSON of a header whose
    // length word is right, so the fuzzer reaches the entry checks.
    if let Some(word) = data.first_chunk::<8>() {
        if let Ok(n) = header_len(path, *word, file_bytes) {
            assert!(n <= MAX_HEADER_BYTES && LEN_WORD_BYTES + n <= file_bytes);
            let json = &data[8..8 + n as usize];
            check(parse_header(path, json, file_bytes), file_bytes);
        }
    }
    check(parse_header(path, data, file_bytes + 8), file_bytes + 8);
});

fn check(parsed: Result<Vec<SafetensorsTensor>, SafetensorsError>, file_bytes: u64) {
    let Ok(tensors) = parsed else {
        return;
    };
    for t in tensors {
        assert!(t.offset + t.len_bytes <= file_bytes);
        if let Some(size) = dtype_size_bytes(&t.dtype) {
            let want = t.shape.iter().try_fold(size, |a, &d| a.checked_mul(d));
            assert_eq!(want, Some(t.len_bytes));
        }
    }
}
