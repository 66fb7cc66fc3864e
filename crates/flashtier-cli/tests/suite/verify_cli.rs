//! `inspect` and `verify` for every file kind through the built binary: an
//! expert store, a low-bit companion, a packed row shard and a KV store are
//! recognised by their magic, described with `--json`, verified, and a
//! flipped byte in each is named (index, offset, length). A FIFO is refused
//! at once instead of blocking.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use flashtier::kv::swap::{KvSwap, SwapOptions};
use flashtier::rows::RowGeometry;
use flashtier::rows::pack::write_synthetic_table;
use flashtier_format::kv::{BlockId, BlockOrder, GroupLayout, KvGeometry};
use flashtier_format::row_shard::ROW_SHARD_HEADER_BYTES;
use flashtier_format::{Dtype, Store};
use flashtier_io::{AlignedBuf, PosixBackend};
use flashtier_pack::synth::{SynthArch, SynthSpec, write_checkpoint};

fn flashtier(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_flashtier"))
        .args(args)
        .output()
        .expect("run flashtier")
}

fn json(out: &Output) -> serde_json::Value {
    assert!(
        out.status.success(),
        "failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("JSON on stdout")
}

fn s(p: &Path) -> &str {
    p.to_str().expect("utf-8 path")
}

fn flip(path: &Path, at: u64) {
    let mut bytes = std::fs::read(path).expect("read");
    bytes[at as usize] ^= 0x40;
    std::fs::write(path, &bytes).expect("write");
}

/// `inspect --json` and `verify --json` accept the file as `kind`; after a
/// byte at `at` flips, `verify` fails naming `index`, the offset and length
/// of the unit holding it.
fn check_kind(path: &Path, kind: &str, at: u64, index: u64, unit: (u64, u64)) {
    let info = json(&flashtier(&["inspect", "--json", s(path)]));
    assert_eq!(info["kind"], kind, "{info}");
    let human = flashtier(&["inspect", s(path)]);
    assert!(human.status.success());
    assert!(String::from_utf8_lossy(&human.stdout).contains(&format!("kind {kind}")));
    let ok = json(&flashtier(&["verify", "--json", s(path)]));
    assert_eq!(
        (ok["kind"].as_str(), ok["ok"].as_bool()),
        (Some(kind), Some(true)),
        "{ok}"
    );
    assert!(ok["units"].as_u64().is_some_and(|n| n > 0), "{ok}");
    flip(path, at);
    let bad = flashtier(&["verify", "--json", s(path)]);
    assert!(!bad.status.success(), "a flipped byte verified");
    let report: serde_json::Value = serde_json::from_slice(&bad.stdout).expect("JSON");
    assert_eq!(report["ok"], false);
    assert_eq!(report["bad_units"], 1);
    let first = &report["first_bad"];
    assert_eq!(first["index"], index, "{report}");
    assert_eq!(
        (first["offset"].as_u64(), first["len_bytes"].as_u64()),
        (Some(unit.0), Some(unit.1))
    );
    let msg = String::from_utf8_lossy(&bad.stderr);
    let want = format!(" {index} (");
    assert!(
        msg.contains(&want) && msg.contains(&format!("at offset {} length {}", unit.0, unit.1)),
        "{msg}"
    );
}

fn packed_store(dir: &Path, lowbit: bool) -> PathBuf {
    let model = dir.join("model");
    write_checkpoint(
        &SynthSpec::tiny(SynthArch::Qwen3Moe, Dtype::Bf16, 4),
        &model,
        &mut |_| {},
    )
    .expect("synth");
    let store = dir.join("experts.ftstore");
    let mut args = vec![
        "pack",
        "experts",
        "--model",
        s(&model),
        "--out",
        s(&store),
        "--json",
    ];
    if lowbit {
        args.extend(["--lowbit", "3"]);
    }
    json(&flashtier(&args));
    store
}

#[test]
fn an_expert_store_is_inspected_verified_and_its_damage_named() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let store = packed_store(tmp.path(), false);
    let st = Store::open(&store).expect("open");
    let off = st.record_offset(3).expect("offset");
    check_kind(&store, "experts", off + 100, 3, (off, st.stride_bytes()));
}

#[test]
fn a_lowbit_companion_is_inspected_verified_and_its_damage_named() {
    let tmp = tempfile::tempdir().expect("tempdir");
    packed_store(tmp.path(), true);
    let q3 = tmp.path().join("experts.q3.ftstore");
    let st = Store::open(&q3).expect("open companion");
    let info = json(&flashtier(&["inspect", "--json", s(&q3)]));
    assert_eq!(info["lowbit"]["bits"], 3, "{info}");
    let off = st.record_offset(5).expect("offset");
    check_kind(&q3, "lowbit", off + 7, 5, (off, st.stride_bytes()));
}

