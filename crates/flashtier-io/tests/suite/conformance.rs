//! The conformance suite every backend passes: posix, uring and uring-local
//! (skipped with a printed reason where the kernel refuses io_uring) and sim
//! with faults off.

use std::path::Path;
use std::sync::{Arc, Mutex};

use flashtier_io::sim::{FaultPlan, SimBackend};
use flashtier_io::{
    AlignedBuf, BackendKind, DeviceSink, DirectMode, IoError, Landing, LandingRegion, PosixBackend,
    ReadReq, StorageBackend, StoreFile, UringBackend, UringLocal, open_backend,
};
use proptest::prelude::*;

const UNIT: usize = 4096;

/// Every backend that can run here, each with its name.
fn backends(queue_depth: usize) -> anyhow::Result<Vec<Box<dyn StorageBackend>>> {
    let mut out: Vec<Box<dyn StorageBackend>> = vec![
        Box::new(PosixBackend::new(queue_depth)?),
        Box::new(SimBackend::new(FaultPlan::off(), queue_depth)?),
    ];
    match UringBackend::new(queue_depth) {
        Ok(b) => out.push(Box::new(b)),
        Err(e) => flashtier_io::skip::notice(
            "uring conformance",
            &format!("io_uring unavailable here: {e}"),
        ),
    }
    match UringLocal::new(queue_depth) {
        Ok(b) => out.push(Box::new(b)),
        Err(e) => flashtier_io::skip::notice(
            "uring-local conformance",
            &format!("io_uring unavailable here: {e}"),
        ),
    }
    Ok(out)
}

fn pattern(len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8) ^ ((i >> 8) as u8).wrapping_mul(7) ^ ((i >> 16) as u8))
        .collect()
}

fn make_file(dir: &Path, name: &str, len: usize) -> anyhow::Result<(Arc<StoreFile>, Vec<u8>)> {
    let path = dir.join(name);
    let data = pattern(len);
    std::fs::write(&path, &data)?;
    Ok((StoreFile::open_rw(&path, DirectMode::Prefer, false)?, data))
}

fn host_req(file: &Arc<StoreFile>, offset: usize, len: usize, tag: u64) -> ReadReq {
    ReadReq {
        file: file.clone(),
        offset: offset as u64,
        len,
        landing: Landing::Host(AlignedBuf::zeroed(len)),
        tag,
    }
}

fn expect_err<T>(r: Result<T, IoError>, what: &str) -> anyhow::Result<IoError> {
    r.err()
        .ok_or_else(|| anyhow::anyhow!("{what}: expected an error"))
}

#[test]
fn host_landings_exact_bytes_and_tags() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let (file, data) = make_file(dir.path(), "a.bin", 256 * UNIT)?;
    for b in backends(8)? {
        let extents: Vec<(usize, usize)> = (0..40)
            .map(|i| ((i * 37 % 240) * UNIT, (1 + i % 5) * UNIT))
            .collect();
        let reqs = extents
            .iter()
            .enumerate()
            .map(|(i, &(o, l))| host_req(&file, o, l, 1000 + i as u64))
            .collect();
        let landed = b.read(reqs)?;
        assert_eq!(landed.len(), extents.len(), "{}", b.name());
        for (i, (l, &(o, n))) in landed.iter().zip(&extents).enumerate() {
            assert_eq!(l.tag, 1000 + i as u64, "{}", b.name());
            assert_eq!(l.len, n);
            assert_eq!(l.buf.as_deref(), data.get(o..o + n), "{} req {i}", b.name());
        }
    }
    Ok(())
}

#[test]
fn region_landings_registered_and_not() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let (file, data) = make_file(dir.path(), "r.bin", 64 * UNIT)?;
    for b in backends(4)? {
        let fixed = LandingRegion::host(32 * UNIT);
        b.register_landing_region(&fixed)?;
        let plain = LandingRegion::host(32 * UNIT);
        let mut reqs = Vec::new();
        for i in 0..32 {
            let region = if i % 2 == 0 { &fixed } else { &plain };
            reqs.push(ReadReq {
                file: file.clone(),
                offset: ((63 - i) * UNIT) as u64,
                len: UNIT,
                landing: Landing::Region {
                    region: region.clone(),
                    offset: i * UNIT,
                },
                tag: i as u64,
            });
        }
        let landed = b.read(reqs)?;
        assert!(landed.iter().all(|l| l.buf.is_none()));
        for i in 0..32 {
            let region = if i % 2 == 0 { &fixed } else { &plain };
            // SAFETY: the ticket completed; nothing is in flight into the region.
            let got = unsafe { region.slice(i * UNIT, UNIT) };
            let want = (63 - i) * UNIT;
            assert_eq!(got, &data[want..want + UNIT], "{} slot {i}", b.name());
        }
    }
    Ok(())
}

