//! fio, the drive's own limit in every bench: one job builder ([`Job`]) with
//! the benches' variations as parameters, the one place that runs fio and
//! reads its JSON report.
//!
//! Every job reads or writes with O_DIRECT. Random jobs always pass
//! `--randrepeat=0`: fio 3.33 ignores `--randseed` otherwise and re-reads its
//! previous run's (host-cached) offsets. A time-based random job also drops
//! fio's random map (`--norandommap`, 64-bit Tausworthe offsets), so it
//! draws fresh offsets for its whole runtime; a job of a given size reads
//! every block of it once.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

/// fio's version string.
pub fn version() -> Result<String> {
    let out = Command::new("fio")
        .arg("--version")
        .output()
        .context("fio not found (apt-get install -y fio)")?;
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// Whether fio is installed.
pub fn available() -> bool {
    Command::new("fio")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
}

/// The access pattern of a job.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rw {
    /// Sequential reads.
    Read,
    /// Random reads (fresh offsets every run).
    RandRead,
    /// Sequential writes, synced at the end.
    Write,
}

/// One fio job: `fio --name=NAME --filename=FILE --rw=.. --bs=.. --direct=1`
/// plus what the setters add.
#[derive(Clone, Debug)]
pub struct Job {
    name: String,
    file: PathBuf,
    rw: Rw,
    bs: u64,
    engine: String,
    depth: usize,
    jobs: usize,
    span: Option<(u64, u64)>,
    io_total: Option<u64>,
    runtime_ms: Option<u64>,
    extra: Vec<String>,
}

impl Job {
    /// A job named `name` on `file` in `bs`-byte ops: libaio, queue depth 1,
    /// one process, the whole file.
    pub fn new(name: &str, file: &Path, rw: Rw, bs: u64) -> Self {
        Self {
            name: name.to_string(),
            file: file.to_path_buf(),
            rw,
            bs,
            engine: "libaio".into(),
            depth: 1,
            jobs: 1,
            span: None,
            io_total: None,
            runtime_ms: None,
            extra: Vec::new(),
        }
    }

    /// `qd` ops in flight with `engine`: one job at depth `qd`, or, for the
    /// synchronous `psync`, `qd` jobs of one op each (reported together).
    #[must_use]
    pub fn queue(mut self, engine: &str, qd: usize) -> Self {
        self.engine = engine.to_string();
        (self.depth, self.jobs) = if engine == "psync" { (1, qd) } else { (qd, 1) };
        self
    }

    /// The bytes `[offset, offset + size)` of the file.
    #[must_use]
    pub fn span(mut self, offset: u64, size: u64) -> Self {
        self.span = Some((offset, size));
        self
    }

    /// Stop after `bytes` in all (split over the jobs).
    #[must_use]
    pub fn io_total(mut self, bytes: u64) -> Self {
        self.io_total = Some(bytes);
        self
    }

    /// Run for `seconds` (at least 1 ms) instead of until the span is done.
    #[must_use]
    pub fn time_based(mut self, seconds: f64) -> Self {
        self.runtime_ms = Some((seconds * 1000.0).max(1.0) as u64);
        self
    }

    /// One more fio option (`--fixedbufs=1`, `--zonemode=strided`, ...).
    #[must_use]
    pub fn arg(mut self, arg: impl Into<String>) -> Self {
        self.extra.push(arg.into());
        self
    }

    /// The command-line options, `--output-format` aside.
    pub fn args(&self) -> Vec<String> {
        let rw = match self.rw {
            Rw::Read => "read",
            Rw::RandRead => "randread",
            Rw::Write => "write",
        };
        let mut a = vec![
            format!("--name={}", self.name),
            format!("--filename={}", self.file.display()),
            format!("--rw={rw}"),
            format!("--bs={}", self.bs),
            "--direct=1".into(),
            format!("--ioengine={}", self.engine),
            format!("--iodepth={}", self.depth),
            format!("--numjobs={}", self.jobs),
            "--group_reporting".into(),
        ];
        if let Some((offset, size)) = self.span {
            a.extend([format!("--offset={offset}"), format!("--size={size}")]);
        }
        if let Some(total) = self.io_total {
            a.push(format!("--io_size={}", total / self.jobs.max(1) as u64));
        }
        if self.rw == Rw::RandRead {
            a.push("--randrepeat=0".into());
        }
        if let Some(ms) = self.runtime_ms {
            a.extend(["--time_based".into(), format!("--runtime={ms}ms")]);
            if self.rw == Rw::RandRead {
                a.extend([
                    "--norandommap".into(),
                    "--random_generator=tausworthe64".into(),
                ]);
            }
        }
        if self.rw == Rw::Write {
            a.push("--end_fsync=1".into());
        }
        a.extend(self.extra.iter().cloned());
        a
    }

