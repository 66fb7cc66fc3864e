//! `flashtier pack rows`: write one rank's packed row shard, or with
//! `--ple` every PLE row shard of a Qwen4-Exp checkpoint ([`super::ple`]).
//!
//! The table is a safetensors tensor and its scale tensor (`--model`,
//! `--tensor`, `--scales`), an unscaled BF16/F16/F32 tensor (`--model`,
//! `--tensor` without `--scales`: Qwen4-Exp's PLE n-gram shards
//! `ngram_embedding.shard_K.weight`, rows as stored, no scale bytes), or a
//! raw table file (`--table`, `--rows`,
//! `--weight-offset`, `--scale-offset`). Rank `R` of `N` owns rows
//! `[rows * R / N, rows * (R + 1) / N)`.

use std::path::PathBuf;

use anyhow::Context;
use flashtier::rows::pack::pack_shard_with;
use flashtier::rows::{RowGeometry, TableSource, owned_range};
use flashtier_io::persist::Wait;

/// Options of `flashtier pack rows`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Checkpoint directory (or one .safetensors file) holding the table.
    #[arg(long, conflicts_with = "table")]
    pub model: Option<PathBuf>,
    /// Qwen4-Exp: pack every PLE layer's n-gram table shards of --model,
    /// one row shard each, under the names `flashtier run --rows-budget`
    /// opens (`layer{L}.shard{K}-{tag}.ftrows`), so the run packs nothing.
    /// Into --out-dir, else the folder that run uses with the same --store
    /// or --cache (the store's path plus `.ple-rows`).
    #[arg(
        long,
        requires = "model",
        conflicts_with_all = ["tensor", "scales", "table", "out", "rank", "ranks", "layer"]
    )]
    pub ple: bool,
    /// With --ple: the folder of the row shards (run's --rows-dir).
    #[arg(long, value_name = "DIR", requires = "ple", conflicts_with_all = ["store", "cache"])]
    pub out_dir: Option<PathBuf>,
    /// With --ple: the expert store run will use (the shards go beside it,
    /// into FILE.ple-rows).
    #[arg(long, value_name = "FILE", requires = "ple")]
    pub store: Option<PathBuf>,
    /// With --ple: the store cache run will use [default: as run's].
    #[arg(long, value_name = "DIR", requires = "ple", conflicts_with = "store")]
    pub cache: Option<PathBuf>,
    /// Name of the table tensor: FP8 E4M3 `[rows, 256]` with --scales, or
    /// an unscaled BF16, F16 or F32 `[rows, n]` without (Qwen4-Exp's
    /// `...ngram_embedding.shard_K.weight`).
    #[arg(long, requires = "model")]
    pub tensor: Option<String>,
    /// Name of its scale tensor (F32 [rows, 2], F64 [rows] or U8 [rows, 8]);
    /// leave out for an unscaled table.
    #[arg(long, requires = "model")]
    pub scales: Option<String>,
    /// A raw table file instead of a checkpoint.
    #[arg(long)]
    pub table: Option<PathBuf>,
    /// Rows of the raw table.
    #[arg(long, requires = "table")]
    pub rows: Option<u64>,
    /// Byte offset of the raw table's weights.
    #[arg(long, default_value_t = 0)]
    pub weight_offset: u64,
    /// Byte offset of the raw table's scales (default: right after the weights).
    #[arg(long)]
    pub scale_offset: Option<u64>,
    /// Weight bytes per row of the raw table.
    #[arg(long, default_value_t = 256)]
    pub weight_bytes: u32,
    /// Scale bytes per row of the raw table.
    #[arg(long, default_value_t = 8)]
    pub scale_bytes: u32,
    /// This rank.
    #[arg(long, default_value_t = 0)]
    pub rank: u64,
    /// Ranks sharing the table.
    #[arg(long, default_value_t = 1)]
    pub ranks: u64,
    /// Layer id recorded in the header (checked when the shard is attached).
    #[arg(long, default_value_t = 0)]
    pub layer: u64,
    /// Output shard file. An existing OUT is replaced only if it is a row
    /// shard; OUT may not be the table's file. Written to a temp file beside
    /// OUT and renamed over it when complete (so is each --ple shard).
    #[arg(long, required_unless_present = "ple")]
    pub out: Option<PathBuf>,
    /// Fail at once if another flashtier process is writing OUT (a --ple
    /// shard) instead of waiting for it.
    #[arg(long)]
    pub no_wait: bool,
    /// Print the result as JSON.
    #[arg(long)]
    pub json: bool,
}

fn source(a: &Args) -> anyhow::Result<TableSource> {
    if let Some(model) = &a.model {
        let tensor = a
            .tensor
            .as_deref()
            .context("--tensor is required with --model")?;
        return Ok(match a.scales.as_deref() {
            Some(scales) => TableSource::safetensors(model, tensor, scales)?,
            None => TableSource::safetensors_unscaled(model, tensor)?,
        });
    }
    let table = a
        .table
        .as_ref()
        .context("give --model DIR --tensor NAME --scales NAME, or --table FILE --rows N")?;
    let rows = a.rows.context("--rows is required with --table")?;
    let g = RowGeometry {
        weight_bytes: a.weight_bytes,
        scale_bytes: a.scale_bytes,
    };
    let scale_offset = a
        .scale_offset
        .unwrap_or(a.weight_offset + rows * u64::from(a.weight_bytes));
    Ok(TableSource::raw(
        table,
        rows,
        a.weight_offset,
        scale_offset,
        g,
    )?)
}

/// Run `flashtier pack rows`.
pub fn run(a: Args) -> anyhow::Result<()> {
    if a.ple {
        return super::ple::run(&super::ple::PleArgs {
            model: a.model.as_deref().context("--ple needs --model")?,
            store: a.store.as_deref(),
            cache: a.cache.as_deref(),
            out_dir: a.out_dir.as_deref(),
            no_wait: a.no_wait,
            json: a.json,
        });
    }
    let out = a.out.as_ref().context("--out is required without --ple")?;
    let src = source(&a)?;
    let (lo, hi) = owned_range(src.rows, a.rank, a.ranks)?;
    let bar = indicatif::ProgressBar::new(hi - lo);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{msg} [{bar:40}] {pos}/{len} rows ({per_sec}, eta {eta})",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    bar.set_message(format!("packing rows [{lo}, {hi})"));
    let t0 = std::time::Instant::now();
    let wait = if a.no_wait { Wait::Fail } else { Wait::Block };
    let header = pack_shard_with(&src, a.layer, lo, hi, out, wait, &mut |done| {
        bar.set_position(done)
    })
    .with_context(|| format!("packing {}", out.display()))?;
    bar.finish_and_clear();
    let secs = t0.elapsed().as_secs_f64();
    if a.json {
        let v = serde_json::json!({
            "out": out, "layer": header.layer, "lo": lo, "hi": hi, "rows": header.rows,
            "row_weight_bytes": header.row_weight_bytes, "scale_bytes": header.scale_bytes,
            "blocks": header.block_count(), "file_bytes": header.file_bytes(), "seconds": secs,
        });
        println!("{v}");
    } else {
        println!(
            "packed rows [{lo}, {hi}) of {} (layer {}, rank {}/{}) into {}: {} blocks, {} bytes, {secs:.2} s",
            header.rows,
            header.layer,
            a.rank,
            a.ranks,
            out.display(),
            header.block_count(),
            header.file_bytes()
        );
    }
    Ok(())
}
