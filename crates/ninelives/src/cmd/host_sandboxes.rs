//! Sandbox sets on a running host: the host API's `/v1/sandboxes`
//! resources (`sandbox_create`, `sandbox_list`, `sandbox_stats`,
//! `sandbox_destroy` in JSON lines). A set is what `ninelives sandbox
//! --config` runs (docs/sandboxes.md), held beside the host's ordinary VMs:
//! its guest memory counts against the host's memory budget, each set is
//! supervised on a thread of its own. A warm rejuvenation or a microreboot
//! carries every set to the new process ([`nl_vmm::carry`], through
//! [`nl_sandbox::handover`]): its sandboxes' memory and channels stay in
//! their memfds, their vCPU and device state moves, and the supervision
//! goes on with the time limit that remained; a set's shared links (their
//! TAPs and packet sockets) and its services' state regions go with it,
//! and so do `rollback` sandboxes (their output released at the pause, a
//! fresh checkpoint ring in the new process: see nl_sandbox::handover).
//! A host refuses to rejuvenate only with a set that cannot be carried now
//! (a takeover half done, a rollback whose error may still come back, or
//! a sandbox that ended while others run).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use nl_sandbox::handover::CarriedSandboxes;
use nl_sandbox::{SandboxSet, SetConfig, SetReport};
use nl_sync::Lock;
use nl_vmm::api::{ApiError, Frontend};
use nl_vmm::carry::{Carrier, InheritedSet, SetRecord};
use nl_vmm::host::Host;
use nl_vmm::linux::LinuxBoot;
use nl_vmm::VmConfig;
use serde_json::{json, Value};

/// Sets one host holds at most.
pub const MAX_SETS: usize = 16;
/// A set's default time limit (s).
const DEFAULT_TIMEOUT: f64 = 3600.0;

struct RunningSet {
    set: Arc<SandboxSet>,
    mem_bytes: u64,
    started: Instant,
    /// The set's time limit (s), from its creation.
    timeout_s: f64,
    /// VMM processes it was carried to (rejuvenations, microreboots).
    handovers: u64,
    /// The supervisor's report once every sandbox has ended.
    report: Arc<Lock<Option<SetReport>>>,
    supervisor: Option<std::thread::JoinHandle<()>>,
}

/// The `ninelives host` front end: VM configurations from `create`
/// requests, and sandbox sets. Its locks are `nl_sync` locks, so a
/// microreset that discards an API thread holding one releases it.
pub struct HostFrontend {
    sets: Arc<Lock<BTreeMap<String, RunningSet>>>,
    /// Sets that had ended before a handover: their last `stats`.
    ended: Arc<Lock<BTreeMap<String, Value>>>,
    /// Sets paused for a handover in progress.
    suspended: Arc<Lock<Vec<String>>>,
    /// Sets a new process rebuilt, waiting to start.
    adopted: Arc<Lock<Vec<(String, RunningSet)>>>,
}

impl HostFrontend {
    /// The host's front end, registered as the carrier of its sets across
    /// handovers (once per process).
    pub fn shared() -> Arc<Self> {
        let f = Arc::new(Self {
            sets: Lock::new("host.sandbox_sets", BTreeMap::new()),
            ended: Lock::new("host.sandbox_ended", BTreeMap::new()),
            suspended: Lock::new("host.sandbox_suspended", Vec::new()),
            adopted: Lock::new("host.sandbox_adopted", Vec::new()),
        });
        nl_vmm::carry::register(f.clone());
        f
    }
}

fn not_found(name: &str) -> ApiError {
    ApiError { status: 404, message: format!("no such sandbox set '{name}'") }
}

fn name_of(req: &Value) -> Result<String, ApiError> {
    let name = req.get("name").and_then(Value::as_str).ok_or_else(|| {
        ApiError::bad("a sandbox set needs a \"name\": 1 to 64 of letters, digits, '-' and '_'")
    })?;
    if name.is_empty()
        || name.len() > 64
        || !name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    {
        return Err(ApiError::bad(format!(
            "sandbox set name '{name}' must be 1 to 64 of letters, digits, '-' and '_'"
        )));
    }
    Ok(name.to_string())
}

