//! Fault injection through the simulated backend: every injected fault is an
//! error naming path, offset and length, never wrong bytes; short reads are
//! resubmitted until exact; torn writes are visible to a reader.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use flashtier_io::sim::{Fault, FaultPlan, OpKind, SimBackend};
use flashtier_io::{
    AlignedBuf, DirectMode, IoError, Landing, LandingRegion, ReadReq, StorageBackend, StoreFile,
};
use proptest::prelude::*;

const UNIT: usize = 4096;

fn pattern(len: usize, salt: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add((i >> 12) as u8) ^ salt)
        .collect()
}

fn make_file(dir: &Path, len: usize) -> anyhow::Result<(Arc<StoreFile>, Vec<u8>)> {
    let path = dir.join("data.bin");
    let data = pattern(len, 0x5a);
    std::fs::write(&path, &data)?;
    Ok((StoreFile::open_rw(&path, DirectMode::Prefer, false)?, data))
}

fn host_req(file: &Arc<StoreFile>, offset: u64, len: usize, tag: u64) -> ReadReq {
    ReadReq {
        file: file.clone(),
        offset,
        len,
        landing: Landing::Host(AlignedBuf::zeroed(len)),
        tag,
    }
}

/// The error names the file, the offset and the length of the request.
fn assert_names(err: &IoError, file: &StoreFile, offset: u64, len: usize) {
    let msg = err.to_string();
    assert!(msg.contains(&file.path().display().to_string()), "{msg}");
    assert!(msg.contains(&format!("offset {offset}")), "{msg}");
    assert!(msg.contains(&format!("length {len}")), "{msg}");
}

#[test]
fn short_reads_land_exact_bytes_and_show_in_stats() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let (file, data) = make_file(dir.path(), 64 * UNIT)?;
    let sim = SimBackend::new(FaultPlan::seeded(11).short_reads(1.0), 4)?;
    let reqs = (0..16)
        .map(|i| host_req(&file, (i * 4 * UNIT) as u64, 4 * UNIT, i as u64))
        .collect();
    let landed = sim.read(reqs)?;
    for (i, l) in landed.iter().enumerate() {
        assert_eq!(l.tag, i as u64);
        let off = i * 4 * UNIT;
        assert_eq!(l.buf.as_deref(), data.get(off..off + 4 * UNIT));
    }
    assert!(sim.stats().short_reads >= 16);
    Ok(())
}

#[test]
fn read_eio_names_the_request_and_fails_the_ticket() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let (file, _) = make_file(dir.path(), 8 * UNIT)?;
    let sim = SimBackend::new(FaultPlan::seeded(1).read_eio(1.0), 2)?;
    let err = sim
        .read(vec![host_req(&file, 2 * UNIT as u64, UNIT, 0)])
        .err()
        .ok_or_else(|| anyhow::anyhow!("EIO was not reported"))?;
    assert!(matches!(err, IoError::Read { .. }));
    assert_names(&err, &file, 2 * UNIT as u64, UNIT);
    assert_eq!(sim.stats().read_eio, 1);
    Ok(())
}

#[test]
fn countdown_fails_exactly_the_nth_read_and_names_it() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let (file, data) = make_file(dir.path(), 16 * UNIT)?;
    let sim = SimBackend::new(
        FaultPlan::seeded(2).fail_nth(OpKind::Read, 3, Fault::Eio),
        1,
    )?;
    for i in 0..6u64 {
        let off = i * UNIT as u64;
        let got = sim.read(vec![host_req(&file, off, UNIT, i)]);
        if i == 2 {
            let err = got
                .err()
                .ok_or_else(|| anyhow::anyhow!("3rd read passed"))?;
            assert_names(&err, &file, off, UNIT);
        } else {
            let landed = got?;
            let o = off as usize;
            assert_eq!(landed[0].buf.as_deref(), data.get(o..o + UNIT));
        }
    }
    Ok(())
}

#[test]
fn faults_only_inside_the_offset_range() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let (file, _) = make_file(dir.path(), 16 * UNIT)?;
    let range = (4 * UNIT) as u64..(8 * UNIT) as u64;
    let sim = SimBackend::new(FaultPlan::seeded(3).read_eio(1.0).in_range(range), 2)?;
    for i in 0..16u64 {
        let off = i * UNIT as u64;
        let r = sim.read(vec![host_req(&file, off, UNIT, i)]);
        assert_eq!(r.is_err(), (4..8).contains(&i), "block {i}");
    }
    Ok(())
}

#[test]
fn enospc_writes_nothing_and_names_the_write() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let (file, data) = make_file(dir.path(), 8 * UNIT)?;
    let sim = SimBackend::new(FaultPlan::seeded(4).enospc(1.0), 1)?;
    let mut src = AlignedBuf::zeroed(2 * UNIT);
    src.fill(0xee);
    let err = sim
        .write(&file, UNIT as u64, &src)
        .err()
        .ok_or_else(|| anyhow::anyhow!("ENOSPC was not reported"))?;
    assert_names(&err, &file, UNIT as u64, 2 * UNIT);
    assert!(err.to_string().contains("No space left"), "{err}");
    let landed = sim.read(vec![host_req(&file, 0, 8 * UNIT, 0)])?;
    assert_eq!(landed[0].buf.as_deref(), Some(&data[..]));
    Ok(())
}

