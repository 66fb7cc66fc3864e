//! `flashtier bench pack`.

/// Options of `flashtier bench pack`.
#[derive(clap::Args, Debug)]
pub struct Args {}

/// Run `flashtier bench pack`.
pub fn run(_args: Args) -> anyhow::Result<()> {
    anyhow::bail!("flashtier bench pack is not built yet")
}
