//! The ninelives command-line front end as a library: the binary
//! (`src/main.rs`) parses the command line and dispatches here, to
//! `nl-launch` (run, checkpoint, restore, replicate) or to `nl-lab` (bench,
//! inject, ping, kvload); fuzz targets (`fuzz/`) reach the same request
//! parsers the commands use.

pub mod cli;
pub mod cmd;
pub mod logging;
pub mod openapi;
