//! The VMM's log on stderr (`--log-level`, `--log-format`), through
//! `tracing`. Text is one line per event, `ninelives: [LEVEL: ]message
//! [field=value ...]`, as the VMM always printed; JSON is one object per
//! line with a timestamp, level, target and fields, for log collectors.
//! Machine-read report lines (detections, recoveries: `nl_vmm::detect`)
//! and command results on stdout are not log events and keep their format.

use std::fmt;

use clap::ValueEnum;
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::fmt::format::{FormatEvent, FormatFields, Writer};
use tracing_subscriber::fmt::FmtContext;
use tracing_subscriber::registry::LookupSpan;

/// How log lines are written.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Default)]
pub enum LogFormat {
    /// `ninelives: message`, warnings and errors marked.
    #[default]
    Text,
    /// One JSON object per line (timestamp, level, target, fields).
    Json,
}

/// The least severe events logged.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Default)]
pub enum LogLevel {
    Error,
    Warn,
    #[default]
    Info,
    Debug,
    Trace,
}

impl From<LogLevel> for Level {
    fn from(l: LogLevel) -> Level {
        match l {
            LogLevel::Error => Level::ERROR,
            LogLevel::Warn => Level::WARN,
            LogLevel::Info => Level::INFO,
            LogLevel::Debug => Level::DEBUG,
            LogLevel::Trace => Level::TRACE,
        }
    }
}

/// The options that give a successor process (warm rejuvenation,
/// microreboot) this process's log settings.
pub fn successor_args(level: LogLevel, format: LogFormat) -> Vec<String> {
    let name = |v: Option<clap::builder::PossibleValue>| {
        v.map(|v| v.get_name().to_string()).expect("no skipped log values")
    };
    vec![
        "--log-level".into(),
        name(level.to_possible_value()),
        "--log-format".into(),
        name(format.to_possible_value()),
    ]
}

/// The text format: `ninelives: [warning: ]message field=value`.
struct Text;

impl<S, N> FormatEvent<S, N> for Text
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut w: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        let mark = match *event.metadata().level() {
            Level::ERROR => "error: ",
            Level::WARN => "warning: ",
            Level::DEBUG => "debug: ",
            Level::TRACE => "trace: ",
            _ => "",
        };
        write!(w, "ninelives: {mark}")?;
        ctx.format_fields(w.by_ref(), event)?;
        writeln!(w)
    }
}

/// Installs the process's log subscriber (once, before any thread starts).
pub fn init(level: LogLevel, format: LogFormat) {
    let b =
        tracing_subscriber::fmt().with_max_level(Level::from(level)).with_writer(std::io::stderr);
    // A second init (a library caller's own subscriber) is not an error.
    let _ = match format {
        LogFormat::Text => b.event_format(Text).try_init(),
        LogFormat::Json => b.json().flatten_event(true).with_current_span(false).try_init(),
    };
}