#[test]
fn a_row_shard_is_inspected_verified_and_its_damage_named() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let table = tmp.path().join("table.bin");
    write_synthetic_table(&table, 200, RowGeometry::ENGRAM, 5).expect("table");
    let shard = tmp.path().join("rows.ftrows");
    json(&flashtier(&[
        "pack",
        "rows",
        "--table",
        s(&table),
        "--rows",
        "200",
        "--out",
        s(&shard),
        "--json",
    ]));
    let info = json(&flashtier(&["inspect", "--json", s(&shard)]));
    assert_eq!(
        (info["rows"].as_u64(), info["rows_per_block"].as_u64()),
        (Some(200), Some(15))
    );
    // Block 4 holds rows 60..75; flip a byte of row 61's scale.
    let block = u64::from(ROW_SHARD_HEADER_BYTES) + 4 * 4096;
    check_kind(&shard, "row_shard", block + 264 + 260, 4, (block, 4096));
    let msg = String::from_utf8_lossy(&flashtier(&["verify", s(&shard)]).stderr).into_owned();
    assert!(msg.contains("block 4 (rows 60..75)"), "{msg}");
}

#[test]
fn a_kv_store_is_inspected_verified_and_its_damage_named() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let path = tmp.path().join("kv.store");
    let geometry = KvGeometry {
        num_layers: 2,
        num_blocks: 3,
        num_kv_heads: 1,
        block_tokens: 16,
        head_dim: 64,
        dtype_bytes: 2,
    };
    let layout = GroupLayout::new(geometry, BlockOrder::PerLayer).expect("layout");
    let backend = Arc::new(PosixBackend::new(2).expect("backend"));
    let mut swap = KvSwap::create(backend, &path, layout, SwapOptions::default()).expect("create");
    let mut block = AlignedBuf::zeroed(layout.block_bytes() as usize);
    for (i, id) in [BlockId::new(0, 1), BlockId::new(1, 0), BlockId::new(1, 2)]
        .into_iter()
        .enumerate()
    {
        block.fill(i as u8 + 1);
        swap.offload_block(id, &block).expect("offload");
    }
    swap.persist().expect("persist");
    drop(swap);
    let info = json(&flashtier(&["inspect", "--json", s(&path)]));
    assert_eq!(
        (
            info["resident_blocks"].as_u64(),
            info["blocks_total"].as_u64()
        ),
        (Some(3), Some(6))
    );
    assert_eq!(info["block_order"], "per-layer");
    // Layer 1 block 0 is block 3 in file order (per-layer).
    let ext = layout.block_extent(BlockId::new(1, 0)).expect("extent");
    check_kind(
        &path,
        "kv_store",
        ext.offset + 5000,
        3,
        (ext.offset, ext.len_bytes),
    );
    let msg = String::from_utf8_lossy(&flashtier(&["verify", s(&path)]).stderr).into_owned();
    assert!(msg.contains("layer 1 block 0 generation"), "{msg}");
}

#[test]
fn a_file_of_no_kind_is_named() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let path = tmp.path().join("junk.bin");
    std::fs::write(&path, b"GGUF\x03\x00\x00\x00rest").expect("write");
    for cmd in ["inspect", "verify"] {
        let out = flashtier(&[cmd, s(&path)]);
        assert!(!out.status.success());
        let msg = String::from_utf8_lossy(&out.stderr);
        assert!(
            msg.contains("junk.bin") && msg.contains("47 47 55 46 03 00 00 00"),
            "{cmd}: {msg}"
        );
    }
}

