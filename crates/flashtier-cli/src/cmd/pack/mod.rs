//! `flashtier pack`: build store files from checkpoints.

pub mod experts;
mod ple;
pub mod rows;

/// What to pack.
#[derive(clap::Subcommand, Debug)]
pub enum Pack {
    /// Pack the MoE expert tensors of an HF checkpoint into an expert store.
    Experts(experts::Args),
    /// Pack an Engram / embedding table into a row shard (--ple: every
    /// Qwen4-Exp PLE table shard, as `run --rows-budget` opens them).
    Rows(rows::Args),
}

/// Run `flashtier pack`.
pub fn run(p: Pack) -> anyhow::Result<()> {
    match p {
        Pack::Experts(a) => experts::run(a),
        Pack::Rows(a) => rows::run(a),
    }
}
