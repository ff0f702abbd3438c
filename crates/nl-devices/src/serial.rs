//! The serial console: a vm-superio 16550 UART whose output goes to a
//! [`Console`] sink (an optional file plus an in-memory tail for reports).

use std::collections::VecDeque;
use std::fs::File;
use std::io::{self, Write};
use std::sync::Arc;

use nl_sync::Lock;

use serde::{Deserialize, Serialize};
use vm_superio::serial::{NoEvents, SerialState};
use vm_superio::{Serial, Trigger};
use vmm_sys_util::eventfd::EventFd;

use crate::bus::{BusError, Device};

const TAIL_BYTES: usize = 64 * 1024;

struct ConsoleInner {
    file: Option<File>,
    tail: VecDeque<u8>,
    /// Bytes written since the console was created.
    written: u64,
}

/// Where a VM's console output goes. Cloning shares the sink.
#[derive(Clone)]
pub struct Console(Arc<Lock<ConsoleInner>>);

impl Console {
    /// Keeps only the last 64 KiB in memory.
    pub fn buffer() -> Self {
        Self(Lock::new("console", ConsoleInner { file: None, tail: VecDeque::new(), written: 0 }))
    }

    /// Also appends everything to `file`.
    pub fn to_file(file: File) -> Self {
        Self(Lock::new(
            "console",
            ConsoleInner { file: Some(file), tail: VecDeque::new(), written: 0 },
        ))
    }

    pub fn write_bytes(&self, b: &[u8]) {
        let mut c = self.0.lock();
        if let Some(f) = c.file.as_mut() {
            // Console output is best effort: a full disk must not stop the guest.
            let _ = f.write_all(b);
        }
        c.tail.extend(b);
        c.written += b.len() as u64;
        let excess = c.tail.len().saturating_sub(TAIL_BYTES);
        c.tail.drain(..excess);
    }

    /// Bytes written so far: a mark to undo a partial write back to.
    pub fn mark(&self) -> u64 {
        self.0.lock().written
    }

    /// Undoes everything written after `mark` (the undo log of a device
    /// access that was abandoned and is about to be re-executed). Returns
    /// the bytes removed.
    pub fn undo_to(&self, mark: u64) -> u64 {
        let mut c = self.0.lock();
        let extra = c.written.saturating_sub(mark);
        if extra == 0 {
            return 0;
        }
        let keep = c.tail.len().saturating_sub(extra as usize);
        c.tail.truncate(keep);
        if let Some(f) = c.file.as_mut() {
            if let Ok(len) = f.metadata().map(|m| m.len()) {
                let _ = f.set_len(len.saturating_sub(extra));
                let _ = std::io::Seek::seek(f, std::io::SeekFrom::End(0));
            }
        }
        c.written = mark;
        extra
    }

    /// The last bytes written, lossily decoded.
    pub fn tail(&self) -> String {
        let c = self.0.lock();
        let (a, b) = c.tail.as_slices();
        let mut v = a.to_vec();
        v.extend_from_slice(b);
        String::from_utf8_lossy(&v).into_owned()
    }
}

