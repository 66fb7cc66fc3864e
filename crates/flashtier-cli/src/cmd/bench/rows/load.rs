//! Load generators and timed phases of `flashtier bench rows`.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use flashtier::rows::RowStore;
use hdrhistogram::Histogram;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

/// Zipf-like ids over `rows`: rank `r` drawn from the continuous power law
/// with exponent `s` (inverse CDF), then scattered over the table by a
/// bijection `r * mul mod rows`, so hot rows are not neighbours.
pub struct Zipf {
    rows: u64,
    s: f64,
    mul: u64,
    rng: SmallRng,
}

fn gcd(mut a: u64, mut b: u64) -> u64 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

impl Zipf {
    /// A generator; `s = 0` is uniform.
    pub fn new(rows: u64, s: f64, seed: u64) -> Self {
        let mut mul = 0x9E37_79B9_7F4A_7C15 % rows.max(1);
        while rows > 1 && gcd(mul, rows) != 1 {
            mul += 1;
        }
        Self {
            rows: rows.max(1),
            s,
            mul: mul.max(1),
            rng: SmallRng::seed_from_u64(seed),
        }
    }

    /// The next id.
    pub fn next_id(&mut self) -> u64 {
        let n = self.rows as f64;
        let u: f64 = self.rng.random();
        let rank = if self.s <= 0.0 {
            u * n
        } else if (self.s - 1.0).abs() < 1e-9 {
            n.powf(u) - 1.0
        } else {
            let a = 1.0 - self.s;
            ((n.powf(a) - 1.0) * u + 1.0).powf(1.0 / a) - 1.0
        };
        let r = (rank.max(0.0) as u64).min(self.rows - 1);
        ((u128::from(r) * u128::from(self.mul)) % u128::from(self.rows)) as u64
    }

    /// A batch of `n` ids.
    pub fn batch(&mut self, n: usize) -> Vec<u64> {
        (0..n).map(|_| self.next_id()).collect()
    }
}

/// What one timed phase measured.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct Phase {
    /// Lookup calls.
    pub batches: u64,
    /// Ids looked up.
    pub ids: u64,
    /// Read operations issued by the store.
    pub reads: u64,
    /// Cache hits.
    pub hits: u64,
    /// Distinct rows read.
    pub misses: u64,
    /// Wall seconds.
    pub seconds: f64,
    /// Per-batch latency percentiles, microseconds.
    pub batch_us_p50: f64,
    /// 99th percentile.
    pub batch_us_p99: f64,
    /// 99.9th percentile.
    pub batch_us_p999: f64,
}

impl Phase {
    /// Reads per second.
    pub fn read_iops(&self) -> f64 {
        self.reads as f64 / self.seconds.max(1e-9)
    }
    /// Ids served per second.
    pub fn rows_per_sec(&self) -> f64 {
        self.ids as f64 / self.seconds.max(1e-9)
    }
    /// Lookup calls per second.
    pub fn lookups_per_sec(&self) -> f64 {
        self.batches as f64 / self.seconds.max(1e-9)
    }
    /// Hits over hits plus misses.
    pub fn hit_rate(&self) -> f64 {
        self.hits as f64 / ((self.hits + self.misses) as f64).max(1.0)
    }
}

/// One timed phase in progress: the store's counters at the start, the
/// per-batch latency histogram and the output buffers, reused across batches.
struct Run<'a> {
    store: &'a RowStore,
    before: flashtier::rows::RowStats,
    hist: Histogram<u64>,
    deadline: Duration,
    t0: Instant,
    weights: Vec<u8>,
    scales: Vec<u8>,
    phase: Phase,
}

impl<'a> Run<'a> {
    fn start(store: &'a RowStore, seconds: f64) -> anyhow::Result<Self> {
        Ok(Self {
            store,
            before: store.stats(),
            hist: Histogram::<u64>::new(3)?,
            deadline: Duration::from_secs_f64(seconds),
            t0: Instant::now(),
            weights: Vec::new(),
            scales: Vec::new(),
            phase: Phase::default(),
        })
    }

