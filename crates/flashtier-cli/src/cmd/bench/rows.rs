//! `flashtier bench rows`.

/// Options of `flashtier bench rows`.
#[derive(clap::Args, Debug)]
pub struct Args {}

/// Run `flashtier bench rows`.
pub fn run(_args: Args) -> anyhow::Result<()> {
    anyhow::bail!("flashtier bench rows is not built yet")
}
