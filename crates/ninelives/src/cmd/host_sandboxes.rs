//! Sandbox sets on a running host: the host API's `/v1/sandboxes`
//! resources (`sandbox_create`, `sandbox_list`, `sandbox_stats`,
//! `sandbox_destroy` in JSON lines). A set is what `ninelives sandbox
//! --config` runs (docs/sandboxes.md), held beside the host's ordinary VMs:
//! its guest memory counts against the host's memory budget, each set is
//! supervised on a thread of its own, and a host holding sets refuses to
//! rejuvenate (a new process cannot take sandboxes over yet) instead of
//! losing them.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use nl_sandbox::{SandboxSet, SetConfig, SetReport};
use nl_sync::Lock;
use nl_vmm::api::{ApiError, Frontend};
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
    /// The supervisor's report once every sandbox has ended.
    report: Arc<Lock<Option<SetReport>>>,
    supervisor: Option<std::thread::JoinHandle<()>>,
}

/// The `ninelives host` front end: VM configurations from `create`
/// requests, and sandbox sets. Its locks are `nl_sync` locks, so a
/// microreset that discards an API thread holding one releases it.
pub struct HostFrontend {
    sets: Arc<Lock<BTreeMap<String, RunningSet>>>,
}

impl Default for HostFrontend {
    fn default() -> Self {
        Self { sets: Lock::new("host.sandbox_sets", BTreeMap::new()) }
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
        if sets.contains_key(&name) {
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
        let report = Lock::new("host.sandbox_report", None);
        let supervisor = {
            let (s, report, name) = (set.clone(), report.clone(), name.clone());
            std::thread::Builder::new()
                .name(format!("sbx-{}", &name[..name.len().min(10)]))
                .spawn(move || {
                    let r = s.supervise(Duration::from_secs_f64(timeout));
                    nl_vmm::event_log::publish(
                        "sandbox_set_ended",
                        json!({"name": name, "all_ok": r.all_ok()}),
                    );
                    *report.lock() = Some(r);
                })
                .map_err(|e| {
                    set.stop_all();
                    ApiError {
                        status: 500,
                        message: format!("cannot start the set's supervisor: {e}"),
                    }
                })?
        };
        nl_vmm::event_log::publish(
            "sandbox_set_created",
            json!({"name": name, "sandboxes": names, "mem_bytes": mem_bytes}),
        );
        sets.insert(
            name.clone(),
            RunningSet {
                set,
                mem_bytes,
                started: Instant::now(),
                report,
                supervisor: Some(supervisor),
            },
        );
        Ok(json!({"name": name, "sandboxes": names}))
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
        })
    }

    fn stats(&self, name: &str) -> Result<Value, ApiError> {
        let sets = self.sets.lock();
        let r = sets.get(name).ok_or_else(|| not_found(name))?;
        let mut v = Self::summary(name, r);
        if let Some(report) = r.report.lock().as_ref() {
            v["report"] = serde_json::to_value(report).unwrap_or(Value::Null);
            return Ok(v);
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
                })
            })
            .collect();
        v["channel_stats"] = serde_json::to_value(r.set.channel_stats()).unwrap_or(Value::Null);
        Ok(v)
    }

    fn destroy(&self, name: &str) -> Result<Value, ApiError> {
        let r = self.sets.lock().remove(name).ok_or_else(|| not_found(name))?;
        Self::end(r);
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
                Ok(
                    json!({"sets": sets.iter().map(|(n, r)| Self::summary(n, r)).collect::<Vec<_>>()}),
                )
            }
            "sandbox_stats" => name_of(req).and_then(|n| self.stats(&n)),
            "sandbox_destroy" => name_of(req).and_then(|n| self.destroy(&n)),
            _ => return None,
        })
    }

    fn op_names(&self) -> &'static str {
        ", sandbox_create, sandbox_list, sandbox_stats, sandbox_destroy"
    }

    fn handover_blocker(&self) -> Option<String> {
        let sets = self.sets.lock();
        (!sets.is_empty()).then(|| {
            format!(
                "the host runs sandbox set(s) {}, which a new VMM process cannot take over yet; \
                 delete them first (DELETE /v1/sandboxes/NAME)",
                sets.keys().cloned().collect::<Vec<_>>().join(", ")
            )
        })
    }

    fn shutdown(&self) {
        let sets = std::mem::take(&mut *self.sets.lock());
        for (_, r) in sets {
            Self::end(r);
        }
    }
}
