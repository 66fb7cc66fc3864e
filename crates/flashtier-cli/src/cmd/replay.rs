//! `flashtier replay`.

/// Options of `flashtier replay`.
#[derive(clap::Args, Debug)]
pub struct Args {}

/// Run `flashtier replay`.
pub fn run(_args: Args) -> anyhow::Result<()> {
    anyhow::bail!("flashtier replay is not built yet")
}
