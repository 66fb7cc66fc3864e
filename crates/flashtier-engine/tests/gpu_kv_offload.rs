//! KV beyond HBM on the GPU: with a KV budget far below the context, the
//! older KV chunks are offloaded to a KV store and restored tile by tile
//! for every attention, and every logit of every step (prompt chunks that
//! cross chunk boundaries, then one-token decode steps that do too) is the
//! same bits as with every position in HBM, at several budgets, tile
//! sizes and read-aheads, with CUDA graphs on and off. Runs on the engine
//! fixtures with their context raised to 2048 positions. Skips with a
//! printed reason where there is no GPU (CI).
#![allow(
    clippy::unwrap_used,
    reason = "test helpers: a broken fixture must fail the test loudly"
)]

mod common;

use flashtier_cuda::ops::attn::{CHUNK_POSITIONS, group_floats};
use flashtier_engine::device::cuda::CudaDevice;
use flashtier_engine::device::cuda::kv::KvBudget;
use flashtier_engine::load::{GpuOptions, LoadOptions, load_cuda};
use flashtier_engine::{EngineError, Model};

use common::{fixture, gpu_or_skip, pack};

/// Prompt tokens: the first step is FIRST tokens, then chunks of 256, so
/// prompt steps cross KV chunk boundaries.
const PROMPT: usize = 1000;
const FIRST: usize = 100;
/// Decode steps: from position 1000 past the chunk boundary at 1024.
const STEPS: usize = 40;

fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, v) in logits.iter().enumerate() {
        if *v > logits[best] {
            best = i;
        }
    }
    best as u32
}

/// Every logit of the prompt's steps, then of each greedy decode step.
fn run(m: &mut Model<CudaDevice>, prompt: &[u32]) -> Vec<Vec<f32>> {
    let mut all = vec![m.forward(&prompt[..FIRST], true).unwrap()];
    for chunk in prompt[FIRST..].chunks(256) {
        all.push(m.forward(chunk, true).unwrap());
    }
    let vocab = m.config().vocab_size;
    for _ in 0..STEPS {
        let last = all.last().unwrap();
        let next = argmax(&last[last.len() - vocab..]);
        all.push(m.forward(&[next], false).unwrap());
    }
    all
}

fn same_bits(a: &[Vec<f32>], b: &[Vec<f32>]) -> Option<usize> {
    if a.len() != b.len() {
        return Some(a.len().min(b.len()));
    }
    a.iter().zip(b).position(|(x, y)| {
        x.len() != y.len() || x.iter().zip(y).any(|(p, q)| p.to_bits() != q.to_bits())
    })
}

fn opts(kv: Option<KvBudget>) -> GpuOptions {
    GpuOptions {
        kv,
        ..GpuOptions::default()
    }
}

fn check(name: &str) {
    if !gpu_or_skip(&format!("gpu_kv_offload {name}")) {
        return;
    }
    let model = common::rewrite::rewritten(&fixture(name), |_, cfg| {
        cfg["max_position_embeddings"] = 2048.into();
    });
    let dir = model.path();
    let tmp = tempfile::tempdir().unwrap();
    let report = pack(dir, tmp.path());
    let store = LoadOptions::store(&report.out);
    let mut resident = load_cuda(dir, &store, &opts(None)).unwrap();
    let cfg = resident.config().clone();
    let prompt: Vec<u32> = (0..PROMPT as u32)
        .map(|i| (i * 7919 + 11) % cfg.vocab_size as u32)
        .collect();
    let want = run(&mut resident, &prompt);
    assert!(
        resident.kv_stats().is_none(),
        "{name}: no tier without a budget"
    );
    drop(resident);
    // The cache's chunk: K and V of every kv head over 256 positions.
    let spec = flashtier_engine::model::kv_spec(&cfg);
    let chunk = 8 * spec.kv_heads as u64 * group_floats(spec.head_dim) as u64;
    let layers = spec.layers as u64;
    let kv_dir = tempfile::tempdir().unwrap();
    let budget = |slots: u64, tile: usize, ring: usize, ahead: usize| {
        let mut b = KvBudget::new(
            (ring * tile) as u64 * chunk + slots * layers * chunk,
            kv_dir.path().to_path_buf(),
        );
        (b.tile_chunks, b.ring_slots, b.read_ahead) = (tile, ring, ahead);
        b
    };
    for (b, graphs) in [
        (budget(2, 2, 2, 4), true),
        (budget(2, 2, 2, 4), false),
        (budget(2, 1, 2, 1), true),
        (budget(3, 3, 3, 2), true),
        (budget(2, 1, 1, 1), false),
    ] {
        let what = format!(
            "{name}: budget {} B (tile {}, ring {}, read-ahead {}), graphs {graphs}",
            b.hbm_bytes, b.tile_chunks, b.ring_slots, b.read_ahead
        );
        let hbm = b.hbm_bytes;
        let mut m = load_cuda(dir, &store, &opts(Some(b))).unwrap();
        m.device().set_graphs(graphs);
        let got = run(&mut m, &prompt);
        if let Some(i) = same_bits(&got, &want) {
            panic!("{what}: step {i}: logits differ from the all-resident run");
        }
        let st = m.kv_stats().expect("a tier under a small budget");
        println!("{what}: {st:?}");
        let cold = (PROMPT + STEPS - 1).div_ceil(CHUNK_POSITIONS) as u64 - 2;
        assert!(st.offloaded_blocks >= layers, "{what}: nothing offloaded");
        assert!(
            st.offloaded_blocks <= layers * cold,
            "{what}: offloaded twice"
        );
        assert!(st.restored_bytes > 0, "{what}: nothing restored");
        assert!(
            (m.device().kernels().gpu().info().total_mem_bytes as u64) > hbm,
            "{what}: a budget the GPU holds"
        );
    }
    // Too small a budget is refused before anything runs.
    let tiny = budget(1, 2, 2, 4);
    match load_cuda(dir, &store, &opts(Some(tiny))) {
        Err(EngineError::KvBudgetTooSmall { needed, .. }) => {
            assert_eq!(needed, 4 * chunk + 2 * layers * chunk, "{name}");
        }
        Err(e) => panic!("{name}: expected KvBudgetTooSmall, got {e}"),
        Ok(_) => panic!("{name}: a one-chunk window was accepted"),
    }
}

