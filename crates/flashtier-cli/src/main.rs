//! The `flashtier` command.

use clap::{Parser, Subcommand};

mod cmd;
mod kit;

/// flashtier: run language models bigger than memory by streaming their bulky
/// inference state (MoE experts, embedding rows, KV blocks) from NVMe.
#[derive(Parser, Debug)]
#[command(
    name = "flashtier",
    version,
    about,
    long_about = None,
    after_help = "Environment variables that steer the libraries: see --help, or docs/configuration.md.",
    after_long_help = kit::settings::environment_help()
)]
struct Cli {
    /// Which logs go to stderr: a `tracing` filter (`info`,
    /// `flashtier_io=debug,warn`, ...).
    #[arg(
        long,
        global = true,
        value_name = "FILTER",
        env = "FLASHTIER_LOG",
        default_value = "warn"
    )]
    log: String,
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
    let cli = Cli::parse();
    let filter = tracing_subscriber::EnvFilter::try_new(&cli.log).map_err(|e| {
        anyhow::anyhow!("--log / FLASHTIER_LOG={:?}: not a log filter: {e}", cli.log)
    })?;
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
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

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    use super::Cli;

    #[test]
    fn help_documents_every_variable() {
        Cli::command().debug_assert();
        let help = Cli::command().render_long_help().to_string();
        for (_, table) in crate::kit::settings::tables() {
            for s in table {
                assert!(help.contains(s.name), "{} is not in --help", s.name);
            }
        }
        let serve = Cli::command()
            .find_subcommand_mut("serve")
            .map(|c| c.render_long_help().to_string())
            .unwrap_or_default();
        assert!(serve.contains("FLASHTIER_API_KEY"), "{serve}");
    }
}