/// Run `flashtier ARGS` and kill it if it has not finished within `limit`:
/// `None` then, so a blocking open fails the test instead of hanging it.
fn run_with_limit(args: &[&str], limit: Duration) -> Option<Output> {
    let mut child = Command::new(env!("CARGO_BIN_EXE_flashtier"))
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn");
    let t0 = Instant::now();
    while t0.elapsed() < limit {
        if child.try_wait().expect("wait").is_some() {
            return Some(child.wait_with_output().expect("output"));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.kill().expect("kill");
    let _ = child.wait();
    None
}

#[test]
fn a_fifo_is_refused_at_once() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let fifo = tmp.path().join("pipe.ftstore");
    rustix::fs::mkfifoat(
        rustix::fs::CWD,
        &fifo,
        rustix::fs::Mode::from_raw_mode(0o600),
    )
    .expect("mkfifo");
    for cmd in ["inspect", "verify"] {
        let out = run_with_limit(&[cmd, s(&fifo)], Duration::from_secs(10))
            .unwrap_or_else(|| panic!("{cmd} blocked on a FIFO"));
        assert!(!out.status.success());
        let msg = String::from_utf8_lossy(&out.stderr);
        assert!(
            msg.contains("pipe.ftstore") && msg.contains("FIFO"),
            "{cmd}: {msg}"
        );
    }
    // The expert pool's opening refuses it too (on a thread, so that a
    // blocking open fails the test instead of hanging it).
    let (tx, rx) = std::sync::mpsc::channel();
    let path = fifo.clone();
    std::thread::spawn(move || {
        let opened = flashtier::experts::StoreSet::open(&path, false).map(|_| ());
        let _ = tx.send(opened.map_err(|e| e.to_string()));
    });
    let opened = rx
        .recv_timeout(Duration::from_secs(10))
        .expect("StoreSet::open blocked on a FIFO");
    let err = opened.expect_err("a FIFO store");
    assert!(err.contains("FIFO"), "{err}");
    // A character device is no store either.
    let out = flashtier(&["inspect", "/dev/null"]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("character device"));
}

/// `verify --model` refuses a store whose manifest was edited after packing
/// (a tensor's dtype, shape or name), even with every checksum recomputed so
/// that the record scan alone passes.
#[test]
fn verify_with_the_model_catches_an_edited_manifest() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let store = packed_store(tmp.path(), false);
    let model = tmp.path().join("model");
    let ok = flashtier(&["verify", s(&store), "--model", s(&model)]);
    assert!(
        ok.status.success(),
        "{}",
        String::from_utf8_lossy(&ok.stderr)
    );
    let st = Store::open(&store).expect("open");
    let file =
        flashtier_io::StoreFile::open_read(&store, flashtier_io::DirectMode::Off).expect("file");
    let records: Vec<Vec<u8>> = (0..st.record_count())
        .map(|i| {
            let mut r = vec![0u8; st.payload_bytes() as usize];
            st.read_record(file.as_ref(), i, &mut r).expect("record");
            r
        })
        .collect();
    type Edit = fn(&mut flashtier_format::Manifest);
    let edits: [(&str, Edit, &str); 3] = [
        (
            "dtype",
            |m| m.record.tensors[0].dtype = Dtype::F16,
            "the manifest says F16",
        ),
        (
            "shape",
            |m| m.record.tensors[1].shape.reverse(),
            "up_proj.weight",
        ),
        (
            "name",
            |m| m.record.tensors[2].name = "down.weight".into(),
            "down.weight",
        ),
    ];
    for (what, edit, want) in edits {
        let mut m = st.manifest().clone();
        edit(&mut m);
        let image = flashtier_format::StoreWriterPlan::new(m)
            .expect("plan")
            .image(&records)
            .expect("image");
        let edited = tmp.path().join(format!("{what}.ftstore"));
        std::fs::write(&edited, image).expect("write");
        let scan = flashtier(&["verify", s(&edited)]);
        assert!(
            scan.status.success(),
            "{what}: the edited store must still verify alone"
        );
        let out = flashtier(&["verify", s(&edited), "--model", s(&model)]);
        assert!(
            !out.status.success(),
            "{what}: verify --model accepted the edit"
        );
        let msg = String::from_utf8_lossy(&out.stderr);
        assert!(
            msg.contains("record 0 (layer=0 expert=0)") && msg.contains(want),
            "{what}: {msg}"
        );
    }
}

/// Qwen4-Exp's BF16 PLE n-gram shard, packed straight from the checkpoint
/// without scales: 16-byte rows (8 values), no scale bytes, each block
/// checksummed like any row shard's.
#[test]
fn a_qwen4_ple_shard_packs_unscaled_from_the_checkpoint() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let model = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../flashtier-engine/tests/fixtures/engine/qwen4_exp");
    let shard = tmp.path().join("ple0.ftrows");
    let packed = json(&flashtier(&[
        "pack",
        "rows",
        "--model",
        s(&model),
        "--tensor",
        "model.layers.0.ple.ple_embedding.ngram_embedding.shard_1.weight",
        "--out",
        s(&shard),
        "--json",
    ]));
    assert_eq!(
        (
            packed["rows"].as_u64(),
            packed["row_weight_bytes"].as_u64(),
            packed["scale_bytes"].as_u64()
        ),
        (Some(144), Some(16), Some(0)),
        "{packed}"
    );
    let block = u64::from(ROW_SHARD_HEADER_BYTES);
    check_kind(&shard, "row_shard", block + 16 * 100 + 3, 0, (block, 4096));
    let fp8 = flashtier(&[
        "pack",
        "rows",
        "--model",
        s(&model),
        "--tensor",
        "model.layers.0.ple.ple_embedding.ngram_heads_offsets",
        "--out",
        s(&tmp.path().join("bad.ftrows")),
    ]);
    assert!(!fp8.status.success());
    let msg = String::from_utf8_lossy(&fp8.stderr);
    assert!(msg.contains("ngram_heads_offsets is I64"), "{msg}");
}
