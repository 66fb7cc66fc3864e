//! Fuzz the store header + manifest parser: any bytes either parse into a
//! store whose records verify against the same bytes, or give a typed error.
//! Never a panic, never an out-of-bounds record.
#![no_main]

use std::path::Path;

use flashtier_format::{Header, Manifest, Store};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let path = Path::new("fuzz.ftstore");
    let _ = Header::decode(path, data);
    let _ = Manifest::from_bytes(path, data);
    if let Ok(store) = Store::from_bytes(path, data) {
        // A store that parsed lies entirely inside `data`.
        let payload = store.payload_bytes() as usize;
        for i in 0..store.record_count().min(256) {
            let off = store.record_offset(i).expect("in range") as usize;
            let rec = data
                .get(off..off + payload)
                .expect("record inside the file");
            let _ = store.verify_record(i, rec);
            let key = store.key_of(i).expect("key");
            assert_eq!(store.index_of(key).expect("index"), i);
        }
    }
});