    /// Whether to run another batch (at least one, then until the deadline).
    fn going(&self) -> bool {
        self.phase.batches == 0 || self.t0.elapsed() < self.deadline
    }

    /// Look up `batch`, timing `first` (a wait, say) and the lookup together.
    fn lookup(
        &mut self,
        batch: &[u64],
        first: impl FnOnce() -> anyhow::Result<()>,
    ) -> anyhow::Result<()> {
        let g = self.store.geometry();
        self.weights.resize(batch.len() * g.w(), 0);
        self.scales.resize(batch.len() * g.s(), 0);
        let t = Instant::now();
        first()?;
        self.store
            .lookup(batch, &mut self.weights, &mut self.scales)?;
        self.hist.record(t.elapsed().as_nanos() as u64)?;
        self.phase.batches += 1;
        self.phase.ids += batch.len() as u64;
        Ok(())
    }

    /// The phase: wall time, the store's counters since the start, and the
    /// batch latency percentiles.
    fn finish(self) -> Phase {
        let mut p = self.phase;
        p.seconds = self.t0.elapsed().as_secs_f64();
        let after = self.store.stats();
        p.reads = after.reads - self.before.reads;
        p.hits = after.hits - self.before.hits;
        p.misses = after.misses - self.before.misses;
        p.batch_us_p50 = self.hist.value_at_quantile(0.5) as f64 / 1e3;
        p.batch_us_p99 = self.hist.value_at_quantile(0.99) as f64 / 1e3;
        p.batch_us_p999 = self.hist.value_at_quantile(0.999) as f64 / 1e3;
        p
    }
}

/// Look up batches from `ids` for `seconds` (at least one batch).
pub fn timed(
    store: &RowStore,
    seconds: f64,
    mut ids: impl FnMut() -> Vec<u64>,
) -> anyhow::Result<Phase> {
    let mut run = Run::start(store, seconds)?;
    while run.going() {
        run.lookup(&ids(), || Ok(()))?;
    }
    Ok(run.finish())
}

/// One caller looking up batches from `ids` for `seconds` with the next
/// `ahead` batches' prefetches in flight (Engram's order: the next step's
/// rows are known one step early). Each step starts the prefetch of a new
/// batch, waits for the oldest one, then looks it up (all hits); the batch
/// latency recorded is that wait plus the lookup. Prefetches still in flight
/// at the deadline are waited for inside the timed span, and their reads
/// counted, so the figure includes the final drain.
pub fn timed_ahead(
    store: &RowStore,
    seconds: f64,
    ahead: usize,
    mut ids: impl FnMut() -> Vec<u64>,
) -> anyhow::Result<Phase> {
    let mut run = Run::start(store, seconds)?;
    let mut queue = VecDeque::with_capacity(ahead + 1);
    while run.going() {
        while queue.len() <= ahead {
            let batch = ids();
            let started = store.prefetch_start(&batch)?;
            queue.push_back((batch, started));
        }
        let Some((batch, started)) = queue.pop_front() else {
            break;
        };
        run.lookup(&batch, || Ok(started.wait()?))?;
    }
    for (_, started) in queue {
        started.wait()?;
    }
    Ok(run.finish())
}

/// The hit path against plain copies of the same bytes.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct HitPath {
    /// Rows per batch.
    pub batch: usize,
    /// Nanoseconds per row on the cache hit path.
    pub lookup_ns_per_row: f64,
    /// Nanoseconds per row gathering the same rows from a RAM table.
    pub memcpy_gather_ns_per_row: f64,
    /// Nanoseconds per row copying the batch's bytes contiguously.
    pub memcpy_contiguous_ns_per_row: f64,
    /// lookup / gather.
    pub ratio_vs_gather: f64,
    /// lookup / contiguous.
    pub ratio_vs_contiguous: f64,
}