#[test]
fn many_concurrent_tickets() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let (file, data) = make_file(dir.path(), "c.bin", 128 * UNIT)?;
    for b in backends(16)? {
        let b: &dyn StorageBackend = b.as_ref();
        std::thread::scope(|s| -> anyhow::Result<()> {
            let handles: Vec<_> = (0..4usize)
                .map(|t| {
                    let (file, data) = (&file, &data);
                    s.spawn(move || -> anyhow::Result<()> {
                        let mut tickets = Vec::new();
                        for k in 0..16usize {
                            let reqs = (0..8usize)
                                .map(|j| {
                                    let blk = (t * 31 + k * 7 + j * 3) % 127;
                                    host_req(file, blk * UNIT, UNIT, (k * 8 + j) as u64)
                                })
                                .collect();
                            tickets.push((k, b.read_async(reqs)?));
                        }
                        for (k, ticket) in tickets.into_iter().rev() {
                            for (j, l) in ticket.wait()?.iter().enumerate() {
                                let blk = (t * 31 + k * 7 + j * 3) % 127;
                                assert_eq!(l.tag, (k * 8 + j) as u64);
                                assert_eq!(
                                    l.buf.as_deref(),
                                    data.get(blk * UNIT..(blk + 1) * UNIT)
                                );
                            }
                        }
                        Ok(())
                    })
                })
                .collect();
            for h in handles {
                h.join()
                    .map_err(|_| anyhow::anyhow!("reader thread panicked"))??;
            }
            Ok(())
        })?;
    }
    Ok(())
}

#[test]
fn past_end_of_file_is_a_short_read_naming_the_file() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let len = 10 * UNIT + 100;
    let (file, data) = make_file(dir.path(), "eof.bin", len)?;
    for b in backends(2)? {
        // Partly past the end: the tail lands, then the file ends.
        let err = expect_err(b.read(vec![host_req(&file, 10 * UNIT, UNIT, 0)]), b.name())?;
        match &err {
            IoError::ShortRead {
                path,
                offset,
                len,
                got,
            } => {
                assert_eq!(path, file.path());
                assert_eq!((*offset, *len, *got), ((10 * UNIT) as u64, UNIT, 100));
            }
            other => anyhow::bail!("{}: expected ShortRead, got {other}", b.name()),
        }
        assert!(err.to_string().contains("eof.bin"));
        // Wholly past the end.
        let err = expect_err(b.read(vec![host_req(&file, 20 * UNIT, UNIT, 0)]), b.name())?;
        assert!(
            matches!(err, IoError::ShortRead { got: 0, .. }),
            "{}: {err}",
            b.name()
        );
        // The last whole block still reads.
        let ok = b.read(vec![host_req(&file, 9 * UNIT, UNIT, 0)])?;
        assert_eq!(ok[0].buf.as_deref(), data.get(9 * UNIT..10 * UNIT));
    }
    Ok(())
}

#[test]
fn misaligned_direct_reads_and_small_landings_are_errors() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let (file, _) = make_file(dir.path(), "m.bin", 16 * UNIT)?;
    for b in backends(2)? {
        let err = expect_err(
            b.read(vec![ReadReq {
                landing: Landing::Host(AlignedBuf::zeroed(UNIT)),
                ..host_req(&file, 0, 2 * UNIT, 0)
            }]),
            b.name(),
        )?;
        assert!(
            matches!(err, IoError::Landing { .. }),
            "{}: {err}",
            b.name()
        );
        let region = LandingRegion::host(UNIT);
        let err = expect_err(
            b.read(vec![ReadReq {
                landing: Landing::Region {
                    region,
                    offset: UNIT,
                },
                ..host_req(&file, 0, UNIT, 0)
            }]),
            b.name(),
        )?;
        assert!(
            matches!(err, IoError::Landing { .. }),
            "{}: {err}",
            b.name()
        );
        if !file.is_direct() {
            flashtier_io::skip::notice(
                "misaligned direct read",
                "the temp file system refuses O_DIRECT",
            );
            continue;
        }
        let off = file.offset_align().max(512) / 2;
        let err = expect_err(b.read(vec![host_req(&file, off, UNIT, 0)]), b.name())?;
        assert!(
            matches!(err, IoError::Misaligned { .. }),
            "{}: {err}",
            b.name()
        );
        assert!(err.to_string().contains("m.bin"));
    }
    Ok(())
}

