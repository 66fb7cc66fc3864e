//! One module per subcommand.

pub mod bench;
pub mod demo;
pub mod inspect;
pub mod pack;
pub mod replay;
pub mod run;
pub mod serve;
pub mod verify;
