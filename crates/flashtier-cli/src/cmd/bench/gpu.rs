//! `flashtier bench gpu`: the CUDA path against the device's own limits,
//! measured in the same run.
//!
//! - Streaming: disk -> pinned staging -> HBM through the posix backend and
//!   [`HbmSink`](flashtier_cuda::HbmSink), against the drive alone (fio where
//!   it is installed, else the same O_DIRECT reads into host memory) and the
//!   host-to-device copy bandwidth. Fresh file regions for every pass.
//! - Attention: the decode engine's own attention (the KV append, split
//!   partials and merge a decode step runs; f32 keys and values) and its
//!   achieved HBM bytes/s (KV + q + out bytes over CUDA-event time) against
//!   the HBM read bandwidth and a device-to-device copy and, given
//!   `--torch-script`, PyTorch's SDPA on the same shapes.

mod attn;
mod stream;

use std::path::PathBuf;

use anyhow::Context;
use flashtier_cuda::Gpu;

/// Options of `flashtier bench gpu` (boxed: the options are many).
#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    opts: Box<Opts>,
}

/// The options themselves.
#[derive(clap::Args, Debug)]
pub struct Opts {
    /// Directory for the streaming test file (on the drive to measure).
    #[arg(long, default_value = ".")]
    pub dir: PathBuf,
    /// Bytes per file region, MiB (each pass reads a fresh region; at most
    /// 65536 MiB).
    #[arg(long, default_value_t = 1024)]
    pub region_mib: usize,
    /// Interleaved repetitions of (drive, pipeline, h2d); medians reported.
    #[arg(long, default_value_t = 3)]
    pub reps: usize,
    /// Read size, MiB (at most 65536 MiB).
    #[arg(long, default_value_t = 8)]
    pub chunk_mib: usize,
    /// Reads in flight (posix workers).
    #[arg(long, default_value_t = 8)]
    pub qd: usize,
    /// Skip the streaming part.
    #[arg(long)]
    pub no_stream: bool,
    /// Batch sizes for attention (sequences, each with its own KV cache).
    #[arg(long, value_delimiter = ',', default_value = "1,16")]
    pub batches: Vec<usize>,
    /// Context lengths for attention (positions attended, the new one
    /// included).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "4096,8192,16384,32768,65536,131072"
    )]
    pub contexts: Vec<usize>,
    /// Query heads.
    #[arg(long, default_value_t = 32)]
    pub q_heads: usize,
    /// KV heads.
    #[arg(long, default_value_t = 4)]
    pub kv_heads: usize,
    /// Head dimension (at most 256).
    #[arg(long, default_value_t = 128)]
    pub head_dim: usize,
    /// Decode steps per timed run.
    #[arg(long, default_value_t = 20)]
    pub iters: usize,
    /// Timed runs per shape (median reported).
    #[arg(long, default_value_t = 5)]
    pub runs: usize,
    /// tools/torch_sdpa_bench.py, to time PyTorch SDPA on the same shapes.
    #[arg(long)]
    pub torch_script: Option<PathBuf>,
    /// Python interpreter for the torch script.
    #[arg(long, default_value = "python3")]
    pub python: String,
    /// One JSON object on stdout instead of tables.
    #[arg(long)]
    pub json: bool,
    /// Also write the JSON object to this file (tables still printed).
    #[arg(long)]
    pub json_out: Option<PathBuf>,
}

/// Run `flashtier bench gpu`.
pub fn run(args: Args) -> anyhow::Result<()> {
    let args = *args.opts;
    let gpu = Gpu::open(0).context("flashtier bench gpu: open GPU 0")?;
    let info = gpu.info().clone();
    if !args.json {
        println!(
            "device: {} ({}, {} SMs, {:.1} GiB, driver {})",
            info.name,
            info.arch(),
            info.sm_count,
            info.total_mem_bytes as f64 / (1u64 << 30) as f64,
            info.driver_version
        );
    }
    let streaming = if args.no_stream {
        None
    } else {
        Some(stream::run(&gpu, &args)?)
    };
    let attention = attn::run(&gpu, &args)?;
    let v = serde_json::json!({
        "device": info,
        "streaming": streaming,
        "attention": attention,
    });
    if let Some(path) = &args.json_out {
        std::fs::write(path, v.to_string()).with_context(|| format!("write {}", path.display()))?;
    }
    if args.json {
        println!("{v}");
    } else {
        if let Some(s) = &streaming {
            stream::print(s);
        }
        attn::print(&attention);
    }
    Ok(())
}

pub(crate) fn gbps(bps: f64) -> String {
    format!("{:.2} GB/s", bps / 1e9)
}