#[test]
fn write_then_read_back() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let (file, mut data) = make_file(dir.path(), "w.bin", 32 * UNIT)?;
    for (k, b) in backends(4)?.iter().enumerate() {
        let mut src = AlignedBuf::zeroed(3 * UNIT);
        for (i, x) in src.iter_mut().enumerate() {
            *x = (i as u8).wrapping_add(k as u8 * 50 + 1);
        }
        let off = (4 + 7 * k) * UNIT;
        b.write(&file, off as u64, &src)?;
        data[off..off + 3 * UNIT].copy_from_slice(&src);
        let landed = b.read(vec![host_req(&file, 0, 32 * UNIT, 0)])?;
        assert_eq!(landed[0].buf.as_deref(), Some(&data[..]), "{}", b.name());
    }
    Ok(())
}

#[test]
fn empty_batches_zero_lengths_and_notify() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let (file, data) = make_file(dir.path(), "z.bin", 8 * UNIT)?;
    for b in backends(2)? {
        assert!(b.read(Vec::new())?.is_empty());
        let landed = b.read(vec![host_req(&file, 0, 0, 5)])?;
        assert_eq!((landed[0].tag, landed[0].len), (5, 0));
        let (tx, rx) = std::sync::mpsc::channel();
        let ticket = b.read_async(vec![host_req(&file, UNIT, UNIT, 6)])?;
        ticket.notify_on_done(tx, 42);
        // A caller-reaped backend completes reads only while a caller reaps.
        let token = loop {
            if let Ok(t) = rx.try_recv() {
                break t;
            }
            if !b.reap_on_caller() {
                break rx.recv()?;
            }
        };
        assert_eq!(token, 42);
        assert!(ticket.is_done());
        assert_eq!(ticket.wait()?[0].buf.as_deref(), data.get(UNIT..2 * UNIT));
    }
    Ok(())
}

/// A device sink whose "device" is host memory: staging from a landing
/// region, `commit` copies into a byte vector addressed by `dst`.
struct HostDevice {
    staging: Arc<LandingRegion>,
    next: Mutex<usize>,
    memory: Mutex<Vec<u8>>,
}

impl DeviceSink for HostDevice {
    fn stage(&self, len: usize) -> Result<(Arc<LandingRegion>, usize), String> {
        let mut next = self.next.lock().map_err(|e| e.to_string())?;
        let off = *next;
        *next += len.div_ceil(UNIT) * UNIT;
        Ok((self.staging.clone(), off))
    }
    fn commit(&self, offset: usize, len: usize, dst: u64) -> Result<(), String> {
        // SAFETY: the read into this staging slice has landed.
        let src = unsafe { self.staging.slice(offset, len) };
        let mut mem = self.memory.lock().map_err(|e| e.to_string())?;
        let d = dst as usize;
        mem.get_mut(d..d + len)
            .ok_or("dst out of range")?
            .copy_from_slice(src);
        Ok(())
    }
    fn flush(&self) -> Result<(), String> {
        Ok(())
    }
}

#[test]
fn device_landings_reach_the_sink() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let (file, data) = make_file(dir.path(), "d.bin", 16 * UNIT)?;
    for b in backends(4)? {
        let dev = Arc::new(HostDevice {
            staging: LandingRegion::host(16 * UNIT),
            next: Mutex::new(0),
            memory: Mutex::new(vec![0; 16 * UNIT]),
        });
        let reqs = (0..8)
            .map(|i| ReadReq {
                file: file.clone(),
                offset: (i * 2 * UNIT) as u64,
                len: UNIT,
                landing: Landing::Device {
                    sink: dev.clone(),
                    dst: (i * UNIT) as u64,
                },
                tag: i as u64,
            })
            .collect();
        b.read(reqs)?;
        dev.flush().map_err(anyhow::Error::msg)?;
        let mem = dev.memory.lock().map_err(|e| anyhow::anyhow!("{e}"))?;
        for i in 0..8 {
            let want = &data[i * 2 * UNIT..i * 2 * UNIT + UNIT];
            assert_eq!(&mem[i * UNIT..(i + 1) * UNIT], want, "{} dev {i}", b.name());
        }
    }
    Ok(())
}

