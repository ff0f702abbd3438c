//! A VM described declaratively: the body of the host API's `create`
//! (`POST /v1/vms`), and the entries of a configuration file
//! (`ninelives run --config FILE`, `ninelives host --config FILE`), in the
//! spirit of Firecracker's `--config-file`. One type, one set of checks,
//! whichever way a VM is described.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use serde::Deserialize;

use crate::args::{parse_size, MachineArgs, PatternName, WorkloadArgs, WorkloadName};

/// A size given as a number of bytes or a string such as "256M".
#[derive(Clone, Debug, Deserialize, schemars::JsonSchema)]
#[serde(untagged)]
pub enum Size {
    Bytes(u64),
    Text(String),
}

impl Size {
    fn bytes(&self) -> Result<u64, String> {
        match self {
            Size::Bytes(b) => Ok(*b),
            Size::Text(t) => parse_size(t),
        }
    }
}

/// A VM (`POST /v1/vms`, the JSON-lines `create`, or one entry of a
/// configuration file's `vms`); every field is optional. Sizes are bytes
/// or strings such as "256M".
#[derive(Clone, Debug, Default, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(rename = "CreateVm")]
pub struct VmSpec {
    /// The JSON-lines operation ("create"); set by the path over HTTP.
    #[serde(default)]
    #[schemars(skip)]
    pub op: Option<String>,
    /// The reference guest's workload (default memwrite).
    #[serde(default)]
    pub workload: WorkloadName,
    /// Guest memory (default 256M).
    pub mem: Option<Size>,
    /// vCPUs, 1 to 32 (default 1). Checked here (a negative or huge count
    /// gets the range in its error).
    pub vcpus: Option<i64>,
    /// Seconds the workload runs (default: 3600 on a host, 3 for `run`).
    /// For a Linux VM on a host: its time limit, after which the host stops
    /// it and lists it as stopped at its time limit (default: none; counted
    /// from its creation, paused time and host rejuvenations included).
    pub duration: Option<f64>,
    /// Seed of the workload's PRNG.
    pub seed: Option<u64>,
    /// memwrite/filecache: the working set's size.
    pub ws: Option<Size>,
    /// memwrite: percent of accesses that are writes.
    pub write_pct: Option<u64>,
    /// memwrite: access pattern.
    pub pattern: Option<PatternName>,
    /// memwrite strided: stride in bytes.
    pub stride: Option<u64>,
    /// memwrite hotcold / filecache: percent of pages (blocks) that are hot.
    pub hot_pct: Option<u64>,
    /// filecache: the data set's size.
    pub data: Option<Size>,
    /// Guest timer interrupts per second.
    pub timer_hz: Option<u64>,
    /// File the guest's console goes to.
    pub console: Option<PathBuf>,
    /// TAP device for a virtio-net device (created if missing).
    pub net_tap: Option<String>,
    /// The guest's IPv4 address on the TAP.
    pub net_ip: Option<String>,
    /// Bring the host end of the TAP up with this address (e.g. 10.0.0.1/24).
    pub net_host_ip: Option<String>,
    /// Raw disk image for a virtio-blk device.
    pub disk: Option<PathBuf>,
    /// A Linux kernel to boot instead of the reference guest: a bzImage or
    /// vmlinux ELF file (docs/linux-guests.md). The VM has one vCPU; the
    /// workload fields do not apply.
    pub kernel: Option<PathBuf>,
    /// A Linux VM's kernel command line, printable ASCII, at most 2048
    /// bytes (default `console=ttyS0 earlyprintk=serial,ttyS0,115200
    /// reboot=k panic=-1 nokaslr`; on PVM the VMM adds what its emulator
    /// needs).
    pub cmdline: Option<String>,
    /// A Linux VM's initrd (initramfs) file, at most 512 MiB.
    pub initrd: Option<PathBuf>,
    /// The Linux kernel's System.map: a VM that stops is reported with the
    /// guest function it stopped in.
    pub system_map: Option<PathBuf>,
}

