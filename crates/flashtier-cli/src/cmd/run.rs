//! `flashtier run`: greedy decoding of a checkpoint with the experts
//! streamed from a packed store under a memory budget.

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use flashtier_engine::Generation;
use flashtier_engine::device::cuda::kv::tier::KvTierStats;
use flashtier_engine::engine::{Chosen, Engine};
use flashtier_pack::session::Session;

use flashtier_engine::sample::SamplingParams;
use flashtier_text::{ChatMessage, ChatOptions, TextModel};

use crate::kit::model::{ModelArgs, explain_pool, load_model};

/// Options of `flashtier run`.
#[derive(clap::Args, Debug)]
#[command(group(clap::ArgGroup::new("input").required(true).args(["prompt_ids", "prompt"])))]
pub struct Args {
    /// The model and where its tiers live.
    #[command(flatten)]
    pub m: ModelArgs,
    /// Prompt as comma-separated token ids.
    #[arg(long, value_name = "IDS", value_delimiter = ',')]
    pub prompt_ids: Option<Vec<u32>>,
    /// Prompt text, tokenized with the model's tokenizer.json.
    #[arg(long, value_name = "TEXT")]
    pub prompt: Option<String>,
    /// Tokens to generate.
    #[arg(long, value_name = "N", default_value_t = 32)]
    pub max_new: usize,
    /// Keep generating past the model's end-of-sequence token.
    #[arg(long)]
    pub ignore_eos: bool,
    /// Print one JSON object (generated_ids, tokens_per_sec, expert_hit_rate,
    /// bytes_read_per_token, stall_fraction, ...; with --rows-budget also
    /// row_hit_rate, row_bytes_read_per_token, row_stall_fraction) instead
    /// of text.
    #[arg(long)]
    pub json: bool,
    /// Sample: 0 is greedy (the default); see `serve` for how the knobs
    /// combine (flashtier_engine::sample).
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Keep the smallest set of likeliest tokens reaching this mass.
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// Keep the K likeliest tokens (0: all).
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    /// Keep tokens at least this fraction as likely as the likeliest.
    #[arg(long, default_value_t = 0.0)]
    pub min_p: f32,
    /// Divide a seen token's positive logit by it (multiply a negative one).
    #[arg(long, default_value_t = 1.0)]
    pub repetition_penalty: f32,
    /// The sampler's seed (the same seed, prompt and flags: the same tokens).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Render --prompt as one user message through the model's chat
    /// template (tokenizer_config.json or chat_template.jinja).
    #[arg(long, requires = "prompt")]
    pub chat: bool,
    /// Write {"prompt_logits": [[...] per prompt position]} to FILE: not a
    /// file of the model, not the expert store (even one still to be
    /// packed), not in the row-shard folder.
    #[arg(long, value_name = "FILE")]
    pub logits_out: Option<PathBuf>,
}

/// Run `flashtier run`.
pub fn run(args: Args) -> anyhow::Result<()> {
    let text = match &args.prompt {
        Some(_) => Some(load_text(&args.m.model)?),
        None => None,
    };
    let prompt: Vec<u32> = match (&args.prompt_ids, &args.prompt, &text) {
        (Some(ids), _, _) => ids.clone(),
        (None, Some(p), Some(t)) if args.chat => t
            .encode_chat(
                &[ChatMessage::new("user", p.as_str())],
                &ChatOptions::default(),
            )
            .map_err(|e| anyhow::anyhow!("--chat: {e}"))?,
        (None, Some(p), Some(t)) => t
            .encode(p, false)
            .map_err(|e| anyhow::anyhow!("tokenizing --prompt: {e}"))?,
        _ => bail!("give --prompt-ids or --prompt"),
    };
    let params = SamplingParams {
        temperature: args.temperature,
        top_k: args.top_k,
        top_p: args.top_p,
        min_p: args.min_p,
        repetition_penalty: args.repetition_penalty,
        seed: args.seed,
        ..SamplingParams::greedy()
    };
    if !params.is_plain_greedy() || args.top_k != 0 || args.top_p != 1.0 || args.min_p != 0.0 {
        if args.logits_out.is_some() {
            bail!("--logits-out comes from the greedy path: drop the sampling flags");
        }
        params
            .validate(usize::MAX)
            .map_err(|e| anyhow::anyhow!("sampling: {e}"))?;
    }
    if prompt.is_empty() {
        bail!("the prompt is empty");
    }
    if let Some(path) = &args.logits_out {
        refuse_logits_out(path, &args)?;
    }
    let Session {
        engine: mut model,
        store,
        chosen,
        weight_bytes_per_token: touched,
    } = load_model(&args.m, args.json)?;
    if let (Some(why), false) = (&chosen.fallback, args.json) {
        eprintln!("decoding on the CPU: {why}");
    }
    let stop: Vec<u32> = if args.ignore_eos {
        Vec::new()
    } else {
        model.eos_token_ids().to_vec()
    };
    let quiet = args.json;
    let mut stdout = std::io::stdout();
    let mut show = |t: u32| {
        if !quiet {
            let piece = text.as_ref().and_then(|tm| tm.decode(&[t], false).ok());
            let _ = match piece {
                Some(s) => write!(stdout, "{t}:{} ", token_text(&s)),
                None => write!(stdout, "{t} "),
            };
            let _ = stdout.flush();
        }
    };
    let out = if params.is_plain_greedy() {
        model.generate(
            &prompt,
            args.max_new,
            &stop,
            args.logits_out.is_some(),
            show,
        )
    } else {
        model.generate_sampled(&prompt, args.max_new, &stop, &params, &mut show)
    };
    let out = out.map_err(|e| explain_pool(e, &args.m))?;
    if let Some(path) = &args.logits_out {
        write_logits(path, &out)?;
    }
    report(&args, &out, (&store, &model, &chosen, touched))
}

