//! What a model folder's config files say about text: special tokens, the
//! chat template's source, and the end-of-sequence ids.
//!
//! Resolution rules (transformers 5.x, `AutoTokenizer.from_pretrained` and
//! `generate`):
//! - Chat template: `chat_template.jinja` (the default) and
//!   `additional_chat_templates/*.jinja` (named) take priority over
//!   tokenizer_config.json's `chat_template`, which is a string or a list of
//!   `{name, template}`. A set of named templates must have a `default`;
//!   a `tool_use` template is picked instead when tools are given. At
//!   most [`MAX_NAMED_TEMPLATES`] files are read from the folder.
//! - Special tokens: tokenizer_config.json's `bos_token`, `eos_token`,
//!   `unk_token`, `sep_token`, `pad_token`, `cls_token`, `mask_token`, each a
//!   string, an AddedToken object (`{"content": ...}`) or null. A legacy
//!   folder (no `added_tokens_decoder`) has them overridden by
//!   special_tokens_map.json, as transformers does.
//! - End-of-sequence ids: generation_config.json's `eos_token_id` when it is
//!   present and not null, else config.json's `eos_token_id` (or its
//!   `text_config.eos_token_id` when the top level has none); an int, a
//!   list of ints, or null (no ids).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::error::{Result, TextError};
use crate::files;

/// The most templates `additional_chat_templates/` may hold (each is read
/// and compiled at open).
pub const MAX_NAMED_TEMPLATES: usize = 64;

/// The named special tokens, as strings (transformers' `special_tokens_map`:
/// unset ones are `None` and stay undefined in chat templates).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SpecialTokens {
    /// `bos_token`.
    pub bos: Option<String>,
    /// `eos_token`.
    pub eos: Option<String>,
    /// `unk_token`.
    pub unk: Option<String>,
    /// `sep_token`.
    pub sep: Option<String>,
    /// `pad_token`.
    pub pad: Option<String>,
    /// `cls_token`.
    pub cls: Option<String>,
    /// `mask_token`.
    pub mask: Option<String>,
}

/// The config field names, in transformers' `SPECIAL_TOKENS_ATTRIBUTES` order.
const SPECIAL_FIELDS: [&str; 7] = [
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
];

impl SpecialTokens {
    /// `(field name, value)` for every named token, set or not, in
    /// transformers' order (the names chat templates see).
    pub fn named(&self) -> [(&'static str, Option<&str>); 7] {
        let slots = [
            &self.bos, &self.eos, &self.unk, &self.sep, &self.pad, &self.cls, &self.mask,
        ];
        let mut out = [("", None); 7];
        for ((slot, field), value) in out.iter_mut().zip(SPECIAL_FIELDS).zip(slots) {
            *slot = (field, value.as_deref());
        }
        out
    }

    fn slot_mut(&mut self, field: &str) -> Option<&mut Option<String>> {
        Some(match field {
            "bos_token" => &mut self.bos,
            "eos_token" => &mut self.eos,
            "unk_token" => &mut self.unk,
            "sep_token" => &mut self.sep,
            "pad_token" => &mut self.pad,
            "cls_token" => &mut self.cls,
            "mask_token" => &mut self.mask,
            _ => return None,
        })
    }
}

/// One chat template's text and where it came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct TemplateSource {
    /// A label for errors: the file, plus `#chat_template[name]` when it
    /// came out of tokenizer_config.json.
    pub label: String,
    /// The Jinja source.
    pub source: String,
}

/// The folder's chat templates: the default and, when present, `tool_use`.
#[derive(Debug, Clone, Default)]
pub(crate) struct TemplateSet {
    pub default: Option<TemplateSource>,
    pub tool_use: Option<TemplateSource>,
}

/// tokenizer_config.json's text settings.
#[derive(Debug, Clone, Default)]
pub(crate) struct TokenizerConfig {
    pub specials: SpecialTokens,
    pub add_bos_token: Option<bool>,
    pub add_eos_token: Option<bool>,
    pub templates: TemplateSet,
}

fn bad(path: &Path, field: impl Into<String>, reason: impl Into<String>) -> TextError {
    TextError::BadField {
        path: path.to_path_buf(),
        field: field.into(),
        reason: reason.into(),
    }
}