/// A VM's arguments as the command line would give them.
pub struct SpecArgs {
    pub workload: WorkloadArgs,
    pub machine: MachineArgs,
    pub duration: f64,
    pub console: Option<PathBuf>,
}

impl VmSpec {
    /// The arguments this spec asks for, every field checked;
    /// `default_duration` where the spec names none.
    pub fn args(&self, default_duration: f64) -> Result<SpecArgs, String> {
        let d = WorkloadArgs::default();
        let workload = WorkloadArgs {
            workload: self.workload,
            seed: self.seed.unwrap_or(d.seed),
            ws: self.ws.as_ref().map(Size::bytes).transpose()?.or(d.ws),
            write_pct: match self.write_pct {
                Some(p) if p > 100 => return Err(format!("write_pct {p} is out of range 0..=100")),
                p => p.unwrap_or(d.write_pct),
            },
            pattern: self.pattern.unwrap_or(d.pattern),
            stride: self.stride.unwrap_or(d.stride),
            hot_pct: match self.hot_pct {
                Some(p) if !(1..=100).contains(&p) => {
                    return Err(format!("hot_pct {p} is out of range 1..=100"))
                }
                p => p.unwrap_or(d.hot_pct),
            },
            data: self.data.as_ref().map(Size::bytes).transpose()?.unwrap_or(d.data),
        };
        let dm = MachineArgs::default();
        let machine = MachineArgs {
            mem: self.mem.as_ref().map(Size::bytes).transpose()?.unwrap_or(dm.mem),
            vcpus: match self.vcpus {
                None => dm.vcpus,
                Some(v) => u32::try_from(v)
                    .ok()
                    .filter(|v| (1..=nl_abi::MAX_VCPUS).contains(v))
                    .ok_or_else(|| {
                        format!(
                            "vcpus {v} is out of range: a VM has 1 to {} vCPUs",
                            nl_abi::MAX_VCPUS
                        )
                    })?,
            },
            timer_hz: self.timer_hz.unwrap_or(dm.timer_hz),
            net_ip: self.net_ip.clone().unwrap_or(dm.net_ip.clone()),
            net_tap: self.net_tap.clone(),
            net_host_ip: self.net_host_ip.clone(),
            disk: self.disk.clone(),
            ..dm
        };
        if self.kernel.is_some() {
            self.check_linux(&machine)?;
        } else {
            let linux_only = [
                ("cmdline", self.cmdline.is_some()),
                ("initrd", self.initrd.is_some()),
                ("system_map", self.system_map.is_some()),
            ];
            if let Some((f, _)) = linux_only.iter().find(|(_, given)| *given) {
                return Err(format!("\"{f}\" is for a Linux VM: give its \"kernel\" too"));
            }
        }
        let duration = self.duration.unwrap_or(default_duration);
        if !(duration.is_finite() && duration > 0.0 && duration <= 7.0 * 86400.0) {
            return Err(format!("duration {duration} is out of range (0 s, one week]"));
        }
        Ok(SpecArgs { workload, machine, duration, console: self.console.clone() })
    }

    /// The checks of a Linux VM's spec that need no file: no more vCPUs
    /// than its MP table describes, no reference-guest workload fields, a
    /// command line Linux accepts.
    fn check_linux(&self, machine: &MachineArgs) -> Result<(), String> {
        if machine.vcpus > nl_arch::mptable::MAX_CPUS {
            return Err(format!(
                "vcpus {}: a Linux VM has at most {} vCPUs (its MP table's limit)",
                machine.vcpus,
                nl_arch::mptable::MAX_CPUS
            ));
        }
        let workload_fields = [
            ("ws", self.ws.is_some()),
            ("write_pct", self.write_pct.is_some()),
            ("pattern", self.pattern.is_some()),
            ("stride", self.stride.is_some()),
            ("hot_pct", self.hot_pct.is_some()),
            ("data", self.data.is_some()),
        ];
        if let Some((f, _)) = workload_fields.iter().find(|(_, given)| *given) {
            return Err(format!(
                "\"{f}\" is a field of the reference guest's workload, not of a Linux VM \
                 (\"kernel\" is given)"
            ));
        }
        let cmdline = self.cmdline.as_deref().unwrap_or(crate::run_linux::DEFAULT_CMDLINE);
        nl_arch::linux::cmdline(cmdline).map_err(|e| e.to_string())?;
        Ok(())
    }