#[test]
fn open_backend_builds_each_kind() -> anyhow::Result<()> {
    for kind in [
        BackendKind::Uring,
        BackendKind::UringLocal,
        BackendKind::Posix,
        BackendKind::Sim,
    ] {
        let b = open_backend(kind, 4)?;
        assert_eq!(b.queue_depth(), 4);
        let uring = matches!(kind, BackendKind::Uring | BackendKind::UringLocal);
        if uring && b.name() == "posix" {
            flashtier_io::skip::notice(
                "open_backend io_uring",
                "io_uring unavailable, open_backend fell back to posix",
            );
        } else {
            assert_eq!(b.name(), kind.as_str());
        }
        assert_eq!(kind.as_str().parse::<BackendKind>()?, kind);
    }
    assert!(open_backend(BackendKind::Uring, 0).is_err());
    assert!(open_backend(BackendKind::Posix, 257).is_err());
    assert!("nvme".parse::<BackendKind>().is_err());
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(12))]

    /// Random extents in random order, any backend, land the file's bytes.
    #[test]
    fn random_extents_are_exact(
        extents in prop::collection::vec((0usize..120, 1usize..9), 1..48),
        qd in 1usize..20,
    ) {
        let run = || -> anyhow::Result<()> {
            let dir = tempfile::tempdir()?;
            let (file, data) = make_file(dir.path(), "p.bin", 128 * UNIT)?;
            for b in backends(qd)? {
                let reqs = extents
                    .iter()
                    .enumerate()
                    .map(|(i, &(blk, n))| host_req(&file, blk * UNIT, n * UNIT, i as u64))
                    .collect();
                for (l, &(blk, n)) in b.read(reqs)?.iter().zip(&extents) {
                    anyhow::ensure!(
                        l.buf.as_deref() == data.get(blk * UNIT..(blk + n) * UNIT),
                        "{}: wrong bytes at block {blk}", b.name()
                    );
                }
            }
            Ok(())
        };
        run().map_err(|e| TestCaseError::fail(e.to_string()))?;
    }
}

#[test]
fn loadgen_runs_on_every_backend() -> anyhow::Result<()> {
    use flashtier_io::loadgen::{LoadSpec, Pattern, run_load};
    let dir = tempfile::tempdir()?;
    let (file, _) = make_file(dir.path(), "l.bin", 64 * UNIT)?;
    for b in backends(4)? {
        for (pattern, backlog) in [(Pattern::Random, 0), (Pattern::Sequential, 4)] {
            let spec = LoadSpec {
                file: file.clone(),
                span_bytes: 64 * UNIT as u64,
                block_bytes: 2 * UNIT,
                pattern,
                duration: std::time::Duration::from_millis(30),
                seed: 9,
                backlog,
            };
            let report = run_load(b.as_ref(), &spec, |_| {})?;
            assert!(report.ops > 0, "{}", b.name());
            assert_eq!(report.bytes, report.ops * 2 * UNIT as u64);
            assert_eq!(report.latency_ns.len(), report.ops);
            assert_eq!(report.backend, b.name());
        }
        let bad = LoadSpec {
            file: file.clone(),
            span_bytes: 64 * UNIT as u64,
            block_bytes: UNIT,
            pattern: Pattern::Random,
            duration: std::time::Duration::from_millis(1),
            seed: 1,
            backlog: 257,
        };
        assert!(run_load(b.as_ref(), &bad, |_| {}).is_err());
    }
    Ok(())
}

