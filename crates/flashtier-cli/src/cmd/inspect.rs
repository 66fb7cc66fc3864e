//! `flashtier inspect`: a human summary of any flashtier file, or JSON. The
//! kind comes from the file's magic ([`flashtier::verify::sniff`]); opening
//! validates the header and tables of each kind (in the library), and this
//! module prints what they say.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use flashtier::experts::verify::{kind_name, open_store};
use flashtier::kv::verify::{KvImage, open_kv};
use flashtier::rows::verify::{ShardImage, open_shard};
use flashtier::verify::sniff;
use flashtier_format::kv::KV_VERSION;
use flashtier_format::manifest::hex_u64;
use flashtier_format::row_shard::{ROW_SHARD_BLOCK_BYTES, ROW_SHARD_VERSION};
use flashtier_format::{FORMAT_VERSION, FileKind, Store};
use flashtier_io::{DirectMode, PosixBackend};

/// Options of `flashtier inspect`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// The file: an expert store, a low-bit companion, a packed row shard
    /// or a KV store.
    pub file: PathBuf,
    /// Print JSON on stdout: `kind` (`experts`, `lowbit`, `row_shard`,
    /// `kv_store`) and the kind's header fields (for stores: format_version,
    /// records, record_stride_bytes, payload_bytes, checksum, the manifest).
    #[arg(long)]
    pub json: bool,
}

/// The JSON summary of an opened store.
pub fn store_json(store: &Store) -> serde_json::Value {
    let h = store.header();
    serde_json::json!({
        "file": store.path(),
        "kind": kind_name(store),
        "store_kind": h.kind.name(),
        "lowbit": store.manifest().extra.get("lowbit"),
        "format_version": FORMAT_VERSION,
        "records": h.record_count,
        "record_stride_bytes": h.record_stride_bytes,
        "payload_bytes": h.payload_bytes,
        "checksum": h.checksum_algo.name(),
        "file_len_bytes": h.file_len,
        "records_offset": h.records_offset,
        "checksum_table_offset": h.checksum_table_offset,
        "manifest_offset": h.manifest_offset,
        "manifest_len": h.manifest_len,
        "manifest": store.manifest(),
    })
}

fn mib(b: u64) -> f64 {
    b as f64 / f64::from(1 << 20)
}

/// The human summary of an opened store.
pub fn store_summary(store: &Store) -> String {
    let h = store.header();
    let m = store.manifest();
    let mut s = format!(
        "{}\n  kind {} · format v{FORMAT_VERSION} · checksum {}\n  {} records · stride {} B · payload {} B ({:.2} MiB) · file {:.1} MiB\n  dtype {}\n",
        store.path().display(),
        kind_name(store),
        h.checksum_algo.name(),
        h.record_count,
        h.record_stride_bytes,
        h.payload_bytes,
        mib(h.payload_bytes),
        mib(h.file_len),
        m.dtype,
    );
    if let Some(low) = m.extra.get("lowbit") {
        let field = |k: &str| low.get(k).map_or_else(|| "?".into(), ToString::to_string);
        s.push_str(&format!(
            "  low-bit companion: {} bits, group {}, of a {} B exact record\n",
            field("bits"),
            field("group"),
            field("source_payload_bytes")
        ));
    }
    s.push_str("  record layout:\n");
    for t in &m.record.tensors {
        s.push_str(&format!(
            "    @{:>10}  {:>10} B  {:<8} {}  {}\n",
            t.offset,
            t.len_bytes,
            t.dtype.name(),
            flashtier_format::text::shape(&t.shape),
            t.name
        ));
    }
    let mut per_layer: BTreeMap<u32, usize> = BTreeMap::new();
    for k in &m.keys {
        *per_layer.entry(k.layer).or_default() += 1;
    }
    if let (Some((first, n)), Some(last)) = (per_layer.iter().next(), per_layer.keys().last()) {
        s.push_str(&format!(
            "  keys ({}, {}): {} layers ({first}..={last}), {n} per layer in layer {first}\n",
            m.key_fields[0],
            m.key_fields[1],
            per_layer.len()
        ));
    }
    if let Some(model) = &m.model {
        s.push_str(&format!(
            "  model: {} ({}), layout {}, {} layers, {} experts (top-{}), hidden {}, expert intermediate {}\n",
            model.architecture,
            model.model_type,
            model.layout,
            model.num_layers,
            model.num_experts,
            model.experts_per_token.map_or_else(|| "?".into(), |k| k.to_string()),
            model.hidden_size,
            model.expert_intermediate_size
        ));
    }
    if let Some(src) = &m.source {
        s.push_str(&format!(
            "  source: {} ({} safetensors files, {} expert tensors under {}; non-expert tensors are read from there)\n",
            src.path,
            src.files.len(),
            src.expert_tensors,
            src.tensor_prefix
        ));
    }
    s
}