/// Time `batch` cached rows against memcpy baselines (best of 5 rounds).
pub fn hit_path(store: &RowStore, batch: usize, seed: u64) -> anyhow::Result<HitPath> {
    let g = store.geometry();
    let (lo, hi) = store.range();
    let mut z = Zipf::new(hi - lo, 0.0, seed);
    let mut ids: Vec<u64> = (0..batch).map(|_| lo + z.next_id()).collect();
    ids.sort_unstable();
    ids.dedup();
    store.prefetch(&ids)?;
    let n = ids.len();
    let (mut w, mut s) = (vec![0u8; n * g.w()], vec![0u8; n * g.s()]);
    let before = store.stats();
    store.lookup(&ids, &mut w, &mut s)?;
    anyhow::ensure!(
        store.stats().misses == before.misses,
        "hit-path rows were not all cached (cache too small?)"
    );
    // The same rows scattered over a RAM table as large as the cache, so
    // the copies see the same cache and TLB footprint as the hit path.
    let slots = (usize::try_from(store.stats().cache_bytes).unwrap_or(0) / g.stride()).max(n * 64);
    // Written through, so every page is real memory: a zeroed allocation
    // left untouched maps every page to the kernel's one zero page, whose
    // 64 lines would all sit in L1 and flatter the baseline.
    let mut ram: Vec<u8> = (0..slots * g.stride()).map(|i| i as u8).collect();
    let mut rng = SmallRng::seed_from_u64(seed);
    let at: Vec<usize> = (0..n)
        .map(|_| rng.random_range(0..slots) * g.stride())
        .collect();
    let contiguous = vec![7u8; n * g.stride()];
    let reps = (2_000_000 / n.max(1)).max(10);
    let mut best = [f64::MAX; 3];
    for _ in 0..5 {
        let t = Instant::now();
        for _ in 0..reps {
            store.lookup(std::hint::black_box(&ids), &mut w, &mut s)?;
        }
        best[0] = best[0].min(t.elapsed().as_secs_f64());
        let t = Instant::now();
        for _ in 0..reps {
            for (i, &a) in std::hint::black_box(&at).iter().enumerate() {
                w[i * g.w()..(i + 1) * g.w()].copy_from_slice(&ram[a..a + g.w()]);
                s[i * g.s()..(i + 1) * g.s()].copy_from_slice(&ram[a + g.w()..a + g.stride()]);
            }
            std::hint::black_box(&mut w);
        }
        best[1] = best[1].min(t.elapsed().as_secs_f64());
        let t = Instant::now();
        for _ in 0..reps {
            w.copy_from_slice(&std::hint::black_box(&contiguous)[..n * g.w()]);
            s.copy_from_slice(&contiguous[n * g.w()..]);
            std::hint::black_box(&mut w);
        }
        best[2] = best[2].min(t.elapsed().as_secs_f64());
        ram[0] = ram[0].wrapping_add(1);
    }
    let per_row = |secs: f64| secs * 1e9 / (reps * n) as f64;
    let h = HitPath {
        batch: n,
        lookup_ns_per_row: per_row(best[0]),
        memcpy_gather_ns_per_row: per_row(best[1]),
        memcpy_contiguous_ns_per_row: per_row(best[2]),
        ..Default::default()
    };
    Ok(HitPath {
        ratio_vs_gather: h.lookup_ns_per_row / h.memcpy_gather_ns_per_row,
        ratio_vs_contiguous: h.lookup_ns_per_row / h.memcpy_contiguous_ns_per_row,
        ..h
    })
}

/// The hit path with the rows in DRAM rather than in the core's caches.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct DramHitPath {
    /// Rows per batch.
    pub batch: usize,
    /// Distinct cached rows the batches are drawn from.
    pub pool_rows: usize,
    /// Bytes of the cache's slab and of the gather baseline's table.
    pub table_bytes: u64,
    /// Nanoseconds per row on the cache hit path.
    pub lookup_ns_per_row: f64,
    /// Nanoseconds per row gathering as many random rows from a RAM table
    /// as large as the cache.
    pub memcpy_gather_ns_per_row: f64,
    /// lookup / gather.
    pub ratio_vs_gather: f64,
}