#[test]
fn many_registered_regions_over_time() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let (file, data) = make_file(dir.path(), "g.bin", 8 * UNIT)?;
    for b in backends(2)? {
        // More regions than fixed-buffer slots, each dropped after use: slots
        // are reused and every read stays exact.
        for k in 0..40usize {
            let region = LandingRegion::host(2 * UNIT);
            b.register_landing_region(&region)?;
            let blk = k % 7;
            b.read(vec![ReadReq {
                file: file.clone(),
                offset: (blk * UNIT) as u64,
                len: UNIT,
                landing: Landing::Region {
                    region: region.clone(),
                    offset: UNIT,
                },
                tag: k as u64,
            }])?;
            // SAFETY: the read completed; nothing is in flight into the region.
            let got = unsafe { region.slice(UNIT, UNIT) };
            assert_eq!(
                got,
                &data[blk * UNIT..(blk + 1) * UNIT],
                "{} k {k}",
                b.name()
            );
        }
    }
    Ok(())
}

#[test]
fn uring_split_ops_resubmit_until_exact() -> anyhow::Result<()> {
    let threaded = UringBackend::with_max_op_bytes(4, UNIT);
    let local = UringLocal::with_max_op_bytes(4, UNIT);
    let (threaded, local) = match (threaded, local) {
        (Ok(t), Ok(l)) => (t, l),
        (Err(e), _) | (_, Err(e)) => {
            flashtier_io::skip::notice(
                "uring resubmission",
                &format!("io_uring unavailable here: {e}"),
            );
            return Ok(());
        }
    };
    assert!(UringBackend::with_max_op_bytes(4, 100).is_err());
    assert!(UringLocal::with_max_op_bytes(4, 100).is_err());
    split_ops_exact(&threaded)?;
    split_ops_exact(&local)
}

fn split_ops_exact(backend: &dyn StorageBackend) -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let (file, data) = make_file(dir.path(), "s.bin", 64 * UNIT + 100)?;
    // Every read takes several kernel ops, each continuing where the last
    // stopped, as after a short read.
    let extents = [(0, 16), (3, 5), (40, 24), (63, 1)];
    let reqs = extents
        .iter()
        .enumerate()
        .map(|(i, &(b, n))| host_req(&file, b * UNIT, n * UNIT, i as u64))
        .collect();
    for (l, &(b, n)) in backend.read(reqs)?.iter().zip(&extents) {
        assert_eq!(l.buf.as_deref(), data.get(b * UNIT..(b + n) * UNIT));
    }
    // The file ends inside the third op of this read.
    let err = expect_err(
        backend.read(vec![host_req(&file, 62 * UNIT, 4 * UNIT, 0)]),
        "eof",
    )?;
    assert!(
        matches!(err, IoError::ShortRead { got, .. } if got == 2 * UNIT + 100),
        "{err}"
    );
    Ok(())
}

/// Open references of this process to deleted files under `dir`: its
/// descriptors, and the files registered with its io_uring instances (listed
/// in the ring's fdinfo, not in the descriptor table).
fn deleted_open_files(dir: &Path) -> usize {
    let Ok(entries) = std::fs::read_dir("/proc/self/fd") else {
        return 0;
    };
    let dir = dir.to_string_lossy().into_owned();
    let is_ours = |t: &str| t.contains(dir.as_str()) && t.trim_end().ends_with("(deleted)");
    let mut n = 0;
    for e in entries.flatten() {
        let Ok(target) = std::fs::read_link(e.path()) else {
            continue;
        };
        let target = target.to_string_lossy().into_owned();
        if is_ours(&target) {
            n += 1;
        } else if target.contains("io_uring") {
            let info = format!("/proc/self/fdinfo/{}", e.file_name().to_string_lossy());
            let text = std::fs::read_to_string(info).unwrap_or_default();
            n += text.lines().filter(|l| is_ours(l)).count();
        }
    }
    n
}

#[test]
fn dropped_files_are_closed_and_their_space_freed() -> anyhow::Result<()> {
    if !Path::new("/proc/self/fd").exists() {
        flashtier_io::skip::notice("dropped-file check", "no /proc/self/fd here");
        return Ok(());
    }
    for b in backends(2)? {
        let dir = tempfile::tempdir()?;
        let (keep, _) = make_file(dir.path(), "keep.bin", UNIT)?;
        b.read(vec![host_req(&keep, 0, UNIT, 0)])?;
        // More files than io_uring's registered-file slots, each read, then
        // dropped and unlinked, as a tier rotating stores does.
        for k in 0..80usize {
            let name = format!("f{k}.bin");
            let (file, data) = make_file(dir.path(), &name, 2 * UNIT)?;
            let got = b.read(vec![host_req(&file, UNIT, UNIT, k as u64)])?;
            let bytes = got[0].buf.as_ref().map(|x| x.to_vec()).unwrap_or_default();
            assert_eq!(bytes, &data[UNIT..2 * UNIT], "{} file {k}", b.name());
            drop(file);
            std::fs::remove_file(dir.path().join(&name))?;
        }
        // One more read of a file opened before: when the ring goes idle
        // after it, every dropped file is released.
        b.read(vec![host_req(&keep, 0, UNIT, 0)])?;
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while deleted_open_files(dir.path()) > 0 && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        assert_eq!(
            deleted_open_files(dir.path()),
            0,
            "{}: unlinked files still open after their owners dropped them",
            b.name()
        );
    }
    Ok(())
}