/// The JSON summary of a packed row shard.
pub fn shard_json(path: &Path, img: &ShardImage) -> serde_json::Value {
    let h = &img.header;
    serde_json::json!({
        "file": path,
        "kind": "row_shard",
        "version": ROW_SHARD_VERSION,
        "layer": h.layer,
        "lo": h.lo,
        "hi": h.hi,
        "rows": h.rows,
        "owned_rows": h.owned_rows(),
        "row_weight_bytes": h.row_weight_bytes,
        "scale_bytes": h.scale_bytes,
        "row_stride": h.row_stride(),
        "rows_per_block": h.rows_per_block,
        "block_bytes": ROW_SHARD_BLOCK_BYTES,
        "block_count": h.block_count(),
        "data_offset": h.data_offset(),
        "checksum_offset": h.checksum_offset(),
        "checksum": "xxh3-64",
        "checksums_xxh3": hex_u64(h.checksums_xxh3),
        "file_len_bytes": img.file_len_bytes,
    })
}

/// The human summary of a packed row shard.
pub fn shard_summary(path: &Path, img: &ShardImage) -> String {
    let h = &img.header;
    format!(
        "{}\n  kind row_shard · version {ROW_SHARD_VERSION} · checksum xxh3-64 per {ROW_SHARD_BLOCK_BYTES} B block\n  layer {} · rows [{}, {}) of {} · {} B weight + {} B scale = {} B per row · {} rows per block\n  {} blocks from byte {} · checksum table at {} · file {:.1} MiB\n",
        path.display(),
        h.layer,
        h.lo,
        h.hi,
        h.rows,
        h.row_weight_bytes,
        h.scale_bytes,
        h.row_stride(),
        h.rows_per_block,
        h.block_count(),
        h.data_offset(),
        h.checksum_offset(),
        mib(img.file_len_bytes),
    )
}

/// The JSON summary of a KV store.
pub fn kv_json(path: &Path, img: &KvImage) -> serde_json::Value {
    let l = &img.header.layout;
    let g = l.geometry();
    serde_json::json!({
        "file": path,
        "kind": "kv_store",
        "version": KV_VERSION,
        "block_order": l.order().to_string(),
        "num_layers": g.num_layers,
        "num_blocks": g.num_blocks,
        "num_kv_heads": g.num_kv_heads,
        "block_tokens": g.block_tokens,
        "head_dim": g.head_dim,
        "dtype_bytes": g.dtype_bytes,
        "group_bytes": l.group_bytes(),
        "group_stride": l.group_stride(),
        "block_bytes": l.block_bytes(),
        "table_offset": l.table_extent().offset,
        "table_len_bytes": l.table_extent().len_bytes,
        "data_offset": l.data_extent().offset,
        "data_len_bytes": l.data_extent().len_bytes,
        "model_hash": hex_u64(img.header.model_hash),
        "rank": img.header.rank,
        "blocks_total": l.blocks_total(),
        "resident_blocks": img.resident_blocks(),
        "checksum": "xxh3-64 seeded by block id and generation",
        "file_len_bytes": img.file_len_bytes,
    })
}

/// The human summary of a KV store.
pub fn kv_summary(path: &Path, img: &KvImage) -> String {
    let l = &img.header.layout;
    let g = l.geometry();
    format!(
        "{}\n  kind kv_store · version {KV_VERSION} · {} order · model {} rank {}\n  {} layers x {} blocks · {} kv heads x {} tokens x {} dims x {} B · block {} B ({} B per group)\n  {} of {} blocks resident · data from byte {} · file {:.1} MiB\n",
        path.display(),
        l.order(),
        hex_u64(img.header.model_hash),
        img.header.rank,
        g.num_layers,
        g.num_blocks,
        g.num_kv_heads,
        g.block_tokens,
        g.head_dim,
        g.dtype_bytes,
        l.block_bytes(),
        l.group_stride(),
        img.resident_blocks(),
        l.blocks_total(),
        l.data_extent().offset,
        mib(img.file_len_bytes),
    )
}

/// The JSON and human summaries of the file at `path`, by its kind.
fn describe(path: &Path) -> anyhow::Result<(serde_json::Value, String)> {
    let backend = PosixBackend::new(1)?;
    Ok(match sniff(path)? {
        FileKind::Store => {
            let (store, _) = open_store(path)?;
            (store_json(&store), store_summary(&store))
        }
        FileKind::RowShard => {
            let (_, img) = open_shard(path, &backend, DirectMode::Off)?;
            (shard_json(path, &img), shard_summary(path, &img))
        }
        FileKind::KvStore => {
            let (_, img) = open_kv(path, &backend, DirectMode::Off)?;
            (kv_json(path, &img), kv_summary(path, &img))
        }
        other => anyhow::bail!("{}: cannot inspect a {}", path.display(), other.name()),
    })
}

/// Run `flashtier inspect`.
pub fn run(args: Args) -> anyhow::Result<()> {
    let (json, human) = describe(&args.file)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&json)?);
    } else {
        print!("{human}");
    }
    Ok(())
}