impl HostFrontend {
    fn create(&self, host: &Host, req: &Value) -> Result<Value, ApiError> {
        let name = name_of(req)?;
        let set = req.get("set").ok_or_else(|| {
            ApiError::bad("a sandbox set needs a \"set\": its configuration (docs/sandboxes.md)")
        })?;
        let config =
            SetConfig::parse(&set.to_string()).map_err(|e| ApiError::bad(e.to_string()))?;
        let timeout = match req.get("timeout_secs") {
            None | Some(Value::Null) => DEFAULT_TIMEOUT,
            Some(v) => {
                v.as_f64().filter(|t| t.is_finite() && *t > 0.0 && *t <= 604_800.0).ok_or_else(
                    || ApiError::bad("\"timeout_secs\" must be a number of seconds in (0, 604800]"),
                )?
            }
        };
        let mem_bytes = config
            .sandboxes
            .iter()
            .map(|s| s.mem_mib.saturating_mul(1 << 20))
            .fold(0u64, u64::saturating_add);
        // Held for the whole creation: two creates cannot both pass the
        // budget, nor take one name.
        let mut sets = self.sets.lock();
        if sets.contains_key(&name) || self.ended.lock().contains_key(&name) {
            return Err(ApiError {
                status: 409,
                message: format!("a sandbox set named '{name}' exists"),
            });
        }
        if sets.len() >= MAX_SETS {
            return Err(ApiError {
                status: 409,
                message: format!("this host holds {MAX_SETS} sandbox sets, its most"),
            });
        }
        let held: u64 = sets.values().map(|s| s.mem_bytes).sum();
        let budget = host.limits().mem_budget;
        let committed = host.committed().0 + held;
        if committed.saturating_add(mem_bytes) > budget {
            return Err(ApiError {
                status: 409,
                message: format!(
                    "sandbox set '{name}' needs {} MiB of guest memory; {} MiB of the host's \
                     {} MiB budget are committed",
                    mem_bytes >> 20,
                    committed >> 20,
                    budget >> 20
                ),
            });
        }
        let set = SandboxSet::create(host.kvm(), config, &super::sandbox::images())
            .map_err(|e| ApiError::bad(format!("sandbox set '{name}': {e}")))?;
        let set = Arc::new(set);
        if let Err(e) = set.start_all() {
            set.stop_all();
            return Err(ApiError::bad(format!("sandbox set '{name}': {e}")));
        }
        let names: Vec<String> = set.sandboxes.iter().map(|s| s.config.name.clone()).collect();
        let mut r = RunningSet {
            set,
            mem_bytes,
            started: Instant::now(),
            timeout_s: timeout,
            handovers: 0,
            report: Lock::new("host.sandbox_report", None),
            supervisor: None,
        };
        Self::supervise(&name, &mut r).map_err(|e| {
            r.set.stop_all();
            ApiError { status: 500, message: e }
        })?;
        nl_vmm::event_log::publish(
            "sandbox_set_created",
            json!({"name": name, "sandboxes": names, "mem_bytes": mem_bytes}),
        );
        sets.insert(name.clone(), r);
        Ok(json!({"name": name, "sandboxes": names}))
    }

    /// Starts the set's supervisor thread for the rest of its time limit.
    fn supervise(name: &str, r: &mut RunningSet) -> Result<(), String> {
        let left = (r.timeout_s - r.started.elapsed().as_secs_f64()).max(0.001);
        let (s, report, name) = (r.set.clone(), r.report.clone(), name.to_string());
        let t = std::thread::Builder::new()
            .name(format!("sbx-{}", &name[..name.len().min(10)]))
            .spawn(move || {
                let r = s.supervise(Duration::from_secs_f64(left));
                nl_vmm::event_log::publish(
                    "sandbox_set_ended",
                    json!({"name": name, "all_ok": r.all_ok()}),
                );
                *report.lock() = Some(r);
            })
            .map_err(|e| format!("cannot start the set's supervisor: {e}"))?;
        r.supervisor = Some(t);
        Ok(())
    }

