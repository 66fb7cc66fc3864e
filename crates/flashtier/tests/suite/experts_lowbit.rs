//! Low-bit companions: written from a BF16 store, read back through the
//! format layer and through the pool, with the precision in the address.

use std::path::Path;
use std::sync::Arc;

use flashtier::experts::lowbit::{LowbitSpec, QuantTensor, dequantize};
use flashtier::experts::lowbit_pack::{companion_path, write_companion};
use flashtier::experts::{
    Backing, ExpertPool, ExpertsError, PolicyKind, PoolConfig, Precision, StoreSet,
};
use flashtier_format::{
    Dtype, Manifest, RecordKey, RecordLayout, Store, StoreKind, StoreWriterPlan, TensorLayout,
};
use flashtier_io::PosixBackend;
use half::{bf16, f16};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

const N: usize = 3000; // elements of the weight tensor

/// A store of 2 x 4 records: `w` (BF16, roughly Gaussian) then `w_scale` (F32).
fn bf16_store(path: &Path) -> Vec<Vec<f32>> {
    let keys: Vec<RecordKey> = (0..2)
        .flat_map(|l| (0..4).map(move |e| RecordKey::new(l, e)))
        .collect();
    let mut manifest = Manifest::single_tensor(StoreKind::Experts, Dtype::Bf16, 2, keys.clone());
    let w = TensorLayout {
        name: "w".into(),
        dtype: Dtype::Bf16,
        shape: vec![N as u64],
        offset: 0,
        len_bytes: 2 * N as u64,
    };
    let s = TensorLayout {
        name: "w_scale".into(),
        dtype: Dtype::F32,
        shape: vec![4],
        offset: 8192,
        len_bytes: 16,
    };
    manifest.record = RecordLayout {
        payload_bytes: 8192 + 16,
        tensors: vec![w, s],
    };
    let mut rng = SmallRng::seed_from_u64(42);
    let mut values = Vec::new();
    let records: Vec<Vec<u8>> = keys
        .iter()
        .map(|_| {
            let v: Vec<f32> = (0..N)
                .map(|_| {
                    let g: f32 = (0..6).map(|_| rng.random::<f32>() - 0.5).sum();
                    bf16::from_f32(g * 0.05).to_f32()
                })
                .collect();
            let mut rec = vec![0u8; 8192 + 16];
            for (i, x) in v.iter().enumerate() {
                rec[2 * i..2 * i + 2].copy_from_slice(&bf16::from_f32(*x).to_le_bytes());
            }
            rec[8192..8196].copy_from_slice(&0.5f32.to_le_bytes());
            values.push(v);
            rec
        })
        .collect();
    let image = StoreWriterPlan::new(manifest)
        .and_then(|p| p.image(&records))
        .expect("image");
    std::fs::write(path, image).expect("write");
    values
}

fn tensor<'a>(store: &Store, rec: &'a [u8], name: &str) -> &'a [u8] {
    let t = store
        .manifest()
        .record
        .tensors
        .iter()
        .find(|t| t.name == name)
        .expect("tensor");
    &rec[t.offset as usize..(t.offset + t.len_bytes) as usize]
}

