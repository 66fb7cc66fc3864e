//! `flashtier demo`: the main job on a built-in synthetic model.

/// Options of `flashtier demo`.
#[derive(clap::Args, Debug)]
pub struct Args {}

/// Run the demo.
pub fn run(_args: Args) -> anyhow::Result<()> {
    anyhow::bail!("the demo lands with the foundation issue")
}
