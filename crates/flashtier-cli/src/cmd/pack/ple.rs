//! `flashtier pack rows --ple`: every PLE table shard of a Qwen4-Exp
//! checkpoint packed into the row shard files `flashtier run
//! --rows-budget` opens ([`flashtier_engine::family::qwen4::pack_ple_rows`]:
//! the engine's own names and writer, so a later run packs nothing), with
//! a progress bar over the table bytes and a text or `--json` summary.

use std::path::Path;

use anyhow::Context;
use flashtier_engine::family::qwen4::pack_ple_rows;
use flashtier_io::persist::Wait;

use crate::kit;
use flashtier_pack::session::{RowStore, SessionOptions, StoreSource};

/// What `pack rows --ple` takes of `pack rows`' flags.
pub struct PleArgs<'a> {
    /// The Qwen4-Exp checkpoint.
    pub model: &'a Path,
    /// `--store`: the expert store the shards go beside.
    pub store: Option<&'a Path>,
    /// `--cache`: the store cache whose store they go beside.
    pub cache: Option<&'a Path>,
    /// `--out-dir`: the folder, instead of beside the store.
    pub out_dir: Option<&'a Path>,
    /// `--no-wait`: fail instead of waiting for another writer's lock.
    pub no_wait: bool,
    /// `--json`: one JSON summary instead of text and a progress bar.
    pub json: bool,
}

/// Run `flashtier pack rows --ple`.
pub fn run(a: &PleArgs<'_>) -> anyhow::Result<()> {
    let model = a.model;
    // The folder a session with this store and a row store reads.
    let mut session = SessionOptions::new(model);
    session.store = match a.store {
        Some(p) => StoreSource::File(p.to_path_buf()),
        None => StoreSource::Cache(a.cache.map(Path::to_path_buf)),
    };
    session.rows = Some(RowStore {
        budget_bytes: 0,
        dir: a.out_dir.map(Path::to_path_buf),
    });
    let dir = session
        .rows_dir()?
        .context("a session with a row store has a row folder")?;
    let bar = kit::bytes_bar(0, "packing PLE rows", !a.json);
    let wait = if a.no_wait { Wait::Fail } else { Wait::Block };
    let t0 = std::time::Instant::now();
    let packed = pack_ple_rows(model, &dir, wait, &mut |done, total| {
        bar.set_length(total);
        bar.set_position(done);
    })
    .with_context(|| {
        format!(
            "packing the PLE rows of {} into {}",
            model.display(),
            dir.display()
        )
    })?;
    bar.finish_and_clear();
    let secs = t0.elapsed().as_secs_f64();
    let file_bytes: u64 = packed.iter().map(|(_, h)| h.file_bytes()).sum();
    let table_bytes: u64 = packed.iter().map(|(s, _)| s.table_bytes).sum();
    let layers = packed
        .iter()
        .map(|(s, _)| s.layer)
        .collect::<std::collections::BTreeSet<_>>()
        .len();
    if a.json {
        let shards: Vec<_> = packed
            .iter()
            .map(|(s, h)| {
                serde_json::json!({
                    "layer": s.layer, "shard": s.shard, "tensor": s.tensor, "path": s.path,
                    "rows": h.rows, "row_weight_bytes": h.row_weight_bytes,
                    "blocks": h.block_count(), "file_bytes": h.file_bytes(),
                })
            })
            .collect();
        let v = serde_json::json!({
            "out_dir": dir, "layers": layers, "shards": shards, "table_bytes": table_bytes,
            "file_bytes": file_bytes, "seconds": secs,
        });
        println!("{v}");
    } else {
        for (s, h) in &packed {
            println!(
                "layer {} shard {}: {} rows of {} bytes into {}",
                s.layer,
                s.shard,
                h.rows,
                h.row_weight_bytes,
                s.path.display()
            );
        }
        println!(
            "packed {} PLE row shards of {layers} layers into {}: {file_bytes} bytes, {secs:.2} s",
            packed.len(),
            dir.display()
        );
    }
    Ok(())
}
