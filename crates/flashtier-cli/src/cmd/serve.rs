//! `flashtier serve`: the OpenAI-compatible HTTP server over one model.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use flashtier_serve::prefix::SpillConfig;
use flashtier_serve::{HttpConfig, Scheduler, SchedulerConfig};
use flashtier_text::TextModel;

use crate::kit::model::{ModelArgs, load_model};
use crate::kit::parse_bytes;
use flashtier_pack::session::Session;

/// Options of `flashtier serve`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// The model and where its tiers live (as for `run`).
    #[command(flatten)]
    pub m: ModelArgs,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on (0: any free port, printed at start).
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// The model's name in requests and answers [default: the model
    /// folder's name].
    #[arg(long, value_name = "NAME")]
    pub served_model_name: Option<String>,
    /// Folder of tokenizer.json, tokenizer_config.json (the chat template)
    /// and generation_config.json [default: --model].
    #[arg(long, value_name = "DIR")]
    pub tokenizer: Option<PathBuf>,
    /// Sequences decoded together at most (Qwen4-Exp: 1).
    #[arg(long, value_name = "N", default_value_t = 8)]
    pub max_batch: usize,
    /// Requests waiting at most; past it a request gets 429.
    #[arg(long, value_name = "N", default_value_t = 256)]
    pub max_queue: usize,
    /// Tokens (prompt chunks and decode tokens of all sequences) in one
    /// engine step at most (at most 256; a prompt alone, with nothing else
    /// running or waiting, takes the device's prompt steps, up to 1024 on
    /// a GPU).
    #[arg(long, value_name = "N", default_value_t = 256)]
    pub step_tokens: usize,
    /// Positions of one sequence at most, prompt and output [default: the
    /// model's context].
    #[arg(long, value_name = "N")]
    pub context: Option<usize>,
    /// Positions of finished sequences' KV caches kept in memory for
    /// prompt reuse (0: no reuse).
    #[arg(long, value_name = "N", default_value_t = 65536)]
    pub prefix_cache_tokens: usize,
    /// Spill kept KV caches past --prefix-cache-tokens to a KV store file in
    /// DIR instead of dropping them, and restore them (checksummed) for a
    /// prompt that shares their first tokens. CPU engine only (GPU caches
    /// stay in memory). Off when unset.
    #[arg(long, value_name = "DIR")]
    pub prefix_spill_dir: Option<PathBuf>,
    /// Positions the spill store holds at most (whole 16-position blocks;
    /// its file is made at its final size: the README's serve section).
    #[arg(
        long,
        value_name = "N",
        default_value_t = 65536,
        requires = "prefix_spill_dir"
    )]
    pub prefix_spill_tokens: usize,
    /// Kept caches the spill writes at once at most (1 to 64): queued or
    /// being written on its writer thread; a cache leaving memory past them
    /// is dropped (counted in /metrics). Each holds up to --context
    /// positions of KV in memory until written.
    #[arg(
        long,
        value_name = "N",
        default_value_t = flashtier_serve::prefix::DEFAULT_WRITE_QUEUE as u64,
        value_parser = clap::value_parser!(u64).range(1..=flashtier_serve::prefix::MAX_WRITE_QUEUE as u64),
        requires = "prefix_spill_dir"
    )]
    pub prefix_spill_writes: u64,
    /// Requests must send `Authorization: Bearer KEY` (unset or empty: no
    /// key asked).
    #[arg(
        long,
        value_name = "KEY",
        env = "FLASHTIER_API_KEY",
        hide_env_values = true
    )]
    pub api_key: Option<String>,
    /// Largest request body.
    #[arg(long, value_name = "BYTES", value_parser = parse_bytes, default_value = "16M")]
    pub max_body: u64,
    /// Print one JSON line when listening ({"listening": ADDR, ...}).
    #[arg(long)]
    pub json: bool,
}