/// Time cache hits whose rows sit in DRAM: `pool` rows (at most the table's
/// owned rows) are cached first, every one checked to be a hit, then each
/// batch draws `batch` fresh random rows of them, so its sets and rows are
/// not in the core's caches (a 32 MiB L3 holds a tenth of the pool's lines).
/// The baseline gathers as many random rows from a table written through,
/// as large as the cache. Best of 5 rounds of 2000 batches each.
pub fn hit_path_dram(
    store: &RowStore,
    batch: usize,
    pool: usize,
    seed: u64,
) -> anyhow::Result<DramHitPath> {
    let g = store.geometry();
    let (lo, hi) = store.range();
    let owned = usize::try_from(hi - lo).unwrap_or(usize::MAX);
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut ids: Vec<u64> = (0..pool.min(owned))
        .map(|_| lo + rng.random_range(0..hi - lo))
        .collect();
    ids.sort_unstable();
    ids.dedup();
    for chunk in ids.chunks(32768) {
        store.prefetch(chunk)?;
    }
    // Keep the rows that stayed cached (a full set evicts a few).
    let (mut w1, mut s1) = (vec![0u8; g.w()], vec![0u8; g.s()]);
    let mut kept = Vec::with_capacity(ids.len());
    for &id in &ids {
        let misses = store.stats().misses;
        store.lookup(&[id], &mut w1, &mut s1)?;
        if store.stats().misses == misses {
            kept.push(id);
        }
    }
    anyhow::ensure!(
        kept.len() >= batch,
        "only {} of {} rows stayed cached (cache too small?)",
        kept.len(),
        ids.len()
    );
    const BATCHES: usize = 2000;
    let draws: Vec<u64> = (0..BATCHES * batch)
        .map(|_| kept[rng.random_range(0..kept.len())])
        .collect();
    let table_bytes = store.stats().cache_bytes;
    let slots = (usize::try_from(table_bytes).unwrap_or(0) / g.stride()).max(kept.len());
    let ram: Vec<u8> = (0..slots * g.stride()).map(|i| i as u8).collect();
    let at: Vec<usize> = (0..BATCHES * batch)
        .map(|_| rng.random_range(0..slots) * g.stride())
        .collect();
    let (mut w, mut s) = (vec![0u8; batch * g.w()], vec![0u8; batch * g.s()]);
    let before = store.stats().misses;
    let mut best = [f64::MAX; 2];
    for _ in 0..5 {
        let t = Instant::now();
        for ids in draws.chunks_exact(batch) {
            store.lookup(std::hint::black_box(ids), &mut w, &mut s)?;
        }
        best[0] = best[0].min(t.elapsed().as_secs_f64());
        let t = Instant::now();
        for offsets in at.chunks_exact(batch) {
            for (i, &a) in std::hint::black_box(offsets).iter().enumerate() {
                w[i * g.w()..(i + 1) * g.w()].copy_from_slice(&ram[a..a + g.w()]);
                s[i * g.s()..(i + 1) * g.s()].copy_from_slice(&ram[a + g.w()..a + g.stride()]);
            }
            std::hint::black_box(&mut w);
        }
        best[1] = best[1].min(t.elapsed().as_secs_f64());
    }
    anyhow::ensure!(
        store.stats().misses == before,
        "a DRAM hit-path row missed the cache"
    );
    let per_row = |secs: f64| secs * 1e9 / (BATCHES * batch) as f64;
    Ok(DramHitPath {
        batch,
        pool_rows: kept.len(),
        table_bytes,
        lookup_ns_per_row: per_row(best[0]),
        memcpy_gather_ns_per_row: per_row(best[1]),
        ratio_vs_gather: best[0] / best[1],
    })
}