impl Write for Console {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.write_bytes(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Interrupt trigger of the UART. The reference guest polls the UART, so its
/// line is an eventfd nobody listens to; a Linux guest's is an irqfd on the
/// in-kernel irqchip (GSI 4, see [`SerialDevice::with_irq`]).
pub struct IrqLine(EventFd);

impl Trigger for IrqLine {
    type E = io::Error;
    fn trigger(&self) -> io::Result<()> {
        self.0.write(1)
    }
}

/// Serializable mirror of vm-superio's `SerialState`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct SerialRegs {
    baud_divisor_low: u8,
    baud_divisor_high: u8,
    interrupt_enable: u8,
    interrupt_identification: u8,
    line_control: u8,
    line_status: u8,
    modem_control: u8,
    modem_status: u8,
    scratch: u8,
    in_buffer: Vec<u8>,
}

impl From<SerialState> for SerialRegs {
    fn from(s: SerialState) -> Self {
        Self {
            baud_divisor_low: s.baud_divisor_low,
            baud_divisor_high: s.baud_divisor_high,
            interrupt_enable: s.interrupt_enable,
            interrupt_identification: s.interrupt_identification,
            line_control: s.line_control,
            line_status: s.line_status,
            modem_control: s.modem_control,
            modem_status: s.modem_status,
            scratch: s.scratch,
            in_buffer: s.in_buffer,
        }
    }
}

impl From<SerialRegs> for SerialState {
    fn from(s: SerialRegs) -> Self {
        Self {
            baud_divisor_low: s.baud_divisor_low,
            baud_divisor_high: s.baud_divisor_high,
            interrupt_enable: s.interrupt_enable,
            interrupt_identification: s.interrupt_identification,
            line_control: s.line_control,
            line_status: s.line_status,
            modem_control: s.modem_control,
            modem_status: s.modem_status,
            scratch: s.scratch,
            in_buffer: s.in_buffer,
        }
    }
}

/// The 16550 UART on the port bus.
pub struct SerialDevice {
    uart: Serial<IrqLine, NoEvents, Console>,
    /// The interrupt line, kept across a restore.
    irq: EventFd,
}

impl SerialDevice {
    pub fn new(console: Console) -> io::Result<Self> {
        Self::with_irq(console, EventFd::new(libc_nonblock())?)
    }

    /// A UART whose interrupt signals `irq` (an irqfd registered with KVM).
    pub fn with_irq(console: Console, irq: EventFd) -> io::Result<Self> {
        Ok(Self { uart: Serial::new(IrqLine(irq.try_clone()?), console), irq })
    }
}

fn libc_nonblock() -> i32 {
    vmm_sys_util::eventfd::EFD_NONBLOCK
}

impl Device for SerialDevice {
    fn name(&self) -> &str {
        "serial"
    }
    fn read(&mut self, _cpu: usize, offset: u64, data: &mut [u8]) {
        let v = self.uart.read(offset as u8);
        data.fill(0);
        if let Some(d) = data.first_mut() {
            *d = v;
        }
    }
    fn write(&mut self, _cpu: usize, offset: u64, data: &[u8]) {
        if let Some(&b) = data.first() {
            // An error here means the interrupt eventfd is full: harmless.
            let _ = self.uart.write(offset as u8, b);
        }
    }
    fn save(&self) -> serde_json::Value {
        serde_json::to_value(SerialRegs::from(self.uart.state())).expect("plain struct")
    }
    fn restore(&mut self, state: &serde_json::Value) -> Result<(), BusError> {
        let regs: SerialRegs = serde_json::from_value(state.clone())
            .map_err(|e| BusError::BadState { name: "serial".into(), why: e.to_string() })?;
        let console = self.uart.writer().clone();
        let irq = IrqLine(
            self.irq
                .try_clone()
                .map_err(|e| BusError::BadState { name: "serial".into(), why: e.to_string() })?,
        );
        self.uart = Serial::from_state(&regs.into(), irq, NoEvents, console)
            .map_err(|e| BusError::BadState { name: "serial".into(), why: format!("{e:?}") })?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uart_output_reaches_the_console_and_state_round_trips() {
        let console = Console::buffer();
        let mut s = SerialDevice::new(console.clone()).unwrap();
        for b in b"hi\n" {
            s.write(0, 0, &[*b]);
        }
        assert_eq!(console.tail(), "hi\n");
        s.write(0, 7, &[0x42]); // scratch register
        let saved = s.save();
        s.write(0, 7, &[0]);
        s.restore(&saved).unwrap();
        let mut d = [0u8];
        s.read(0, 7, &mut d);
        assert_eq!(d[0], 0x42);
        assert!(s.restore(&serde_json::json!({"x": 1})).is_err());
    }
}