    /// The VM configuration this spec asks for (for a host: its duration
    /// defaults to an hour).
    pub fn vm_config(&self, default_duration: f64) -> Result<nl_vmm::VmConfig, String> {
        Ok(self.vm(default_duration)?.0)
    }

    /// The VM this spec asks for: its configuration and, with a `kernel`,
    /// how its Linux kernel boots. The files are read here: a kernel that
    /// is missing, unreadable or not a Linux image is refused by name.
    pub fn vm(
        &self,
        default_duration: f64,
    ) -> Result<(nl_vmm::VmConfig, Option<nl_vmm::linux::LinuxBoot>), String> {
        let a = self.args(default_duration)?;
        let params =
            crate::guest::workload_params(&a.workload, a.duration).map_err(|e| e.to_string())?;
        let Some(path) = &self.kernel else {
            let kernel = crate::guest::kernel_image(&a.machine).map_err(|e| e.to_string())?;
            let c = crate::guest::vm_config(&a.machine, params, kernel, a.console);
            return Ok((c.map_err(|e| e.to_string())?, None));
        };
        let kernel =
            nl_memory::file::read_limited(path, "kernel image", crate::guest::MAX_KERNEL_BYTES)
                .map_err(|e| format!("kernel {}: {e}", path.display()))?;
        if nl_arch::linux::image_kind(&kernel) == nl_arch::linux::ImageKind::Other {
            return Err(format!(
                "kernel {}: not a Linux bzImage or vmlinux ELF (no setup header, no \
                 \"Linux version\" banner)",
                path.display()
            ));
        }
        let cmdline = self.cmdline.as_deref().unwrap_or(crate::run_linux::DEFAULT_CMDLINE);
        let mut boot = crate::run_linux::linux_boot(
            Some(path),
            cmdline,
            self.initrd.as_deref(),
            self.system_map.as_deref(),
        )
        .map_err(|e| format!("{e:#}"))?;
        // Checked by `args`: finite, in (0 s, one week].
        boot.time_limit = self.duration.map(std::time::Duration::from_secs_f64);
        let c = crate::guest::vm_config(&a.machine, params, std::sync::Arc::new(kernel), a.console)
            .map_err(|e| e.to_string())?;
        Ok((c, Some(boot)))
    }
}

/// The duration of a VM created on a host whose spec names none.
pub const HOST_DEFAULT_DURATION: f64 = 3600.0;

/// The VM configuration a host API `create` request asks for.
pub fn build_config(req: &serde_json::Value) -> Result<nl_vmm::VmConfig, String> {
    Ok(build_vm(req)?.0)
}

/// The VM a host API `create` request asks for ([`VmSpec::vm`]).
pub fn build_vm(
    req: &serde_json::Value,
) -> Result<(nl_vmm::VmConfig, Option<nl_vmm::linux::LinuxBoot>), String> {
    let spec: VmSpec =
        serde_json::from_value(req.clone()).map_err(|e| format!("bad create request: {e}"))?;
    spec.vm(HOST_DEFAULT_DURATION)
}

/// A configuration file: the VMs to run (`ninelives run --config`) or to
/// create when a host starts (`ninelives host --config`).
#[derive(Clone, Debug, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ConfigFile {
    /// The VMs, 1 to 64, each described as in `POST /v1/vms`.
    pub vms: Vec<VmSpec>,
}

