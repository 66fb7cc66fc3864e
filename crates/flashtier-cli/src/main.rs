//! The `flashtier` command.

use clap::{Parser, Subcommand};

mod cmd;

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
    }
}
