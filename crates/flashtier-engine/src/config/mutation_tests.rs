//! Every `config.json` of the engine's fixtures, mutated at random: a
//! field anywhere in it (nested objects and arrays included) set to an
//! absurd count, a negative or fractional number, another type, or
//! removed, up to four faults at once. The parser of its family answers a
//! config or a typed [`EngineError::Config`], never panics, and a config
//! it accepts keeps the bounds the rest of the engine relies on. The
//! same property, on arbitrary bytes, is the `config_parser` fuzz target
//! (`fuzz/`).

use proptest::prelude::*;
use serde_json::{Value, json};

use super::ModelConfig;
use super::bounds::{MAX_CONFIG_COUNT, MAX_LAYERS};
use super::qwen4::Qwen4Config;
use crate::error::EngineError;

/// The fixtures' configs, read once.
fn fixtures() -> &'static [Value] {
    static CONFIGS: std::sync::OnceLock<Vec<Value>> = std::sync::OnceLock::new();
    CONFIGS.get_or_init(|| {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/engine");
        let mut paths: Vec<_> = std::fs::read_dir(&dir)
            .expect("fixtures folder")
            .map(|e| e.expect("entry").path().join("config.json"))
            .filter(|p| p.is_file())
            .collect();
        paths.sort();
        let configs: Vec<Value> = paths
            .iter()
            .map(|p| serde_json::from_slice(&std::fs::read(p).expect("readable")).expect("JSON"))
            .collect();
        assert!(configs.len() >= 8, "found only {paths:?}");
        configs
    })
}

/// A value a faulty or hostile config might hold where a count, a flag, a
/// name or a list belongs.
fn odd_value() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(json!(0)),
        Just(json!(1)),
        Just(json!(-1)),
        Just(json!(u32::MAX)),
        Just(json!(MAX_CONFIG_COUNT + 1)),
        Just(json!(1u64 << 62)),
        Just(json!(u64::MAX)),
        Just(json!(0.5)),
        Just(json!(1e308)),
        Just(json!(-1e308)),
        Just(json!(f64::MIN_POSITIVE)),
        Just(json!("7")),
        Just(json!("")),
        Just(Value::Null),
        Just(json!(true)),
        Just(json!([])),
        Just(json!([0, 1, 2])),
        Just(json!({})),
        any::<i64>().prop_map(|v| json!(v)),
        any::<u32>().prop_map(|v| json!(v)),
        (-1e12f64..1e12).prop_map(|v| json!(v)),
    ]
}

/// One fault: the `pick`-th place of the config (in a walk of every
/// object member and array element) replaced by `value`, or removed.
#[derive(Clone, Debug)]
struct Fault {
    pick: usize,
    value: Option<Value>,
}

fn fault() -> impl Strategy<Value = Fault> {
    (
        any::<usize>(),
        proptest::option::weighted(0.85, odd_value()),
    )
        .prop_map(|(pick, value)| Fault { pick, value })
}

/// How many places `v` holds below its root.
fn places(v: &Value) -> usize {
    match v {
        Value::Object(m) => m.values().map(|c| 1 + places(c)).sum(),
        Value::Array(a) => a.iter().map(|c| 1 + places(c)).sum(),
        _ => 0,
    }
}

/// Apply `f` to place `n` of `v` (counted as [`places`] counts them);
/// true once applied.
fn apply(v: &mut Value, n: &mut usize, f: &Fault) -> bool {
    match v {
        Value::Object(m) => {
            let keys: Vec<String> = m.keys().cloned().collect();
            for k in keys {
                if *n == 0 {
                    match &f.value {
                        Some(x) => {
                            m.insert(k, x.clone());
                        }
                        None => {
                            m.remove(&k);
                        }
                    }
                    return true;
                }
                *n -= 1;
                if apply(m.get_mut(&k).expect("present"), n, f) {
                    return true;
                }
            }
            false
        }
        Value::Array(a) => {
            for i in 0..a.len() {
                if *n == 0 {
                    match &f.value {
                        Some(x) => a[i] = x.clone(),
                        None => {
                            a.remove(i);
                        }
                    }
                    return true;
                }
                *n -= 1;
                if apply(&mut a[i], n, f) {
                    return true;
                }
            }
            false
        }
        _ => false,
    }
}

/// Parse `v` as the engine does (Qwen4-Exp configs by their own parser)
/// and check the answer.
fn check(v: &Value) -> Result<(), TestCaseError> {
    let typed = |e: EngineError| match e {
        EngineError::Config { field, .. } if !field.is_empty() => Ok(()),
        other => Err(TestCaseError::fail(format!(
            "not a named config error: {other}"
        ))),
    };
    if Qwen4Config::is_qwen4(v) {
        match Qwen4Config::from_json(v) {
            Ok(c) => {
                prop_assert!(!c.layers.is_empty() && c.layers.len() <= MAX_LAYERS);
                prop_assert!(c.hidden_size > 0 && c.vocab_size > 0);
                prop_assert!(c.top_k <= c.num_experts);
                prop_assert!(c.kv_heads > 0 && c.q_heads % c.kv_heads == 0);
            }
            Err(e) => typed(e)?,
        }
    } else {
        match ModelConfig::from_json(v) {
            Ok(c) => {
                prop_assert!(c.num_layers > 0 && c.num_layers <= MAX_LAYERS);
                prop_assert!(c.hidden_size > 0 && c.vocab_size > 0);
                prop_assert!(c.num_experts == 0 || c.top_k <= c.num_experts);
            }
            Err(e) => typed(e)?,
        }
    }
    Ok(())
}

/// Every fixture parses as it is (the mutations start from valid configs).
#[test]
fn every_fixture_config_parses() {
    for v in fixtures() {
        let ok = if Qwen4Config::is_qwen4(v) {
            Qwen4Config::from_json(v).map(|_| ())
        } else {
            ModelConfig::from_json(v).map(|_| ())
        };
        ok.unwrap_or_else(|e| panic!("{e}: {v}"));
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn mutated_configs_parse_or_name_their_fault(
        which in any::<usize>(),
        faults in proptest::collection::vec(fault(), 1..=4),
    ) {
        let configs = fixtures();
        let mut v = configs[which % configs.len()].clone();
        for f in &faults {
            let count = places(&v);
            if count == 0 {
                break;
            }
            let mut n = f.pick % count;
            prop_assert!(apply(&mut v, &mut n, f));
        }
        check(&v)?;
    }

    /// A config that is not even an object, or holds anything at its
    /// root: a typed error, never a panic.
    #[test]
    fn any_root_value_is_answered(v in odd_value()) {
        check(&v)?;
    }
}