    fn summary(name: &str, r: &RunningSet) -> Value {
        let done = r.report.lock().is_some();
        json!({
            "name": name,
            "state": if done { "ended" } else { "running" },
            "sandboxes": r.set.sandboxes.iter().map(|s| s.config.name.clone()).collect::<Vec<_>>(),
            "channels": r.set.channels.len(),
            "mem_bytes": r.mem_bytes,
            "uptime_s": r.started.elapsed().as_secs_f64(),
            "handovers": r.handovers,
        })
    }

    fn stats(&self, name: &str) -> Result<Value, ApiError> {
        let sets = self.sets.lock();
        let Some(r) = sets.get(name) else {
            return self.ended.lock().get(name).cloned().ok_or_else(|| not_found(name));
        };
        Ok(Self::stats_of(name, r))
    }

    fn stats_of(name: &str, r: &RunningSet) -> Value {
        let mut v = Self::summary(name, r);
        if let Some(report) = r.report.lock().as_ref() {
            v["report"] = serde_json::to_value(report).unwrap_or(Value::Null);
            return v;
        }
        v["sandbox_stats"] = r
            .set
            .sandboxes
            .iter()
            .map(|s| {
                let outcome = s.vm().poll_outcome();
                json!({
                    "name": s.config.name,
                    "state": if outcome.is_some() { "ended" } else { "running" },
                    "outcome": outcome.map(|o| o.message()),
                    "cores": s.config.cores,
                    "violations": s.monitor.violations(),
                    "violation_log": s.monitor.violation_log(),
                    "beats": s.vm().control().vcpus.iter().map(|c| c.snapshot().beats).sum::<u64>(),
                    // Its budget's counters (`io`: budget.io's cgroup).
                    "throttling": r.set.throttling(s.index),
                    // Its current VM's virtio-net counters (with a device).
                    "net": s.vm().net_stats().map(|n| n.0),
                    // Recoveries its monitor recorded (a rollback sandbox's
                    // when a supervised run ends), and a rollback sandbox's
                    // rollbacks as they happen, over every process it ran in.
                    "recoveries": s.monitor.recovery_count(),
                    "rollbacks": s.rollbacks(),
                })
            })
            .collect();
        v["channel_stats"] = serde_json::to_value(r.set.channel_stats()).unwrap_or(Value::Null);
        let links: Vec<_> = r.set.links.iter().map(|l| l.report()).collect();
        v["link_stats"] = serde_json::to_value(links).unwrap_or(Value::Null);
        let names: Vec<String> = r.set.sandboxes.iter().map(|s| s.config.name.clone()).collect();
        v["services"] = serde_json::to_value(r.set.services.report(&names)).unwrap_or(Value::Null);
        v
    }

    /// Injects a register fault (`{"kind": "register", "cpu", "reg", "bit"}`)
    /// or a spin (`{"kind": "spin", "cpu"}`) into one sandbox of a running
    /// set, as the sandbox tests do in process: for exercising recovery and
    /// takeovers on a host.
    fn inject(&self, name: &str, req: &Value) -> Result<Value, ApiError> {
        use nl_checkpoint::inject::{GuestFault, REGISTERS};
        let sandbox = req.get("sandbox").and_then(Value::as_str).ok_or_else(|| {
            ApiError::bad("sandbox_inject needs \"sandbox\": the name of one sandbox of the set")
        })?;
        let f = req.get("fault").cloned().unwrap_or(Value::Null);
        let num = |k: &str, max: u64| {
            f.get(k)
                .and_then(Value::as_u64)
                .filter(|&v| v < max)
                .ok_or_else(|| ApiError::bad(format!("fault.{k} must be an integer below {max}")))
        };
        let fault =
            match f.get("kind").and_then(Value::as_str) {
                Some("register") => {
                    let reg = f.get("reg").and_then(Value::as_str).unwrap_or("");
                    let reg = REGISTERS.iter().find(|r| **r == reg).ok_or_else(|| {
                        ApiError::bad(format!("fault.reg '{reg}' is not one of {REGISTERS:?}"))
                    })?;
                    GuestFault::Register {
                        cpu: num("cpu", 64)? as usize,
                        reg,
                        bit: num("bit", 64)? as u32,
                    }
                }
                Some("spin") => GuestFault::Spin { cpu: num("cpu", 64)? as usize },
                Some("exit") => GuestFault::Exit { cpu: num("cpu", 64)? as usize },
                _ => return Err(ApiError::bad(
                    "fault.kind must be \"register\" (cpu, reg, bit), \"spin\" (cpu) or \"exit\" \
                     (cpu)",
                )),
            };
        let set = {
            let sets = self.sets.lock();
            let r = sets.get(name).ok_or_else(|| not_found(name))?;
            if r.report.lock().is_some() {
                return Err(ApiError {
                    status: 409,
                    message: format!("sandbox set '{name}' has ended"),
                });
            }
            r.set.clone()
        };
        let at = set.inject(sandbox, &fault).map_err(|e| ApiError::bad(e.to_string()))?;
        nl_vmm::event_log::publish(
            "sandbox_fault_injected",
            json!({"name": name, "sandbox": sandbox, "fault": fault}),
        );
        Ok(json!({"name": name, "sandbox": sandbox, "fault": fault, "at": at}))
    }