#[test]
fn qwen3_moe_kv_beyond_hbm_is_exact() {
    check("qwen3_moe");
}

#[test]
fn mixtral_kv_beyond_hbm_is_exact() {
    check("mixtral");
}

#[test]
fn qwen2_moe_kv_beyond_hbm_is_exact() {
    check("qwen2_moe");
}

#[test]
fn deepseek_v3_kv_beyond_hbm_is_exact() {
    check("deepseek_v3");
}

/// The library's `generate` with a budget: the same tokens and prompt
/// logits, and per-token KV counters split into prompt and decode.
#[test]
fn generate_reports_kv_restored_and_stall() {
    if !gpu_or_skip("gpu_kv_offload generate_reports_kv_restored_and_stall") {
        return;
    }
    let model = common::rewrite::rewritten(&fixture("qwen3_moe"), |_, cfg| {
        cfg["max_position_embeddings"] = 2048.into();
    });
    let dir = model.path();
    let tmp = tempfile::tempdir().unwrap();
    let store = LoadOptions::store(&pack(dir, tmp.path()).out);
    let prompt: Vec<u32> = (0..700u32).map(|i| (i * 31 + 5) % 300).collect();
    let mut a = load_cuda(dir, &store, &opts(None)).unwrap();
    let want = a.generate(&prompt, 16, &[], true, |_| {}).unwrap();
    let kv_dir = tempfile::tempdir().unwrap();
    let mut b = load_cuda(
        dir,
        &store,
        &opts(Some(KvBudget::new(1, kv_dir.path().to_path_buf()))),
    );
    assert!(matches!(b, Err(EngineError::KvBudgetTooSmall { .. })));
    let spec = flashtier_engine::model::kv_spec(a.config());
    let chunk = 8 * spec.kv_heads as u64 * group_floats(spec.head_dim) as u64;
    let least = 4 * chunk + 2 * spec.layers as u64 * chunk;
    b = load_cuda(
        dir,
        &store,
        &opts(Some(KvBudget::new(least, kv_dir.path().to_path_buf()))),
    );
    let mut b = b.unwrap();
    let got = b.generate(&prompt, 16, &[], true, |_| {}).unwrap();
    assert_eq!(got.generated_ids, want.generated_ids);
    assert!(same_bits(&got.prompt_logits, &want.prompt_logits).is_none());
    let (pre, dec) = (got.prefill_kv.unwrap(), got.decode_kv.unwrap());
    println!("prompt {pre:?}\ndecode {dec:?}");
    assert!(pre.offloaded_blocks > 0 && dec.restored_bytes > 0);
    drop(b);
    let left: Vec<_> = std::fs::read_dir(kv_dir.path()).unwrap().collect();
    assert!(left.is_empty(), "the KV store outlived its model: {left:?}");
}
