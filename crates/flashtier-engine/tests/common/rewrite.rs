//! A fixture checkpoint rewritten for a test: every tensor of its
//! safetensors files read into memory, edited together with its config,
//! and written as one `model.safetensors` into a new temp folder; and the
//! multimodal wrapper's layout ([`wrap`]). Shared by the engine's tests and
//! the CLI's (which include this file by path).
#![allow(
    dead_code,
    clippy::unwrap_used,
    reason = "test helpers: a broken fixture must fail the test loudly"
)]

use std::collections::BTreeMap;
use std::path::Path;

use safetensors::{Dtype, tensor::TensorView};
use serde_json::Value;

/// Tensors by name: dtype, shape, bytes.
pub type Tensors = BTreeMap<String, (Dtype, Vec<usize>, Vec<u8>)>;

/// A copy of the checkpoint in `src` in one safetensors file, its tensors
/// and config changed by `edit`.
pub fn rewritten(src: &Path, edit: impl FnOnce(&mut Tensors, &mut Value)) -> tempfile::TempDir {
    let mut files: Vec<_> = std::fs::read_dir(src)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    files.sort();
    let mut tensors = Tensors::new();
    for file in files {
        let bytes = std::fs::read(file).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        for (name, v) in st.iter() {
            tensors.insert(
                name.to_string(),
                (v.dtype(), v.shape().to_vec(), v.data().to_vec()),
            );
        }
    }
    let mut config: Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    edit(&mut tensors, &mut config);
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("config.json"), config.to_string()).unwrap();
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|(n, (dt, s, d))| (n.clone(), TensorView::new(*dt, s.clone(), d).unwrap()))
        .collect();
    safetensors::serialize_to_file(views, None, &dir.path().join("model.safetensors")).unwrap();
    dir
}

/// The multimodal wrapper's layout: the text model's tensors under
/// `model.language_model.`, its config as `text_config` of a `qwen4_exp`
/// config (with an empty vision config: the tower is not run).
pub fn wrap(t: &mut Tensors, config: &mut Value) {
    let names: Vec<String> = t
        .keys()
        .filter(|n| n.starts_with("model."))
        .cloned()
        .collect();
    for n in names {
        let v = t.remove(&n).unwrap();
        t.insert(format!("model.language_model.{}", &n["model.".len()..]), v);
    }
    let text = config.clone();
    *config = serde_json::json!({
        "model_type": "qwen4_exp",
        "architectures": ["Qwen4ExpForConditionalGeneration"],
        "text_config": text,
        "vision_config": {},
    });
}
