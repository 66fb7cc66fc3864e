//! Disk -> pinned -> HBM landing: the bytes that come back from device memory
//! equal the file's bytes, through `read` and `read_async`; a failed read
//! gives its staging slot back; pinned memory is readable by the device at
//! its mapped address. Skips without a GPU.

mod common;

use std::sync::Arc;

use common::gpu_or_skip;
use cudarc::driver::DevicePtr;
use flashtier_cuda::{DeviceAddressing, HbmSink, PinnedMemory};
use flashtier_io::{
    DeviceSink, DirectMode, Landing, PosixBackend, ReadReq, RegionMemory, StorageBackend, StoreFile,
};
use rand::{RngCore, SeedableRng};

const CHUNK: usize = 1 << 20;

fn random_file(len: usize, seed: u64) -> (tempfile::TempDir, std::path::PathBuf, Vec<u8>) {
    let dir = tempfile::tempdir_in(
        std::env::var("FT_TEST_DIR").unwrap_or_else(|_| std::env::temp_dir().display().to_string()),
    )
    .expect("tempdir");
    let path = dir.path().join("landing.bin");
    let mut bytes = vec![0u8; len];
    rand::rngs::StdRng::seed_from_u64(seed).fill_bytes(&mut bytes);
    std::fs::write(&path, &bytes).expect("write file");
    (dir, path, bytes)
}

#[test]
fn landed_bytes_equal_the_file() {
    let Some(gpu) = gpu_or_skip("landed_bytes_equal_the_file") else {
        return;
    };
    let len = 6 * CHUNK;
    let (_dir, path, bytes) = random_file(len, 7);
    let file = StoreFile::open_read(&path, DirectMode::Prefer).expect("open");
    eprintln!("landing test file direct: {}", file.is_direct());
    let backend = PosixBackend::new(4).expect("backend");
    // Two slots for four readers: slots are reused while copies are in flight.
    let sink = HbmSink::new(&gpu, 2, CHUNK).expect("sink");
    let s = gpu.stream();
    for round in 0..2 {
        let dev = s.alloc_zeros::<u8>(len).expect("alloc");
        sink.order_after(s).expect("copies after the allocation");
        let base = {
            let (p, _sync) = dev.device_ptr(s);
            p
        };
        // Chunks in a shuffled order, so landings are not sequential.
        let reqs: Vec<ReadReq> = [3usize, 0, 5, 1, 4, 2]
            .iter()
            .map(|&c| ReadReq {
                file: file.clone(),
                offset: (c * CHUNK) as u64,
                len: CHUNK,
                landing: Landing::Device {
                    sink: sink.clone() as Arc<dyn DeviceSink>,
                    dst: base + (c * CHUNK) as u64,
                },
                tag: c as u64,
            })
            .collect();
        if round == 0 {
            backend.read(reqs).expect("read");
            sink.flush().expect("flush");
        } else {
            let ticket = backend.read_async(reqs).expect("read_async");
            ticket.wait().expect("landed");
            // No host sync: order the compute stream after the copies.
            sink.order_before(s).expect("order");
        }
        let back = s.clone_dtoh(&dev).expect("download");
        assert!(
            back == bytes,
            "round {round}: device bytes differ from the file"
        );
    }
}

#[test]
fn failed_read_returns_its_slot() {
    let Some(gpu) = gpu_or_skip("failed_read_returns_its_slot") else {
        return;
    };
    let (_dir, path, bytes) = random_file(2 * CHUNK, 9);
    let file = StoreFile::open_read(&path, DirectMode::Prefer).expect("open");
    let backend = PosixBackend::new(1).expect("backend");
    let sink = HbmSink::new(&gpu, 1, CHUNK).expect("sink");
    let s = gpu.stream();
    let dev = s.alloc_zeros::<u8>(CHUNK).expect("alloc");
    sink.order_after(s).expect("copies after the allocation");
    let (base, _sync) = dev.device_ptr(s);
    let req = |offset: u64| ReadReq {
        file: file.clone(),
        offset,
        len: CHUNK,
        landing: Landing::Device {
            sink: sink.clone() as Arc<dyn DeviceSink>,
            dst: base,
        },
        tag: 0,
    };
    // Past the end of the file: a short read, an error naming the extent.
    let err = backend
        .read(vec![req(2 * CHUNK as u64)])
        .expect_err("read past EOF");
    eprintln!("expected error: {err}");
    // The single slot came back: the next read lands.
    backend
        .read(vec![req(CHUNK as u64)])
        .expect("read after failure");
    sink.flush().expect("flush");
    drop(_sync);
    let back = s.clone_dtoh(&dev).expect("download");
    assert!(back[..] == bytes[CHUNK..], "bytes after a failed read");
}

#[test]
fn pinned_memory_is_device_readable() {
    let Some(gpu) = gpu_or_skip("pinned_memory_is_device_readable") else {
        return;
    };
    let len = 3 * 4096 + 100;
    let pinned = PinnedMemory::new(&gpu, len).expect("pin");
    assert_eq!(
        pinned.base_ptr() as usize % 4096,
        0,
        "pinned memory must be page-aligned"
    );
    assert_eq!(pinned.len_bytes() % 4096, 0);
    let host_ptr = pinned.base_ptr() as u64;
    eprintln!(
        "pinned addressing: {:?} (host {host_ptr:#x})",
        pinned.addressing()
    );
    match pinned.addressing() {
        DeviceAddressing::SameAddress => assert_eq!(pinned.device_address(), host_ptr),
        DeviceAddressing::Mapped { device_ptr } => assert_eq!(device_ptr, pinned.device_address()),
    }
    // SAFETY: nothing else touches this fresh allocation; zeroed and in bounds.
    let host = unsafe { std::slice::from_raw_parts_mut(pinned.base_ptr(), pinned.len_bytes()) };
    assert!(host.iter().all(|&b| b == 0), "pinned memory starts zeroed");
    for (i, b) in host.iter_mut().enumerate() {
        *b = (i * 31 % 251) as u8;
    }
    let want = host.to_vec();
    let s = gpu.stream();
    let dev = s.alloc_zeros::<u8>(pinned.len_bytes()).expect("alloc");
    {
        let (dst, _sync) = dev.device_ptr(s);
        // SAFETY: both ranges hold len_bytes bytes; the device reads the mapped
        // pinned memory in place (zero-copy), the host does not write it meanwhile.
        unsafe {
            cudarc::driver::result::memcpy_dtod_async(
                dst,
                pinned.device_address(),
                pinned.len_bytes(),
                s.cu_stream(),
            )
        }
        .expect("device reads pinned memory");
    }
    let back = s.clone_dtoh(&dev).expect("download");
    assert!(back == want);
}