#[test]
fn torn_write_is_reported_and_the_reader_sees_it() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let (file, data) = make_file(dir.path(), 16 * UNIT)?;
    let sim = SimBackend::new(FaultPlan::seeded(5).torn_writes(1.0), 1)?;
    let mut src = AlignedBuf::zeroed(8 * UNIT);
    src.fill(0xab);
    let err = sim
        .write(&file, 4 * UNIT as u64, &src)
        .err()
        .ok_or_else(|| anyhow::anyhow!("torn write was not reported"))?;
    assert_names(&err, &file, 4 * UNIT as u64, 8 * UNIT);
    assert_eq!(sim.stats().torn_writes, 1);
    // Read back through a clean backend: the extent is neither the old nor
    // the new bytes, it is an aligned prefix of the new followed by the old.
    let clean = SimBackend::new(FaultPlan::off(), 1)?;
    let landed = clean.read(vec![host_req(&file, 4 * UNIT as u64, 8 * UNIT, 0)])?;
    let back = landed[0].buf.as_deref().unwrap_or_default();
    assert_ne!(back, &src[..], "torn write must not read back as complete");
    let keep = back.iter().take_while(|&&b| b == 0xab).count();
    assert_eq!(keep % UNIT, 0);
    assert_eq!(&back[keep..], &data[4 * UNIT + keep..12 * UNIT]);
    Ok(())
}

#[test]
fn latency_delays_but_keeps_bytes() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let (file, data) = make_file(dir.path(), 4 * UNIT)?;
    let sim = SimBackend::new(
        FaultPlan::seeded(6).latency(1.0, Duration::from_millis(2)),
        2,
    )?;
    let landed = sim.read(vec![host_req(&file, 0, 4 * UNIT, 9)])?;
    assert_eq!(landed[0].buf.as_deref(), Some(&data[..]));
    assert_eq!(sim.stats().delayed, 1);
    Ok(())
}

#[test]
fn same_seed_same_faults() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let (file, _) = make_file(dir.path(), 32 * UNIT)?;
    let run = || -> anyhow::Result<Vec<bool>> {
        let sim = SimBackend::new(FaultPlan::seeded(77).read_eio(0.3), 4)?;
        Ok((0..32u64)
            .map(|i| {
                sim.read(vec![host_req(&file, i * UNIT as u64, UNIT, i)])
                    .is_err()
            })
            .collect())
    };
    assert_eq!(run()?, run()?);
    Ok(())
}

#[test]
fn region_landing_with_faults_is_exact_or_an_error() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let (file, data) = make_file(dir.path(), 32 * UNIT)?;
    let sim = SimBackend::new(FaultPlan::seeded(8).short_reads(0.7).read_eio(0.2), 4)?;
    let region = LandingRegion::host(32 * UNIT);
    for i in 0..32usize {
        let req = ReadReq {
            file: file.clone(),
            offset: (i * UNIT) as u64,
            len: UNIT,
            landing: Landing::Region {
                region: region.clone(),
                offset: i * UNIT,
            },
            tag: i as u64,
        };
        match sim.read(vec![req]) {
            Ok(_) => {
                // SAFETY: the ticket completed; no read targets this slot now.
                let got = unsafe { region.slice(i * UNIT, UNIT) };
                assert_eq!(got, &data[i * UNIT..(i + 1) * UNIT]);
            }
            Err(e) => assert_names(&e, &file, (i * UNIT) as u64, UNIT),
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    /// Any seed and fault mix: each request either lands exactly the file's
    /// bytes or fails with an error naming it; nothing else.
    #[test]
    fn faults_never_give_wrong_bytes(
        seed in any::<u64>(),
        short in 0.0f64..=1.0,
        eio in 0.0f64..0.5,
        extents in prop::collection::vec((0usize..60, 1usize..5), 1..12),
    ) {
        let dir = tempfile::tempdir().map_err(|e| TestCaseError::fail(e.to_string()))?;
        let (file, data) = make_file(dir.path(), 64 * UNIT)
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
        let plan = FaultPlan::seeded(seed).short_reads(short).read_eio(eio);
        let sim = SimBackend::new(plan, 3).map_err(|e| TestCaseError::fail(e.to_string()))?;
        for (i, (blk, n)) in extents.into_iter().enumerate() {
            let (off, len) = (blk * UNIT, n * UNIT);
            match sim.read(vec![host_req(&file, off as u64, len, i as u64)]) {
                Ok(landed) => {
                    prop_assert_eq!(landed[0].tag, i as u64);
                    prop_assert_eq!(landed[0].buf.as_deref(), data.get(off..off + len));
                }
                Err(e) => {
                    let msg = e.to_string();
                    prop_assert!(msg.contains(&format!("offset {off}")), "{}", msg);
                    prop_assert!(msg.contains(&format!("length {len}")), "{}", msg);
                }
            }
        }
    }
}
