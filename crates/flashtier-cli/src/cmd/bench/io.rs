//! `flashtier bench io`.

/// Options of `flashtier bench io`.
#[derive(clap::Args, Debug)]
pub struct Args {}

/// Run `flashtier bench io`.
pub fn run(_args: Args) -> anyhow::Result<()> {
    anyhow::bail!("flashtier bench io is not built yet")
}