fn load_text(model: &Path) -> anyhow::Result<TextModel> {
    if !model.join("tokenizer.json").exists() {
        bail!(
            "--prompt needs {}, which does not exist; give token ids with --prompt-ids",
            model.join("tokenizer.json").display()
        );
    }
    TextModel::open(model).map_err(|e| anyhow::anyhow!("{e}"))
}

/// Refuse a `--logits-out` that is a file `run` reads or writes, or lies
/// in a folder it writes: the model folder's config, tokenizer, index and
/// safetensors files; the expert store (given, cached, or still to be
/// packed); with `--rows-budget`, the row-shard folder and every file in
/// it. Existing files are compared by canonical path and inode (hard
/// links), absent ones by where they would land.
fn refuse_logits_out(out: &Path, args: &Args) -> anyhow::Result<()> {
    use flashtier_io::persist::{PersistError, refuse_inputs, resolve};
    let model = args.m.model.as_path();
    let session = args.m.session();
    let store = session.store_path()?;
    let mut inputs = model_files(model);
    inputs.push(store);
    refuse_inputs(out, &inputs)?;
    let target = resolve(out)?;
    let refused = |input: &Path, how| PersistError::OutputIsInput {
        out: out.to_path_buf(),
        input: input.to_path_buf(),
        how,
    };
    if let Some(input) = inputs
        .iter()
        .find(|p| resolve(p).ok().as_ref() == Some(&target))
    {
        return Err(refused(input, "it is").into());
    }
    if session.rows.is_some() {
        let dir = session
            .rows_dir()?
            .context("a row store has a row folder")?;
        let at = resolve(&dir).or_else(|_| std::path::absolute(&dir))?;
        if target == at {
            return Err(refused(&dir, "it is").into());
        }
        if target.starts_with(&at) {
            return Err(refused(&dir, "it is in the row-shard folder").into());
        }
    }
    Ok(())
}

/// The files `run` reads in the model folder: config, tokenizer, index
/// and safetensors files.
fn model_files(model: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(model)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            let name = p
                .file_name()
                .map(|n| n.to_string_lossy())
                .unwrap_or_default();
            name.ends_with(".json") || name.ends_with(".safetensors")
        })
        .collect()
}

/// Written whole or not at all (temp file, fsync, rename).
fn write_logits(path: &Path, out: &Generation) -> anyhow::Result<()> {
    let json = serde_json::json!({ "prompt_logits": out.prompt_logits });
    let text = serde_json::to_string(&json)?;
    flashtier_io::persist::write_file(path, text.as_bytes(), flashtier_io::Wait::Block)
        .with_context(|| format!("writing {}", path.display()))
}

