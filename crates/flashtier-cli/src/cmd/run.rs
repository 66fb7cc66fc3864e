//! `flashtier run`: greedy decoding of a Qwen3-MoE or Mixtral checkpoint with
//! the experts streamed under a memory budget.

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use flashtier::experts::Backing;
use flashtier_engine::pack::{PackOptions, check_pairing};
use flashtier_engine::{Checkpoint, Generation, Model, ModelConfig, StreamOptions, open_pool};
use flashtier_format::Store;

/// Options of `flashtier run`.
#[derive(clap::Args, Debug)]
#[command(group(clap::ArgGroup::new("input").required(true).args(["prompt_ids", "prompt"])))]
pub struct Args {
    /// Model directory: config.json and safetensors (tokenizer.json for --prompt).
    #[arg(long, value_name = "DIR")]
    pub model: PathBuf,
    /// Expert store packed from the model; packed there first when the file
    /// does not exist. Without it, experts are read from the safetensors.
    #[arg(long, value_name = "FILE")]
    pub store: Option<PathBuf>,
    /// Memory budget for experts in bytes (suffixes K, M, G: binary); default: all experts.
    #[arg(long, value_name = "BYTES", value_parser = parse_bytes)]
    pub budget: Option<u64>,
    /// Pool backing with --store: `slots` (direct reads into a slot arena) or
    /// `mapped` (the store memory-mapped, page cache as a second tier).
    #[arg(long, value_name = "KIND", default_value = "slots")]
    pub backing: Backing,
    /// Expert reads in flight at most, with --store.
    #[arg(long, value_name = "N", default_value_t = 8)]
    pub queue_depth: usize,
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
    /// bytes_read_per_token, stall_fraction, ...) instead of text.
    #[arg(long)]
    pub json: bool,
    /// Write {"prompt_logits": [[...] per prompt position]} to FILE.
    #[arg(long, value_name = "FILE")]
    pub logits_out: Option<PathBuf>,
}

/// Run `flashtier run`.
pub fn run(args: Args) -> anyhow::Result<()> {
    let tokenizer = match &args.prompt {
        Some(_) => Some(load_tokenizer(&args.model)?),
        None => None,
    };
    let prompt: Vec<u32> = match (&args.prompt_ids, &args.prompt, &tokenizer) {
        (Some(ids), _, _) => ids.clone(),
        (None, Some(text), Some(tok)) => tok
            .encode(text.as_str(), false)
            .map_err(|e| anyhow::anyhow!("tokenizing --prompt: {e}"))?
            .get_ids()
            .to_vec(),
        _ => bail!("give --prompt-ids or --prompt"),
    };
    if prompt.is_empty() {
        bail!("the prompt is empty");
    }
    let mut model = load_model(&args)?;
    let stop: Vec<u32> = if args.ignore_eos {
        Vec::new()
    } else {
        model.config().eos_token_ids.clone()
    };
    let quiet = args.json;
    let mut stdout = std::io::stdout();
    let out = model.generate(
        &prompt,
        args.max_new,
        &stop,
        args.logits_out.is_some(),
        |t| {
            if !quiet {
                let text = tokenizer
                    .as_ref()
                    .and_then(|tok| tok.decode(&[t], false).ok());
                let _ = match text {
                    Some(s) => write!(stdout, "{t}:{s:?} "),
                    None => write!(stdout, "{t} "),
                };
                let _ = stdout.flush();
            }
        },
    )?;
    if let Some(path) = &args.logits_out {
        write_logits(path, &out)?;
    }
    report(&args, &out)
}

