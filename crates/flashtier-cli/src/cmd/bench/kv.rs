//! `flashtier bench kv`.

/// Options of `flashtier bench kv`.
#[derive(clap::Args, Debug)]
pub struct Args {}

/// Run `flashtier bench kv`.
pub fn run(_args: Args) -> anyhow::Result<()> {
    anyhow::bail!("flashtier bench kv is not built yet")
}