    fn destroy(&self, name: &str) -> Result<Value, ApiError> {
        let r = self.sets.lock().remove(name);
        match r {
            Some(r) => Self::end(r),
            None => {
                self.ended.lock().remove(name).ok_or_else(|| not_found(name))?;
            }
        }
        nl_vmm::event_log::publish("sandbox_set_destroyed", json!({"name": name}));
        Ok(json!({}))
    }

    fn end(mut r: RunningSet) {
        r.set.stop_all();
        if let Some(t) = r.supervisor.take() {
            let _ = t.join();
        }
    }
}

impl Frontend for HostFrontend {
    fn build_config(&self, req: &Value) -> Result<VmConfig, String> {
        nl_launch::vm_spec::build_config(req)
    }

    fn build_vm(&self, req: &Value) -> Result<(VmConfig, Option<LinuxBoot>), String> {
        nl_launch::vm_spec::build_vm(req)
    }

    fn op(&self, host: &Host, op: &str, req: &Value) -> Option<Result<Value, ApiError>> {
        Some(match op {
            "sandbox_create" => self.create(host, req),
            "sandbox_list" => {
                let sets = self.sets.lock();
                let mut list: Vec<Value> = sets.iter().map(|(n, r)| Self::summary(n, r)).collect();
                for v in self.ended.lock().values() {
                    let mut v = v.clone();
                    if let Some(o) = v.as_object_mut() {
                        o.retain(|k, _| !matches!(k.as_str(), "report"));
                    }
                    list.push(v);
                }
                Ok(json!({ "sets": list }))
            }
            "sandbox_stats" => name_of(req).and_then(|n| self.stats(&n)),
            "sandbox_destroy" => name_of(req).and_then(|n| self.destroy(&n)),
            "sandbox_inject" => name_of(req).and_then(|n| self.inject(&n, req)),
            _ => return None,
        })
    }

    fn op_names(&self) -> &'static str {
        ", sandbox_create, sandbox_list, sandbox_stats, sandbox_destroy, sandbox_inject"
    }

    fn handover_blocker(&self) -> Option<String> {
        let sets = self.sets.lock();
        sets.iter().filter(|(_, r)| r.report.lock().is_none()).find_map(|(name, r)| {
            r.set.carry_blocker().map(|why| {
                format!(
                    "sandbox set '{name}' cannot move to a new VMM process: {why}; wait for it \
                     to end or delete it (DELETE /v1/sandboxes/{name})"
                )
            })
        })
    }

    fn shutdown(&self) {
        let sets = std::mem::take(&mut *self.sets.lock());
        for (_, r) in sets {
            Self::end(r);
        }
    }
}

fn field(v: &Value, k: &str) -> Result<f64, String> {
    v.get(k)
        .and_then(Value::as_f64)
        .filter(|x| x.is_finite() && *x >= 0.0)
        .ok_or_else(|| format!("its record has no valid \"{k}\""))
}

impl Carrier for HostFrontend {
    fn holds(&self) -> bool {
        !self.sets.lock().is_empty() || !self.ended.lock().is_empty()
    }