#[test]
fn companions_dequantize_within_their_error_and_copy_scales_exactly() {
    let dir = tempfile::tempdir().expect("tempdir");
    let exact = dir.path().join("e.ftstore");
    let values = bf16_store(&exact);
    let mut rel = Vec::new();
    for bits in [3u32, 2] {
        let spec = LowbitSpec::new(bits, 64).expect("spec");
        let out = companion_path(&exact, bits);
        let report = write_companion(&exact, &out, spec, &mut |_, _| {}).expect("companion");
        assert_eq!(
            (
                report.records,
                report.quantized_tensors,
                report.copied_tensors
            ),
            (8, 1, 1)
        );
        let store = Store::open(&out).expect("companion is a valid store");
        assert_eq!(store.manifest().extra["lowbit"]["bits"], bits);
        let file =
            flashtier_io::StoreFile::open_read(&out, flashtier_io::DirectMode::Off).expect("open");
        let mut buf = vec![0u8; store.payload_bytes() as usize];
        for (i, src) in values.iter().enumerate() {
            store
                .read_record(file.as_ref(), i as u64, &mut buf)
                .expect("checksum ok");
            let f16s = |b: &[u8]| {
                b.chunks_exact(2)
                    .map(|c| f16::from_le_bytes([c[0], c[1]]))
                    .collect::<Vec<_>>()
            };
            let q = QuantTensor {
                mins: f16s(tensor(&store, &buf, &format!("w.q{bits}.min"))),
                steps: f16s(tensor(&store, &buf, &format!("w.q{bits}.step"))),
                codes: tensor(&store, &buf, &format!("w.q{bits}.codes")).to_vec(),
            };
            let deq = dequantize(&q, N, spec);
            let mut tally = flashtier::experts::lowbit::QuantError::default();
            tally.add(src, &deq);
            assert!(
                tally.relative_rmse() <= report.error.relative_rmse() * 1.5 + 1e-6,
                "record {i} far off the store's figure"
            );
            assert_eq!(
                tensor(&store, &buf, "w_scale"),
                0.5f32
                    .to_le_bytes()
                    .iter()
                    .chain(&[0u8; 12])
                    .copied()
                    .collect::<Vec<_>>()
            );
        }
        rel.push(report.error.relative_rmse());
        println!(
            "bits {bits}: relative rmse {:.4}, max abs {:.5}",
            report.error.relative_rmse(),
            report.error.max_abs_err
        );
    }
    assert!(rel[0] < rel[1], "3-bit is closer than 2-bit: {rel:?}");
    assert!(rel[0] < 0.2 && rel[1] < 0.45, "{rel:?}");
}

#[test]
fn a_slot_holds_a_low_bit_record_only_by_choice_and_says_so() {
    let dir = tempfile::tempdir().expect("tempdir");
    let exact = dir.path().join("e.ftstore");
    bf16_store(&exact);
    let q2 = companion_path(&exact, 2);
    write_companion(
        &exact,
        &q2,
        LowbitSpec::new(2, 64).expect("spec"),
        &mut |_, _| {},
    )
    .expect("companion");
    let q2_store = Store::open(&q2).expect("q2");
    let mut stores = StoreSet::open(&exact, false).expect("open");
    stores.attach(Precision::Q2, &q2).expect("attach");
    let config = PoolConfig {
        backing: Backing::Slots,
        budget_bytes: 4 * 12288,
        policy: PolicyKind::Lru,
    };
    let mut pool = ExpertPool::new(
        stores,
        Arc::new(PosixBackend::new(2).expect("posix")),
        config,
    )
    .expect("pool");
    let (a, b) = (
        pool.index_of(1, 0).expect("k"),
        pool.index_of(1, 1).expect("k"),
    );
    let need = pool.acquire(&[a, b]).expect("acquire");
    assert!(matches!(
        pool.set_precision(a, Precision::Q3),
        Err(ExpertsError::NoStore(Precision::Q3))
    ));
    pool.set_precision(a, Precision::Q2).expect("q2 attached");
    let plan = pool.plan(&need).expect("plan");
    pool.run(plan).expect("run");
    let (addr_a, addr_b) = (pool.addr(a).expect("a"), pool.addr(b).expect("b"));
    assert_eq!(
        (addr_a.precision, addr_b.precision),
        (Precision::Q2, Precision::Full),
        "default stays exact"
    );
    assert_eq!(addr_a.len_bytes, q2_store.payload_bytes() as usize);
    let file =
        flashtier_io::StoreFile::open_read(&q2, flashtier_io::DirectMode::Off).expect("open");
    let mut want = vec![0u8; q2_store.payload_bytes() as usize];
    q2_store
        .read_record(file.as_ref(), a as u64, &mut want)
        .expect("read");
    assert_eq!(pool.bytes(a).expect("ready"), &want[..]);
    assert!(
        matches!(
            pool.set_precision(b, Precision::Q2),
            Err(ExpertsError::Lifecycle(_))
        ),
        "only before planning a miss"
    );
    pool.finish().expect("finish");
}