/// A special token's value: a string, `{"content": "..."}`, or null.
fn special_token(path: &Path, field: &str, value: &Value) -> Result<Option<String>> {
    match value {
        Value::Null => Ok(None),
        Value::String(s) => Ok(Some(s.clone())),
        Value::Object(obj) => match obj.get("content") {
            Some(Value::String(s)) => Ok(Some(s.clone())),
            _ => Err(bad(path, format!("{field}.content"), "is not a string")),
        },
        _ => Err(bad(
            path,
            field,
            "is not a string, an AddedToken object or null",
        )),
    }
}

fn optional_bool(
    path: &Path,
    obj: &serde_json::Map<String, Value>,
    field: &str,
) -> Result<Option<bool>> {
    match obj.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(_) => Err(bad(path, field, "is not a boolean")),
    }
}

/// tokenizer_config.json's `chat_template`: a string, or a list of
/// `{name, template}`; returns the templates by name.
fn config_templates(path: &Path, value: &Value) -> Result<BTreeMap<String, TemplateSource>> {
    let label = |name: &str| format!("{}#chat_template[{name}]", path.display());
    let mut named = BTreeMap::new();
    match value {
        Value::Null => {}
        Value::String(source) => {
            let source = TemplateSource {
                label: format!("{}#chat_template", path.display()),
                source: source.clone(),
            };
            named.insert("default".to_owned(), source);
        }
        Value::Array(entries) => {
            for (i, entry) in entries.iter().enumerate() {
                let field = |key: &str| format!("chat_template[{i}].{key}");
                let name = entry.get("name").and_then(Value::as_str);
                let template = entry.get("template").and_then(Value::as_str);
                let name = name.ok_or_else(|| bad(path, field("name"), "is not a string"))?;
                let template =
                    template.ok_or_else(|| bad(path, field("template"), "is not a string"))?;
                let source = TemplateSource {
                    label: label(name),
                    source: template.to_owned(),
                };
                named.insert(name.to_owned(), source);
            }
        }
        _ => {
            return Err(bad(
                path,
                "chat_template",
                "is neither a string nor a list of {name, template}",
            ));
        }
    }
    Ok(named)
}

/// The template files beside the configs: `chat_template.jinja` as
/// `default`, `additional_chat_templates/NAME.jinja` as `NAME`.
fn file_templates(dir: &Path) -> Result<BTreeMap<String, TemplateSource>> {
    let mut named = BTreeMap::new();
    let mut add = |name: String, path: PathBuf| -> Result<()> {
        let source = files::read_text(&path)?;
        let label = path.display().to_string();
        named.insert(name, TemplateSource { label, source });
        Ok(())
    };
    let main = dir.join("chat_template.jinja");
    if files::exists(&main) {
        add("default".to_owned(), main)?;
    }
    let extra = dir.join("additional_chat_templates");
    if extra.is_dir() {
        let io = |source| TextError::Io {
            path: extra.clone(),
            source,
        };
        let mut paths = Vec::new();
        for entry in std::fs::read_dir(&extra).map_err(io)? {
            let path = entry.map_err(io)?.path();
            if path.extension().is_some_and(|e| e == "jinja") {
                paths.push(path);
            }
            if paths.len() > MAX_NAMED_TEMPLATES {
                return Err(TextError::TooManyTemplates {
                    path: extra.clone(),
                    limit: MAX_NAMED_TEMPLATES,
                });
            }
        }
        paths.sort();
        for path in paths {
            if let Some(name) = path.file_stem().and_then(|s| s.to_str()) {
                add(name.to_owned(), path.clone())?;
            }
        }
    }
    Ok(named)
}

/// Picks `default` (and `tool_use`) out of the named templates.
fn template_set(path: &Path, mut named: BTreeMap<String, TemplateSource>) -> Result<TemplateSet> {
    if named.is_empty() {
        return Ok(TemplateSet::default());
    }
    let Some(default) = named.remove("default") else {
        return Err(TextError::NoDefaultTemplate {
            path: path.to_path_buf(),
            names: named.into_keys().collect(),
        });
    };
    Ok(TemplateSet {
        default: Some(default),
        tool_use: named.remove("tool_use"),
    })
}

