//! `flashtier serve`: an engine behind the OpenAI HTTP API.
//!
//! - [`scheduler`]: one thread owns the [`flashtier_engine::engine::Engine`]
//!   and runs continuous batching: sequences join and leave a running
//!   batch, prompt chunks share steps with other sequences' decode tokens,
//!   a bounded queue answers 429 past its limit, a closed connection
//!   cancels its sequence.
//! - [`prefix`]: finished sequences' KV caches kept for prompts that share
//!   their first tokens, in memory and, past its budget, spilled to the KV
//!   tier on a drive ([`prefix::spill`]) and restored checksummed.
//! - [`http`]: the routes (`/v1/chat/completions`, `/v1/completions`,
//!   streamed or not, `/v1/models`, `/health`, `/metrics`), chat templates
//!   and detokenizing through [`flashtier_text`], stop strings, logprobs,
//!   OpenAI-shaped errors ([`error`]).
//! - [`api`]: the request bodies and their checks.
//!
//! Exactness: with temperature 0 a request's tokens are the greedy tokens
//! `flashtier run` decodes from the same prompt ids; on the CPU engine a
//! sequence gets the same bits whatever else is in its batch, so a seeded
//! sampled request repeats too.

pub mod api;
pub mod bench;
pub mod error;
pub mod http;
pub mod metrics;
pub mod prefix;
pub mod scheduler;
pub mod text_out;

pub use http::{HttpConfig, router};
pub use scheduler::{Scheduler, SchedulerConfig};
