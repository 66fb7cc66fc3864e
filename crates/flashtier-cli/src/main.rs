//! The `flashtier` command.

use clap::{Parser, Subcommand};

mod cmd;
mod kit;

/// flashtier: run language models bigger than memory by streaming their bulky
/// inference state (MoE experts, embedding rows, KV blocks) from NVMe.
#[derive(Parser, Debug)]
#[command(name = "flashtier", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// The main job end to end on a built-in synthetic model (no download).
    Demo(cmd::demo::Args),
    /// Build store files from checkpoints.
    #[command(subcommand)]
    Pack(cmd::pack::Pack),
    /// Summarise a store file (`--json` for scripts).
    Inspect(cmd::inspect::Args),
    /// Check every record's checksum.
    Verify(cmd::verify::Args),
    /// Measure against the device's own limit.
    #[command(subcommand)]
    Bench(cmd::bench::Bench),
    /// Replay a routing trace against an expert store under a budget.
    Replay(cmd::replay::Args),
    /// Decode with a checkpoint, experts streamed from the store.
    Run(cmd::run::Args),
    /// Serve a model over the OpenAI HTTP API (chat and completions,
    /// streaming, sampling, continuous batching, prompt reuse).
    Serve(cmd::serve::Args),
}

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("FLASHTIER_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    match cli.command {
        Command::Demo(a) => cmd::demo::run(a),
        Command::Pack(p) => cmd::pack::run(p),
        Command::Inspect(a) => cmd::inspect::run(a),
        Command::Verify(a) => cmd::verify::run(a),
        Command::Bench(b) => cmd::bench::run(b),
        Command::Replay(a) => cmd::replay::run(a),
        Command::Run(a) => cmd::run::run(a),
        Command::Serve(a) => cmd::serve::run(a),
    }
}
