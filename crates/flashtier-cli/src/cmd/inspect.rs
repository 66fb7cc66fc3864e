//! `flashtier inspect`.

/// Options of `flashtier inspect`.
#[derive(clap::Args, Debug)]
pub struct Args {}

/// Run `flashtier inspect`.
pub fn run(_args: Args) -> anyhow::Result<()> {
    anyhow::bail!("flashtier inspect is not built yet")
}
