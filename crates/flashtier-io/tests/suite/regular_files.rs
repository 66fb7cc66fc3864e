//! Opening only regular files (a FIFO fails at once instead of blocking the
//! caller) and exact reads of unaligned ranges through a direct file.

use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::Duration;

use flashtier_format::ByteSource;
use flashtier_io::{AlignedBuf, DirectMode, IoError, LockedMap, MappedFile, StoreFile};

fn mkfifo(dir: &Path) -> PathBuf {
    let fifo = dir.join("pipe.ftstore");
    rustix::fs::mkfifoat(
        rustix::fs::CWD,
        &fifo,
        rustix::fs::Mode::from_raw_mode(0o600),
    )
    .expect("mkfifo");
    fifo
}

/// Run `open` on a thread and return its error text; panics when it takes
/// longer than a few seconds (it blocked on the FIFO) or succeeds.
fn refused_at_once(
    what: &str,
    open: impl FnOnce() -> Result<(), String> + Send + 'static,
) -> String {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(open());
    });
    let got = rx
        .recv_timeout(Duration::from_secs(5))
        .unwrap_or_else(|_| panic!("{what} blocked on a FIFO"));
    got.expect_err(what)
}

#[test]
fn every_opener_refuses_a_fifo_at_once_with_a_typed_error() {
    let dir = tempfile::tempdir().expect("tempdir");
    let fifo = mkfifo(dir.path());
    let typed = |r: Result<std::sync::Arc<StoreFile>, IoError>| match r {
        Err(IoError::NotRegular { path, what }) => Err(format!("{}: {what}", path.display())),
        Err(other) => Ok(format!("untyped error: {other}")).and_then(Err),
        Ok(_) => Ok(()),
    };
    for mode in [DirectMode::Off, DirectMode::Prefer] {
        let p = fifo.clone();
        let msg = refused_at_once("StoreFile::open_read", move || {
            typed(StoreFile::open_read(&p, mode))
        });
        assert!(msg.contains("pipe.ftstore: a FIFO (named pipe)"), "{msg}");
        let p = fifo.clone();
        let msg = refused_at_once("StoreFile::open_rw", move || {
            typed(StoreFile::open_rw(&p, mode, true))
        });
        assert!(msg.contains("pipe.ftstore: a FIFO (named pipe)"), "{msg}");
    }
    let p = fifo.clone();
    let msg = refused_at_once("MappedFile::open", move || match MappedFile::open(&p) {
        Err(IoError::NotRegular { what, .. }) => Err(what.to_string()),
        Err(other) => Err(format!("untyped error: {other}")),
        Ok(_) => Ok(()),
    });
    assert_eq!(msg, "a FIFO (named pipe)");
    let p = fifo.clone();
    let msg = refused_at_once("LockedMap::open", move || {
        LockedMap::open(&p).map(|_| ()).map_err(|e| e.to_string())
    });
    assert!(
        msg.contains("pipe.ftstore is a FIFO (named pipe), not a regular file"),
        "{msg}"
    );
    let err = StoreFile::open_read(Path::new("/dev/null"), DirectMode::Off).expect_err("device");
    assert!(
        matches!(
            err,
            IoError::NotRegular {
                what: "a character device",
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn an_opened_store_file_is_blocking_for_the_ring() {
    // O_NONBLOCK guards the open; io_uring would honour it on reads.
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("data.bin");
    std::fs::write(&path, [1u8; 100]).expect("write");
    for mode in [DirectMode::Off, DirectMode::Prefer] {
        let f = StoreFile::open_read(&path, mode).expect("open");
        let flags = rustix::fs::fcntl_getfl(f.file()).expect("getfl");
        assert!(!flags.contains(rustix::fs::OFlags::NONBLOCK), "{mode:?}");
    }
}

fn pattern(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i % 251) as u8 ^ (i >> 9) as u8).collect()
}

#[test]
fn staged_reads_return_exact_bytes_of_any_range() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("data.bin");
    // Not a multiple of 4096: the last window runs past the end of the file.
    let data = pattern(3 * 4096 + 1234);
    std::fs::write(&path, &data).expect("write");
    for mode in [DirectMode::Prefer, DirectMode::Off] {
        let f = StoreFile::open_read(&path, mode).expect("open");
        if mode == DirectMode::Prefer && !f.is_direct() {
            flashtier_io::skip::notice("staged direct reads", "no O_DIRECT on this file system");
        }
        let mut staging = AlignedBuf::zeroed(0);
        let len = data.len();
        for (at, n) in [
            (0, 1),
            (1, 4095),
            (4095, 2),
            (5000, 8000),
            (len - 7, 7),
            (0, len),
            (len, 0),
        ] {
            let mut dst = vec![0u8; n];
            f.read_exact_at_staged(&mut dst, at as u64, &mut staging)
                .unwrap_or_else(|e| panic!("{mode:?} {at}+{n}: {e}"));
            assert_eq!(dst, data[at..at + n], "{mode:?} {at}+{n}");
        }
        // The staging buffer grows to the largest window only.
        assert!(staging.capacity() <= len.next_multiple_of(4096) + 4096);
        // Past the end: a short read naming the caller's range, not the window.
        let mut dst = vec![0u8; 20];
        let at = (len - 10) as u64;
        match f.read_exact_at_staged(&mut dst, at, &mut staging) {
            Err(IoError::ShortRead {
                offset,
                len: l,
                got,
                ..
            }) => {
                assert_eq!((offset, l, got), (at, 20, 10), "{mode:?}");
            }
            other => panic!("{mode:?}: expected ShortRead, got {other:?}"),
        }
        // The same handle serves a store's header reads, any range.
        let mut head = vec![0u8; 13];
        ByteSource::read_exact_at(f.as_ref(), &mut head, 4097).expect("byte source");
        assert_eq!(head, data[4097..4110]);
        assert_eq!(ByteSource::len_bytes(f.as_ref()).expect("len"), len as u64);
    }
}