    fn suspend(&self, strict: bool) -> Result<Vec<SetRecord>, String> {
        let sets = self.sets.lock();
        let mut out = Vec::new();
        let mut paused: Vec<String> = Vec::new();
        for (name, r) in sets.iter() {
            if r.report.lock().is_some() {
                // Ended: its results move, nothing runs.
                out.push(SetRecord::new(name, json!({ "ended": Self::stats_of(name, r) })));
                continue;
            }
            let extra = json!({
                "timeout_s": r.timeout_s,
                "uptime_s": r.started.elapsed().as_secs_f64(),
                "mem_bytes": r.mem_bytes,
                "handovers": r.handovers + 1,
            });
            match r.set.suspend_for_handover(name, extra) {
                Ok(rec) => {
                    paused.push(name.clone());
                    out.push(rec);
                }
                Err(e) if strict => {
                    for n in &paused {
                        sets[n].set.resume_after_handover();
                    }
                    return Err(format!("sandbox set '{name}': {e}"));
                }
                Err(e) => {
                    let m = format!("sandbox set '{name}' is left behind: {e}");
                    tracing::error!("{m}");
                    nl_vmm::event_log::publish("sandbox_set_refused", json!({"error": m}));
                }
            }
        }
        for (name, v) in self.ended.lock().iter() {
            out.push(SetRecord::new(name, json!({ "ended": v })));
        }
        *self.suspended.lock() = paused;
        Ok(out)
    }

    fn resume(&self) {
        let names = std::mem::take(&mut *self.suspended.lock());
        let sets = self.sets.lock();
        for n in names {
            if let Some(r) = sets.get(&n) {
                r.set.resume_after_handover();
            }
        }
    }

    fn adopt(&self, _kvm: &nl_sandbox::Kvm, set: InheritedSet) -> Result<(), String> {
        let name = set.record.name.clone();
        let taken = self.sets.lock().contains_key(&name)
            || self.ended.lock().contains_key(&name)
            || self.adopted.lock().iter().any(|(n, _)| *n == name);
        if taken {
            return Err("a set of that name was carried already".into());
        }
        let config = set.record.config.clone();
        if let Some(ended) = config.get("ended") {
            if !set.record.vms.is_empty() {
                return Err("an ended set's record lists VMs".into());
            }
            self.ended.lock().insert(name, ended.clone());
            return Ok(());
        }
        let carried: CarriedSandboxes = serde_json::from_value(config["sandboxes"].clone())
            .map_err(|e| format!("its sandbox configuration is corrupt ({e})"))?;
        let fe = &config["frontend"];
        let (timeout_s, uptime_s) = (field(fe, "timeout_s")?, field(fe, "uptime_s")?);
        let (mem_bytes, handovers) =
            (field(fe, "mem_bytes")? as u64, field(fe, "handovers")? as u64);
        let set = SandboxSet::from_handover(set, carried, &super::sandbox::images())
            .map_err(|e| e.to_string())?;
        let started = Instant::now()
            .checked_sub(Duration::from_secs_f64(uptime_s))
            .unwrap_or_else(Instant::now);
        let r = RunningSet {
            set: Arc::new(set),
            mem_bytes,
            started,
            timeout_s,
            handovers,
            report: Lock::new("host.sandbox_report", None),
            supervisor: None,
        };
        self.adopted.lock().push((name, r));
        Ok(())
    }

    fn start(&self) -> Vec<String> {
        let adopted = std::mem::take(&mut *self.adopted.lock());
        let mut errors = Vec::new();
        for (name, mut r) in adopted {
            let started = r.set.start_carried().map_err(|e| e.to_string());
            match started.and_then(|()| Self::supervise(&name, &mut r)) {
                Ok(()) => {
                    nl_vmm::event_log::publish(
                        "sandbox_set_carried",
                        json!({"name": name, "handovers": r.handovers}),
                    );
                    self.sets.lock().insert(name, r);
                }
                Err(e) => {
                    r.set.stop_all();
                    errors
                        .push(format!("sandbox set '{name}' cannot start after the handover: {e}"));
                }
            }
        }
        errors
    }
}