    /// `fio ARGS`, for a report.
    pub fn command_line(&self) -> String {
        format!("fio {}", self.args().join(" "))
    }

    /// Run the job; fio's JSON report (notices fio prints before it skipped).
    pub fn run(&self) -> Result<serde_json::Value> {
        let args = self.args();
        let out = Command::new("fio")
            .args(&args)
            .arg("--output-format=json")
            .output()
            .context("running fio (install it: apt-get install -y fio)")?;
        if !out.status.success() {
            bail!(
                "{} failed: {}",
                self.command_line(),
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        let text = String::from_utf8_lossy(&out.stdout);
        let start = text.find('{').context("fio printed no JSON")?;
        serde_json::from_str(&text[start..]).context("parsing fio JSON")
    }

    /// Run the job and read its reads' side.
    pub fn read(&self) -> Result<Stats> {
        stats(&self.run()?, "read")
    }

    /// Run the job and read its writes' side.
    pub fn write(&self) -> Result<Stats> {
        stats(&self.run()?, "write")
    }
}

/// One side (reads or writes) of a report's jobs, all together.
#[derive(Clone, Copy, Debug, Default)]
pub struct Stats {
    /// Ops per second.
    pub iops: f64,
    /// Bytes per second.
    pub bytes_per_sec: f64,
    /// Bytes moved.
    pub io_bytes: u64,
    /// Completion latency percentiles (fio's `clat`), microseconds.
    pub lat_us_p50: f64,
    /// 99th percentile.
    pub lat_us_p99: f64,
    /// 99.9th percentile.
    pub lat_us_p999: f64,
}

/// The `side` (`read` or `write`) of `report`; an error when it has none.
fn stats(report: &serde_json::Value, side: &str) -> Result<Stats> {
    let s = &report["jobs"][0][side];
    let bytes_per_sec = s["bw_bytes"]
        .as_f64()
        .with_context(|| format!("fio JSON has no jobs[0].{side}.bw_bytes"))?;
    let pct = |k: &str| s["clat_ns"]["percentile"][k].as_f64().unwrap_or(0.0) / 1e3;
    Ok(Stats {
        iops: s["iops"].as_f64().unwrap_or(0.0),
        bytes_per_sec,
        io_bytes: s["io_bytes"].as_u64().unwrap_or(0),
        lat_us_p50: pct("50.000000"),
        lat_us_p99: pct("99.000000"),
        lat_us_p999: pct("99.900000"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_variations_are_parameters() {
        let f = Path::new("/tmp/x");
        let random = Job::new("r", f, Rw::RandRead, 4096)
            .queue("io_uring", 32)
            .time_based(2.0)
            .args();
        for want in [
            "--rw=randread",
            "--randrepeat=0",
            "--norandommap",
            "--iodepth=32",
            "--runtime=2000ms",
        ] {
            assert!(random.iter().any(|a| a == want), "{want} in {random:?}");
        }
        let once = Job::new("o", f, Rw::RandRead, 4096).span(0, 1 << 20).args();
        assert!(once.iter().any(|a| a == "--randrepeat=0"));
        assert!(
            !once.iter().any(|a| a == "--norandommap"),
            "a sized job reads each block once"
        );
        let psync = Job::new("p", f, Rw::Read, 8192)
            .queue("psync", 4)
            .io_total(1 << 20)
            .args();
        for want in [
            "--iodepth=1",
            "--numjobs=4",
            "--io_size=262144",
            "--rw=read",
        ] {
            assert!(psync.iter().any(|a| a == want), "{want} in {psync:?}");
        }
        let write = Job::new("w", f, Rw::Write, 4 << 20).args();
        assert!(write.iter().any(|a| a == "--end_fsync=1"));
        assert!(!write.iter().any(|a| a == "--randrepeat=0"));
    }

    #[test]
    fn reports_are_read_by_side() {
        let v = serde_json::json!({"jobs": [{"read": {"bw_bytes": 2.0e9, "iops": 5.0e5, "io_bytes": 77,
            "clat_ns": {"percentile": {"50.000000": 1000.0, "99.000000": 9000.0}}},
            "write": {}}]});
        let r = stats(&v, "read").unwrap();
        assert_eq!((r.bytes_per_sec, r.iops, r.io_bytes), (2.0e9, 5.0e5, 77));
        assert_eq!((r.lat_us_p50, r.lat_us_p99, r.lat_us_p999), (1.0, 9.0, 0.0));
        assert!(stats(&v, "write").is_err());
    }
}
