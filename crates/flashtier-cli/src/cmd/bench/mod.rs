//! `flashtier bench`: measurements against the device's own limit, each in
//! the layout of [`crate::kit::bench`].

pub mod attn;
pub mod cpu;
pub mod decode;
pub mod experts;
pub mod gemm;
pub mod gpu;
pub mod io;
pub mod kv;
pub mod pack;
pub mod rows;
pub mod serve;

/// What to measure.
#[derive(clap::Subcommand, Debug)]
pub enum Bench {
    /// The CPU engine's matrix kernels against the machine's memory bandwidth.
    Cpu(cpu::Args),
    /// The CPU engine's prompt-chunk attention alone.
    Attn(attn::Args),
    /// The decode engine on the GPU against HBM, PCIe and drive limits and
    /// against transformers.
    Decode(decode::Args),
    /// Raw backend reads (IOPS, bytes/s, latency) against fio.
    Io(io::Args),
    /// Row store lookups against fio's random-read IOPS.
    Rows(rows::Args),
    /// KV offload and cold restore with tiled attention, against fio.
    Kv(kv::Args),
    /// Disk to pinned to HBM streaming and the attention kernel, against copies.
    Gpu(gpu::Args),
    /// The GPU prompt products (NVRTC tiles) against cuBLAS f32 and BF16.
    Gemm(gemm::Args),
    /// Packing throughput against the drive's sequential write bandwidth.
    Pack(pack::Args),
    /// Expert-pool miss streaming (slots backing) against fio.
    Experts(experts::Args),
    /// The server's scheduler: concurrent streams against the bytes bound
    /// and `run`'s decode, and prompt reuse.
    Serve(serve::Args),
}

/// Run `flashtier bench`.
pub fn run(b: Bench) -> anyhow::Result<()> {
    match b {
        Bench::Cpu(a) => cpu::run(a),
        Bench::Attn(a) => attn::run(a),
        Bench::Decode(a) => decode::run(a),
        Bench::Io(a) => io::run(a),
        Bench::Rows(a) => rows::run(a),
        Bench::Kv(a) => kv::run(a),
        Bench::Gpu(a) => gpu::run(a),
        Bench::Gemm(a) => gemm::run(a),
        Bench::Pack(a) => pack::run(a),
        Bench::Experts(a) => experts::run(a),
        Bench::Serve(a) => serve::run(a),
    }
}
