//! `flashtier bench gpu`.

/// Options of `flashtier bench gpu`.
#[derive(clap::Args, Debug)]
pub struct Args {}

/// Run `flashtier bench gpu`.
pub fn run(_args: Args) -> anyhow::Result<()> {
    anyhow::bail!("flashtier bench gpu is not built yet")
}