/// Run `flashtier serve` until Ctrl-C (or SIGTERM).
pub fn run(args: Args) -> anyhow::Result<()> {
    let text_dir = args
        .tokenizer
        .clone()
        .unwrap_or_else(|| args.m.model.clone());
    let text = TextModel::open(&text_dir)
        .with_context(|| format!("loading the tokenizer from {}", text_dir.display()))?;
    let name = args.served_model_name.clone().unwrap_or_else(|| {
        args.m
            .model
            .canonicalize()
            .ok()
            .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
            .unwrap_or_else(|| "model".into())
    });
    let cfg = SchedulerConfig {
        max_batch: args.max_batch.max(1),
        max_queue: args.max_queue,
        step_rows: args.step_tokens.max(1),
        context: args.context.unwrap_or(usize::MAX),
        prefix_cache_tokens: args.prefix_cache_tokens,
        prefix_spill: args.prefix_spill_dir.as_ref().map(|dir| SpillConfig {
            // At most MAX_WRITE_QUEUE (the parser's range).
            write_queue: usize::try_from(args.prefix_spill_writes).unwrap_or(usize::MAX),
            ..SpillConfig::new(dir, args.prefix_spill_tokens)
        }),
    };
    let (m, json) = (args.m.clone(), args.json);
    let (tx, rx) = std::sync::mpsc::channel();
    let (sched, thread) = Scheduler::start(
        move || {
            let Session { engine, chosen, .. } =
                load_model(&m, json).map_err(|e| format!("{e:#}"))?;
            let _ = tx.send((chosen, engine.eos_token_ids().to_vec()));
            Ok::<_, String>(engine)
        },
        cfg,
    )
    .map_err(|e| anyhow::anyhow!(e))?;
    let (chosen, engine_eos) = rx.recv().context("the engine did not say where it runs")?;
    if let (Some(why), false) = (&chosen.fallback, args.json) {
        eprintln!("decoding on the CPU: {why}");
    }
    // generation_config.json's and config.json's end tokens alike.
    let mut eos = text.eos_token_ids().to_vec();
    eos.extend(engine_eos);
    eos.sort_unstable();
    eos.dedup();
    let http = HttpConfig {
        model_name: name.clone(),
        api_key: args.api_key.clone().filter(|k| !k.is_empty()),
        max_body_bytes: usize::try_from(args.max_body).unwrap_or(usize::MAX),
    };
    let limits = thread.config().clone();
    let app = flashtier_serve::router(sched.clone(), Arc::new(text), eos, http);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the HTTP runtime")?;
    let stop = sched.clone();
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind((args.host.as_str(), args.port))
            .await
            .with_context(|| format!("listening on {}:{}", args.host, args.port))?;
        let addr: SocketAddr = listener.local_addr()?;
        if args.json {
            println!(
                "{}",
                serde_json::json!({
                    "listening": format!("http://{addr}"), "model": name,
                    "device": chosen.device, "gpu": chosen.gpu_name,
                    "max_batch": limits.max_batch, "context": limits.context,
                    "step_tokens": limits.step_rows, "max_queue": limits.max_queue,
                    "prefix_cache_tokens": limits.prefix_cache_tokens,
                    "prefix_spill_dir": limits.prefix_spill.as_ref().map(|s| s.dir.display().to_string()),
                    "prefix_spill_tokens": limits.prefix_spill.as_ref().map(|s| s.tokens),
                    "prefix_spill_writes": limits.prefix_spill.as_ref().map(|s| s.write_queue),
                })
            );
        } else {
            eprintln!(
                "flashtier serve: {name} on {} at http://{addr}/v1 (batch {}, context {}, Ctrl-C stops)",
                chosen.gpu_name.as_deref().unwrap_or(chosen.device),
                limits.max_batch,
                limits.context
            );
        }
        axum::serve(listener, app)
            .with_graceful_shutdown(async move {
                shutdown_signal().await;
                stop.stop();
            })
            .await
            .context("serving")
    })?;
    drop(sched);
    thread.join();
    Ok(())
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {},
        () = term => {},
    }
}