fn report(
    args: &Args,
    out: &Generation,
    (store, model, chosen, touched): (&Path, &Engine, &Chosen, u64),
) -> anyhow::Result<()> {
    let e = &out.decode_experts;
    let steps = out.decode_steps.max(1) as f64;
    let bytes_per_token = e.bytes_read as f64 / steps;
    let stall = fraction(e.stall_ns, out.decode_secs);
    if args.json {
        let json = serde_json::json!({
            "generated_ids": out.generated_ids,
            "tokens_per_sec": out.tokens_per_sec(),
            "expert_hit_rate": e.hit_rate(),
            "bytes_read_per_token": bytes_per_token,
            "stall_fraction": stall,
            "decode_steps": out.decode_steps,
            "decode_secs": out.decode_secs,
            "prefill_secs": out.prefill_secs,
            "budget_bytes": args.m.budget,
            "expert_bytes_read_total": out.total_experts.bytes_read,
            "prefetch_bytes_per_token": e.prefetch_bytes as f64 / steps,
            "prefetch_used_bytes_per_token": e.prefetch_used_bytes as f64 / steps,
            "weight_bytes_per_token": touched,
            "weight_bytes_per_sec": touched as f64 * out.tokens_per_sec(),
            "expert_store": store,
            "device": chosen.device,
            "gpu": chosen.gpu_name,
            "device_fallback": chosen.fallback,
            "gpu_tiers": model.gpu_tiers().map(|(t, path, resident)| serde_json::json!({
                "tiers": t, "expert_path": path, "all_resident": resident,
                "budget_hbm_bytes": args.m.budget_hbm.or(args.m.budget), "budget_ram_bytes": args.m.budget_ram,
            })),
            "rows_budget_bytes": args.m.rows_budget,
            "row_hit_rate": out.decode_rows.map(|r| r.hit_rate()),
            "row_bytes_read_per_token": out.decode_rows.map(|r| r.bytes_read as f64 / steps),
            "row_stall_fraction": out.decode_rows.map(|r| fraction(r.stall_ns, out.decode_secs)),
            "kv_budget_hbm_bytes": args.m.kv_budget_hbm,
            "kv_tier": out.decode_kv.map(|k| kv_json(&k, steps, out.decode_secs)),
            "kv_tier_prefill": out.prefill_kv,
            "prefill_tokens_per_sec": if out.prefill_secs > 0.0 { out.prompt_tokens as f64 / out.prefill_secs } else { 0.0 },
        });
        println!("{}", serde_json::to_string_pretty(&json)?);
    } else {
        println!();
        println!(
            "{} tokens on {}; {:.2} tok/s; expert hit rate {:.1}%; {:.0} bytes read per token; stall {:.1}%",
            out.generated_ids.len(),
            chosen.gpu_name.as_deref().unwrap_or("the CPU"),
            out.tokens_per_sec(),
            100.0 * e.hit_rate(),
            bytes_per_token,
            100.0 * stall
        );
        if let Some(k) = out.decode_kv {
            println!(
                "KV beyond HBM: {:.0} bytes restored per token; KV stall {:.2} ms per token ({:.1}%)",
                k.restored_bytes as f64 / steps,
                k.stall_ns() as f64 / 1e6 / steps,
                100.0 * fraction(k.stall_ns(), out.decode_secs)
            );
        }
        if let Some(r) = out.decode_rows {
            println!(
                "PLE rows: hit rate {:.1}%; {:.0} bytes read per token; stall {:.1}%",
                100.0 * r.hit_rate(),
                r.bytes_read as f64 / steps,
                100.0 * fraction(r.stall_ns, out.decode_secs)
            );
        }
    }
    Ok(())
}

/// The KV tier's decode counters per token.
fn kv_json(k: &KvTierStats, steps: f64, secs: f64) -> serde_json::Value {
    serde_json::json!({
        "restored_bytes_per_token": k.restored_bytes as f64 / steps,
        "offloaded_bytes_per_token": k.offloaded_bytes as f64 / steps,
        "stall_ms_per_token": k.stall_ns() as f64 / 1e6 / steps,
        "stall_fraction": fraction(k.stall_ns(), secs),
        "read_wait_ms_per_token": k.read_wait_ns as f64 / 1e6 / steps,
        "totals": k,
    })
}

/// `ns` as a share of `secs` (0 when `secs` is not positive).
fn fraction(ns: u64, secs: f64) -> f64 {
    if secs > 0.0 {
        ns as f64 / 1e9 / secs
    } else {
        0.0
    }
}

/// A token's text kept on one line as plain text: printable characters as
/// they are, line breaks, tabs and other control characters spelled `\n`,
/// `\t`, `\u{1b}` (no Rust quoting).
fn token_text(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c.is_control() => out.push_str(&format!("\\u{{{:x}}}", u32::from(c))),
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::token_text;

    #[test]
    fn token_text_is_plain_and_on_one_line() {
        assert_eq!(token_text(" the"), " the");
        assert_eq!(token_text("say \"hi\""), "say \"hi\"");
        assert_eq!(token_text("a\nb\tc\u{1b}"), "a\\nb\\tc\\u{1b}");
    }
}
