//! Fuzz the `config.json` parsers (the engine's and Qwen4-Exp's): any bytes
//! either parse into a config within the engine's bounds or give a typed
//! error naming a field. Never a panic. The stable-toolchain twin of this
//! target is `config::mutation_tests` in flashtier-engine.
#![no_main]

use flashtier_engine::EngineError;
use flashtier_engine::config::ModelConfig;
use flashtier_engine::config::bounds::MAX_LAYERS;
use flashtier_engine::config::qwen4::Qwen4Config;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(value) = serde_json::from_slice::<serde_json::Value>(data) else {
        return;
    };
    let named = |e: EngineError| match e {
        EngineError::Config { field, .. } => assert!(!field.is_empty()),
        other => panic!("not a config error: {other}"),
    };
    if Qwen4Config::is_qwen4(&value) {
        match Qwen4Config::from_json(&value) {
            Ok(c) => {
                assert!(!c.layers.is_empty() && c.layers.len() <= MAX_LAYERS);
                assert!(c.top_k <= c.num_experts);
            }
            Err(e) => named(e),
        }
    } else {
        match ModelConfig::from_json(&value) {
            Ok(c) => {
                assert!(c.num_layers > 0 && c.num_layers <= MAX_LAYERS);
                assert!(c.num_experts == 0 || c.top_k <= c.num_experts);
            }
            Err(e) => named(e),
        }
    }
});
