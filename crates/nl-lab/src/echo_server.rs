//! `ninelives echo-server` (hidden): a host UDP echo responder, the baseline
//! `ninelives bench` pings next to the netbench guest.

use std::net::UdpSocket;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args;

#[derive(Args, Clone, Debug)]
pub struct EchoServerArgs {
    /// Address to answer on.
    #[arg(long, default_value = "0.0.0.0:7")]
    pub bind: String,
    /// Seconds to answer for.
    #[arg(long, default_value_t = 10.0)]
    pub duration: f64,
}

pub fn run(a: EchoServerArgs) -> Result<ExitCode> {
    if !(a.duration.is_finite() && a.duration > 0.0 && a.duration <= 86_400.0) {
        bail!("--duration {} must be between 0 and 86400 seconds", a.duration);
    }
    let sock = UdpSocket::bind(&a.bind).with_context(|| format!("cannot bind {}", a.bind))?;
    sock.set_read_timeout(Some(Duration::from_millis(100)))?;
    let end = Instant::now() + Duration::from_secs_f64(a.duration);
    let mut buf = [0u8; 2048];
    let mut answered = 0u64;
    while Instant::now() < end {
        if let Ok((n, from)) = sock.recv_from(&mut buf) {
            if sock.send_to(&buf[..n], from).is_ok() {
                answered += 1;
            }
        }
    }
    println!("echo-server: answered {answered} packets");
    Ok(ExitCode::SUCCESS)
}
