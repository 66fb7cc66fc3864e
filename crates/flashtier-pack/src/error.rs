//! The errors of what this crate runs end to end ([`crate::demo`]); the
//! packer returns the engine's `PackError`, the synthesizer its
//! [`SynthError`](crate::synth::SynthError).

use flashtier_engine::EngineError;

/// A demo that could not run: the model it wrote, packed or decoded.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DemoError {
    /// Opening, packing or decoding the model failed.
    #[error(transparent)]
    Engine(#[from] EngineError),
    /// Opening the model for a decode failed.
    #[error(transparent)]
    Session(#[from] crate::session::SessionError),
    /// Writing the synthetic checkpoint failed.
    #[error(transparent)]
    Synth(#[from] crate::synth::SynthError),
}

impl From<flashtier_engine::store::PackError> for DemoError {
    fn from(e: flashtier_engine::store::PackError) -> Self {
        Self::Engine(e.into())
    }
}

impl From<flashtier::experts::ExpertsError> for DemoError {
    fn from(e: flashtier::experts::ExpertsError) -> Self {
        Self::Engine(e.into())
    }
}

impl From<flashtier_io::IoError> for DemoError {
    fn from(e: flashtier_io::IoError) -> Self {
        Self::Engine(e.into())
    }
}
