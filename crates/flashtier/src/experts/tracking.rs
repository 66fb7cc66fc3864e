//! Read tracking: for each (layer, precision, source), how many records were
//! used, how many bytes, and a latency histogram (hdrhistogram, ns, 3
//! significant digits).
//!
//! Sources: `hit` (resident, no read), `page-cache` (mapped backing: the
//! pages were in memory, admitted without a read; latency is the residency
//! check plus checksum), `disk` (a read for a miss, latency from submission to
//! landing), `prefetch` (a read started by `prefetch`, counted when it lands).
//! Bound: one entry per (layer, precision, source) seen, at most
//! `layers * 3 * 4`, each a fixed-size histogram (~40 KiB).

use std::collections::BTreeMap;

use hdrhistogram::Histogram;

use super::Precision;

/// Where a record used by a step came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum ReadSource {
    /// Already resident.
    Hit,
    /// Mapped backing: found in the page cache.
    PageCache,
    /// Read from the drive for a miss.
    Disk,
    /// Read from the drive by a prefetch.
    Prefetch,
}

/// Highest latency the histograms hold (one hour, in ns); larger values saturate.
const MAX_LATENCY_NS: u64 = 3_600_000_000_000;

struct Entry {
    count: u64,
    bytes: u64,
    latency_ns: Histogram<u64>,
}

/// The tracker.
#[derive(Default)]
pub struct ReadTracker {
    entries: BTreeMap<(u32, Precision, ReadSource), Entry>,
}

impl std::fmt::Debug for ReadTracker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ReadTracker({} entries)", self.entries.len())
    }
}

/// One row of [`ReadTracker::rows`].
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct ReadRow {
    /// Layer.
    pub layer: u32,
    /// Precision of the record.
    pub precision: Precision,
    /// Source.
    pub source: ReadSource,
    /// Records.
    pub count: u64,
    /// Bytes.
    pub bytes: u64,
    /// Median latency.
    pub latency_ns_p50: u64,
    /// 99th percentile latency.
    pub latency_ns_p99: u64,
    /// 99.9th percentile latency.
    pub latency_ns_p999: u64,
    /// Largest latency.
    pub latency_ns_max: u64,
}

/// Totals over layers for one source.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
pub struct SourceTotal {
    /// Records.
    pub count: u64,
    /// Bytes.
    pub bytes: u64,
}

impl ReadTracker {
    /// Count one record of `bytes` from `source` that took `latency_ns`.
    pub fn record(
        &mut self,
        layer: u32,
        precision: Precision,
        source: ReadSource,
        bytes: u64,
        latency_ns: u64,
    ) {
        let e = self
            .entries
            .entry((layer, precision, source))
            .or_insert_with(|| Entry {
                count: 0,
                bytes: 0,
                latency_ns: Histogram::new_with_bounds(1, MAX_LATENCY_NS, 3).expect(
                    "constant bounds satisfy hdrhistogram (low >= 1, high >= 2 low, sigfig <= 5)",
                ),
            });
        e.count += 1;
        e.bytes += bytes;
        e.latency_ns.saturating_record(latency_ns.max(1));
    }

    /// One row per (layer, precision, source), in that order.
    #[must_use]
    pub fn rows(&self) -> Vec<ReadRow> {
        self.entries
            .iter()
            .map(|(&(layer, precision, source), e)| ReadRow {
                layer,
                precision,
                source,
                count: e.count,
                bytes: e.bytes,
                latency_ns_p50: e.latency_ns.value_at_quantile(0.5),
                latency_ns_p99: e.latency_ns.value_at_quantile(0.99),
                latency_ns_p999: e.latency_ns.value_at_quantile(0.999),
                latency_ns_max: e.latency_ns.max(),
            })
            .collect()
    }

    /// Totals for `source` over every layer and precision.
    #[must_use]
    pub fn total(&self, source: ReadSource) -> SourceTotal {
        self.entries
            .iter()
            .filter(|((_, _, s), _)| *s == source)
            .fold(SourceTotal::default(), |acc, (_, e)| SourceTotal {
                count: acc.count + e.count,
                bytes: acc.bytes + e.bytes,
            })
    }

    /// Latency quantile `q` over every entry of `source` (0 when none).
    #[must_use]
    pub fn latency_ns_quantile(&self, source: ReadSource, q: f64) -> u64 {
        let mut all: Option<Histogram<u64>> = None;
        for ((_, _, s), e) in &self.entries {
            if *s != source {
                continue;
            }
            match &mut all {
                None => all = Some(e.latency_ns.clone()),
                Some(h) => {
                    let _ = h.add(&e.latency_ns);
                }
            }
        }
        all.map_or(0, |h| h.value_at_quantile(q))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_and_totals() {
        let mut t = ReadTracker::default();
        t.record(1, Precision::Full, ReadSource::Disk, 4096, 1000);
        t.record(1, Precision::Full, ReadSource::Disk, 4096, 3000);
        t.record(0, Precision::Q2, ReadSource::Hit, 100, 0);
        let rows = t.rows();
        assert_eq!(rows.len(), 2);
        assert_eq!((rows[0].layer, rows[0].source), (0, ReadSource::Hit));
        assert_eq!((rows[1].count, rows[1].bytes), (2, 8192));
        assert!(rows[1].latency_ns_max >= 2990);
        assert_eq!(t.total(ReadSource::Disk).bytes, 8192);
        assert!(t.latency_ns_quantile(ReadSource::Disk, 1.0) >= 2990);
    }
}