/// VMs one configuration file may describe.
pub const MAX_CONFIG_VMS: usize = 64;
/// The largest configuration file read.
pub const MAX_CONFIG_BYTES: u64 = 1 << 20;

impl ConfigFile {
    /// Reads and checks a configuration file (JSON): its syntax with the
    /// line and column of an error, unknown fields by name, the number of
    /// VMs, and every VM's fields (`default_duration` where a VM names no
    /// duration). Each VM's error names its index.
    pub fn load(path: &Path, default_duration: f64) -> Result<Self> {
        let bytes = nl_memory::file::read_limited(path, "configuration file", MAX_CONFIG_BYTES)
            .with_context(|| format!("cannot read the configuration file {}", path.display()))?;
        let c: ConfigFile = serde_json::from_slice(&bytes).with_context(|| {
            format!("{} is not a valid ninelives configuration", path.display())
        })?;
        if c.vms.is_empty() || c.vms.len() > MAX_CONFIG_VMS {
            bail!(
                "{}: \"vms\" holds {} VMs; a configuration describes 1 to {MAX_CONFIG_VMS}",
                path.display(),
                c.vms.len()
            );
        }
        for (i, v) in c.vms.iter().enumerate() {
            if let Some(op) = &v.op {
                bail!("{}: vms[{i}]: unknown field \"op\" (\"{op}\")", path.display());
            }
            v.args(default_duration)
                .map_err(|e| anyhow::anyhow!("{}: vms[{i}]: {e}", path.display()))?;
        }
        Ok(c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(j: &str) -> Result<VmSpec, serde_json::Error> {
        serde_json::from_str(j)
    }

    #[test]
    fn fields_reach_the_arguments() {
        let s = spec(
            r#"{"workload":"compute","mem":"128M","vcpus":2,"duration":1.5,
                        "seed":9,"ws":"8M","write_pct":70,"pattern":"hotcold","hot_pct":20}"#,
        )
        .unwrap();
        let a = s.args(3.0).unwrap();
        assert_eq!(a.workload.workload, WorkloadName::Compute);
        assert_eq!(a.machine.mem, 128 << 20);
        assert_eq!(a.machine.vcpus, 2);
        assert_eq!(a.duration, 1.5);
        assert_eq!(a.workload.seed, 9);
        assert_eq!(a.workload.ws, Some(8 << 20));
        assert_eq!(a.workload.write_pct, 70);
        assert_eq!(a.workload.pattern, PatternName::Hotcold);
        assert_eq!(a.workload.hot_pct, 20);
        assert_eq!(spec("{}").unwrap().args(3.0).unwrap().duration, 3.0);
    }

    #[test]
    fn bad_fields_are_named() {
        let e = spec(r#"{"memory":"1G"}"#).unwrap_err().to_string();
        assert!(e.contains("unknown field `memory`"), "{e}");
        let e = spec(r#"{"vcpus":-1}"#).unwrap().args(3.0).err().unwrap();
        assert!(e.contains("vcpus -1 is out of range"), "{e}");
        let e = spec(r#"{"write_pct":101}"#).unwrap().args(3.0).err().unwrap();
        assert!(e.contains("write_pct 101"), "{e}");
        let e = spec(r#"{"hot_pct":0}"#).unwrap().args(3.0).err().unwrap();
        assert!(e.contains("hot_pct 0"), "{e}");
        let e = spec(r#"{"duration":-2}"#).unwrap().args(3.0).err().unwrap();
        assert!(e.contains("duration -2"), "{e}");
        let e = spec(r#"{"mem":"12X"}"#).unwrap().args(3.0).err().unwrap();
        assert!(e.contains("unknown unit"), "{e}");
    }

    /// A Linux VM's spec is checked before any file is read (at most 32 vCPUs, no
    /// workload fields, Linux fields only with a kernel), and a kernel that
    /// cannot be read or is not a Linux image is refused by its path.
    #[test]
    fn linux_specs_are_checked_by_name() {
        // Several vCPUs pass (an MP table describes them); 33 do not.
        spec(r#"{"kernel":"/k","vcpus":2}"#).unwrap().args(3.0).unwrap();
        let e = spec(r#"{"kernel":"/k","vcpus":33}"#).unwrap().args(3.0).err().unwrap();
        assert!(e.contains("vcpus 33 is out of range"), "{e}");
        let e = spec(r#"{"kernel":"/k","ws":"8M"}"#).unwrap().args(3.0).err().unwrap();
        assert!(e.contains("\"ws\" is a field of the reference guest's workload"), "{e}");
        for f in ["cmdline", "initrd", "system_map"] {
            let e = spec(&format!(r#"{{"{f}":"x"}}"#)).unwrap().args(3.0).err().unwrap();
            assert!(e.contains(&format!("\"{f}\" is for a Linux VM")), "{e}");
        }
        let long = format!(r#"{{"kernel":"/k","cmdline":"{}"}}"#, "x".repeat(4096));
        let e = spec(&long).unwrap().args(3.0).err().unwrap();
        assert!(e.contains("kernel command line"), "{e}");
        spec(r#"{"kernel":"/k","cmdline":"quiet"}"#).unwrap().args(3.0).unwrap();
        let e = spec(r#"{"kernel":"/nonexistent/vmlinuz"}"#).unwrap().vm(3.0).err().unwrap();
        assert!(e.contains("kernel /nonexistent/vmlinuz"), "{e}");
        let k = std::env::temp_dir().join(format!("nl-spec-kernel-{}", std::process::id()));
        std::fs::write(&k, b"hello").unwrap();
        let e = spec(&format!(r#"{{"kernel":"{}"}}"#, k.display())).unwrap().vm(3.0).err();
        let _ = std::fs::remove_file(&k);
        let e = e.unwrap();
        assert!(e.contains("not a Linux bzImage or vmlinux ELF"), "{e}");
    }

    fn load(text: &str) -> Result<ConfigFile> {
        let dir = std::env::temp_dir().join(format!("nl-config-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join(format!(
            "{:x}.json",
            text.len() * 31 + text.bytes().map(usize::from).sum::<usize>()
        ));
        std::fs::write(&p, text).unwrap();
        let r = ConfigFile::load(&p, 3.0);
        let _ = std::fs::remove_file(&p);
        r
    }

    #[test]
    fn files_are_checked_with_a_clear_error() {
        let c = load(r#"{"vms":[{"workload":"compute"},{"mem":"64M"}]}"#).unwrap();
        assert_eq!(c.vms.len(), 2);
        let e = format!("{:#}", load("{\"vms\":[\n{\"workload\":\"compute\",}]}").unwrap_err());
        assert!(e.contains("line 2"), "{e}");
        let e = format!("{:#}", load(r#"{"vm":[]}"#).unwrap_err());
        assert!(e.contains("unknown field `vm`"), "{e}");
        let e = format!("{:#}", load(r#"{"vms":[]}"#).unwrap_err());
        assert!(e.contains("holds 0 VMs"), "{e}");
        let e = format!("{:#}", load(r#"{"vms":[{},{"vcpus":99}]}"#).unwrap_err());
        assert!(e.contains("vms[1]: vcpus 99"), "{e}");
        let e = format!("{:#}", load(r#"{"vms":[{"op":"destroy"}]}"#).unwrap_err());
        assert!(e.contains("vms[0]: unknown field \"op\""), "{e}");
        let many = format!("{{\"vms\":[{}{{}}]}}", "{},".repeat(MAX_CONFIG_VMS));
        let e = format!("{:#}", load(&many).unwrap_err());
        assert!(e.contains("holds 65 VMs"), "{e}");
        let e = format!(
            "{:#}",
            ConfigFile::load(Path::new("/nonexistent/ninelives.json"), 3.0).unwrap_err()
        );
        assert!(
            e.contains("cannot read the configuration file /nonexistent/ninelives.json"),
            "{e}"
        );
    }
}
