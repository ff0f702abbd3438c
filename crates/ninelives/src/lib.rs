//! The ninelives command-line front end as a library: the binary
//! (`src/main.rs`) parses the command line and dispatches here; fuzz targets
//! (`fuzz/`) reach the same request parsers the commands use.

pub mod cli;
pub mod cmd;
pub mod figures;
pub mod guest;
pub mod injector;
pub mod netns;
pub mod openapi;
pub mod verify;
