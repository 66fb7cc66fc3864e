//! `flashtier bench`: measurements against the device's own limit.

pub mod experts;
pub mod fio;
pub mod gpu;
pub mod io;
pub mod kv;
pub mod pack;
pub mod rows;

/// What to measure.
#[derive(clap::Subcommand, Debug)]
pub enum Bench {
    /// Raw backend reads (IOPS, bytes/s, latency) against fio.
    Io(io::Args),
    /// Row store lookups against fio's random-read IOPS.
    Rows(rows::Args),
    /// KV offload and cold restore with tiled attention, against fio.
    Kv(kv::Args),
    /// Disk to pinned to HBM streaming and the attention kernel, against copies.
    Gpu(gpu::Args),
    /// Packing throughput against the drive's sequential write bandwidth.
    Pack(pack::Args),
    /// Expert-pool miss streaming (slots backing) against fio.
    Experts(experts::Args),
}

/// Run `flashtier bench`.
pub fn run(b: Bench) -> anyhow::Result<()> {
    match b {
        Bench::Io(a) => io::run(a),
        Bench::Rows(a) => rows::run(a),
        Bench::Kv(a) => kv::run(a),
        Bench::Gpu(a) => gpu::run(a),
        Bench::Pack(a) => pack::run(a),
        Bench::Experts(a) => experts::run(a),
    }
}

/// The median of `values` (the mean of the middle two for an even count; 0
/// when empty). Every bench reports medians of interleaved repetitions.
pub fn median(values: &[f64]) -> f64 {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => 0.0,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}