/// The model with experts from the checkpoint, or from `--store` (packed
/// first when missing, and checked to come from this checkpoint).
fn load_model(args: &Args) -> anyhow::Result<Model> {
    let Some(store) = &args.store else {
        return Model::load(&args.model, args.budget)
            .with_context(|| format!("loading {}", args.model.display()));
    };
    if !store.exists() {
        let opts = PackOptions::new(&args.model, store);
        let report = super::pack::experts::pack_with_progress(&opts, !args.json)?;
        if !args.json {
            eprintln!("{}", super::pack::experts::report_line(&report));
        }
    }
    let opened = Store::open(store).with_context(|| format!("opening {}", store.display()))?;
    let ckpt = Checkpoint::open(&args.model)
        .with_context(|| format!("opening {}", args.model.display()))?;
    check_pairing(&opened, ckpt.source())?;
    let budget = args
        .budget
        .unwrap_or(opened.stride_bytes() * opened.record_count());
    let cfg = ModelConfig::from_file(&args.model.join("config.json"))?;
    let opts = StreamOptions {
        backing: args.backing,
        budget_bytes: budget,
        queue_depth: args.queue_depth,
    };
    let stride = opened.stride_bytes();
    let experts = open_pool(store, &cfg, opts).with_context(|| {
        format!(
            "--budget {budget} bytes holds {} records of {stride} bytes; a step needs {} (top-k)",
            budget / stride.max(1),
            cfg.top_k
        )
    })?;
    Ok(Model::with_experts(&cfg, &ckpt, Box::new(experts))?)
}

fn load_tokenizer(model: &Path) -> anyhow::Result<tokenizers::Tokenizer> {
    let path = model.join("tokenizer.json");
    if !path.exists() {
        bail!(
            "--prompt needs {}, which does not exist; give token ids with --prompt-ids",
            path.display()
        );
    }
    tokenizers::Tokenizer::from_file(&path)
        .map_err(|e| anyhow::anyhow!("reading {}: {e}", path.display()))
}

fn write_logits(path: &Path, out: &Generation) -> anyhow::Result<()> {
    let json = serde_json::json!({ "prompt_logits": out.prompt_logits });
    let text = serde_json::to_string(&json)?;
    std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))
}

fn report(args: &Args, out: &Generation) -> anyhow::Result<()> {
    let e = &out.decode_experts;
    let steps = out.decode_steps.max(1) as f64;
    let bytes_per_token = e.bytes_read as f64 / steps;
    let stall = if out.decode_secs > 0.0 {
        e.stall_ns as f64 / 1e9 / out.decode_secs
    } else {
        0.0
    };
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
            "budget_bytes": args.budget,
            "expert_bytes_read_total": out.total_experts.bytes_read,
            "prefetch_bytes_per_token": e.prefetch_bytes as f64 / steps,
            "expert_source": if args.store.is_some() { "store" } else { "checkpoint" },
        });
        println!("{}", serde_json::to_string_pretty(&json)?);
    } else {
        println!();
        println!(
            "{} tokens; {:.2} tok/s; expert hit rate {:.1}%; {:.0} bytes read per token; stall {:.1}%",
            out.generated_ids.len(),
            out.tokens_per_sec(),
            100.0 * e.hit_rate(),
            bytes_per_token,
            100.0 * stall
        );
    }
    Ok(())
}

/// `123`, `64K`, `512M`, `2G` (binary multiples) to bytes.
fn parse_bytes(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let (num, shift) = match s.chars().last() {
        Some('K' | 'k') => (&s[..s.len() - 1], 10),
        Some('M' | 'm') => (&s[..s.len() - 1], 20),
        Some('G' | 'g') => (&s[..s.len() - 1], 30),
        _ => (s, 0),
    };
    let n: u64 = num
        .parse()
        .map_err(|_| format!("`{s}` is not a byte count"))?;
    n.checked_mul(1 << shift)
        .ok_or_else(|| format!("`{s}` overflows"))
}

#[cfg(test)]
mod tests {
    use super::parse_bytes;

    #[test]
    fn byte_counts_parse() {
        assert_eq!(parse_bytes("4096"), Ok(4096));
        assert_eq!(parse_bytes("64K"), Ok(64 << 10));
        assert_eq!(parse_bytes("3m"), Ok(3 << 20));
        assert_eq!(parse_bytes("2G"), Ok(2 << 30));
        assert!(parse_bytes("x").is_err());
        assert!(parse_bytes("99999999999G").is_err());
    }
}