/// Reads tokenizer_config.json (optional), special_tokens_map.json (legacy)
/// and the template files of `dir`.
pub(crate) fn tokenizer_config(dir: &Path) -> Result<TokenizerConfig> {
    let path = dir.join("tokenizer_config.json");
    let mut config = TokenizerConfig::default();
    let root = files::read_json_if_present(&path)?.unwrap_or(Value::Object(Default::default()));
    let Value::Object(obj) = &root else {
        return Err(bad(&path, "(root)", "is not a JSON object"));
    };
    for field in SPECIAL_FIELDS {
        if let (Some(value), Some(slot)) = (obj.get(field), config.specials.slot_mut(field)) {
            *slot = special_token(&path, field, value)?;
        }
    }
    if !obj.contains_key("added_tokens_decoder") {
        legacy_special_tokens(dir, &mut config.specials)?;
    }
    config.add_bos_token = optional_bool(&path, obj, "add_bos_token")?;
    config.add_eos_token = optional_bool(&path, obj, "add_eos_token")?;

    let from_files = file_templates(dir)?;
    config.templates = if from_files.is_empty() {
        let named = match obj.get("chat_template") {
            Some(value) => config_templates(&path, value)?,
            None => BTreeMap::new(),
        };
        template_set(&path, named)?
    } else {
        template_set(&dir.join("chat_template.jinja"), from_files)?
    };
    Ok(config)
}

/// special_tokens_map.json, which a legacy folder's tokens come from.
fn legacy_special_tokens(dir: &Path, specials: &mut SpecialTokens) -> Result<()> {
    let path = dir.join("special_tokens_map.json");
    let Some(root) = files::read_json_if_present(&path)? else {
        return Ok(());
    };
    let Value::Object(obj) = &root else {
        return Err(bad(&path, "(root)", "is not a JSON object"));
    };
    for field in SPECIAL_FIELDS {
        if let (Some(value), Some(slot)) = (obj.get(field), specials.slot_mut(field)) {
            *slot = special_token(&path, field, value)?;
        }
    }
    Ok(())
}

/// Where the end-of-sequence ids were found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct EosIds {
    pub ids: Vec<u32>,
    /// The file and field they came from (`None` when no file has them).
    pub origin: Option<(PathBuf, String)>,
}

/// An `eos_token_id` value: an int, a list of ints, or null.
fn id_list(path: &Path, field: &str, value: &Value) -> Result<Vec<i64>> {
    let one = |v: &Value, at: String| -> Result<i64> {
        v.as_i64().ok_or_else(|| bad(path, at, "is not an integer"))
    };
    match value {
        Value::Null => Ok(Vec::new()),
        Value::Array(items) => items
            .iter()
            .enumerate()
            .map(|(i, v)| one(v, format!("{field}[{i}]")))
            .collect(),
        other => Ok(vec![one(other, field.to_owned())?]),
    }
}

/// Resolves the end-of-sequence ids as transformers' `generate` does (see
/// the module docs), checking each with `in_vocab`.
pub(crate) fn eos_ids(
    dir: &Path,
    vocab_size: usize,
    in_vocab: impl Fn(u32) -> bool,
) -> Result<EosIds> {
    let generation = dir.join("generation_config.json");
    let model = dir.join("config.json");
    let mut found = None;
    if let Some(root) = files::read_json_if_present(&generation)? {
        if let Some(value) = root.get("eos_token_id").filter(|v| !v.is_null()) {
            found = Some((generation, "eos_token_id".to_owned(), value.clone()));
        }
    }
    if found.is_none() {
        if let Some(root) = files::read_json_if_present(&model)? {
            if let Some(value) = root.get("eos_token_id") {
                found = Some((model, "eos_token_id".to_owned(), value.clone()));
            } else if let Some(value) = root.pointer("/text_config/eos_token_id") {
                found = Some((model, "text_config.eos_token_id".to_owned(), value.clone()));
            }
        }
    }
    let Some((path, field, value)) = found else {
        return Ok(EosIds {
            ids: Vec::new(),
            origin: None,
        });
    };
    let mut ids = Vec::new();
    for id in id_list(&path, &field, &value)? {
        let checked = u32::try_from(id).ok().filter(|&id| in_vocab(id));
        let Some(id) = checked else {
            return Err(TextError::IdOutOfVocab {
                path,
                field,
                id,
                vocab_size,
            });
        };
        if !ids.contains(&id) {
            ids.push(id);
        }
    }
    Ok(EosIds {
        ids,
        origin: Some((path, field)),
    })
}