/// Reads that fail before they reach the kernel (a landing too small), back
/// to back on the threaded ring: each must complete, however the reaper's
/// sleep interleaves with the next submission. The reaper once started such
/// a batch in its last look before sleeping, cleared its sleeping flag and
/// slept with nothing in flight, so the next batch never woke it (about
/// once in a hundred reads).
#[test]
fn reads_failing_at_submission_never_leave_the_next_waiting() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let (file, _) = make_file(dir.path(), "w.bin", 4 * UNIT)?;
    let b = match UringBackend::new(2) {
        Ok(b) => Arc::new(b),
        Err(e) => {
            flashtier_io::skip::notice(
                "uring lost wake-up",
                &format!("io_uring unavailable here: {e}"),
            );
            return Ok(());
        }
    };
    let (tx, rx) = std::sync::mpsc::channel();
    let worker = {
        let b = b.clone();
        std::thread::spawn(move || {
            for i in 0..3000u32 {
                // A pause of 0 to 8 us, so submissions land at every point of
                // the reaper's few microseconds between a completion and its
                // sleep.
                let pause = std::time::Duration::from_nanos(
                    u64::from(i.wrapping_mul(2_654_435_761) % 80) * 100,
                );
                let t0 = std::time::Instant::now();
                while t0.elapsed() < pause {
                    std::hint::spin_loop();
                }
                let r = b.read(vec![ReadReq {
                    landing: Landing::Host(AlignedBuf::zeroed(UNIT)),
                    ..host_req(&file, 0, 2 * UNIT, 0)
                }]);
                if !matches!(r, Err(IoError::Landing { .. })) {
                    let _ = tx.send(Err(format!("read {i}: not a landing error")));
                    return;
                }
            }
            let _ = tx.send(Ok(()));
        })
    };
    match rx.recv_timeout(std::time::Duration::from_secs(60)) {
        Ok(Ok(())) => {
            let _ = worker.join();
            Ok(())
        }
        Ok(Err(what)) => anyhow::bail!("{what}"),
        // The worker is stuck in a read; leave it (the process ends).
        Err(_) => anyhow::bail!("a read failing at submission never completed within 60 s"),
    }
}

/// The thread-pool backends meter their reads: every read counted, busy
/// time no longer than the window, reads in flight while busy between one
/// and the queue depth; the others report no activity.
#[test]
fn pool_backends_meter_their_reads() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let (file, _) = make_file(dir.path(), "m.bin", 64 * UNIT)?;
    let queue_depth = 4;
    for b in backends(queue_depth)? {
        let Some(before) = b.activity() else {
            assert!(
                b.name().starts_with("uring"),
                "{} does not meter its reads",
                b.name()
            );
            continue;
        };
        let started = std::time::Instant::now();
        let reqs = (0..32)
            .map(|i| host_req(&file, (i * 2 % 64) * UNIT, UNIT, i as u64))
            .collect();
        b.read(reqs)?;
        let window = started.elapsed();
        let after = b.activity().expect("metered once, metered always");
        let d = after.since(&before);
        assert_eq!(d.reads, 32, "{}", b.name());
        assert!(d.busy > std::time::Duration::ZERO, "{}", b.name());
        assert!(d.busy <= window, "{}: {d:?} in {window:?}", b.name());
        let mean = d.mean_in_flight_while_busy();
        assert!(
            (1.0..=queue_depth as f64 + 1e-9).contains(&mean),
            "{}: {mean} reads in flight",
            b.name()
        );
        let share = d.busy_share(window);
        assert!((0.0..=1.0).contains(&share), "{}: {share}", b.name());
    }
    Ok(())
}
