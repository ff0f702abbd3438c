//! Per paper: our numbers (from the steps' JSON) beside the paper's, and
//! the figures, each drawn as SVG with the JSON behind it beside it.

use std::path::Path;

use anyhow::Result;
use serde::Serialize;
use serde_json::{json, Value};

use super::bars::{self, BarSeries, Val};
use super::html::{Figure, Ours, Row, Section};
use super::papers::{self as p, Better, Quoted};
use super::Data;
use crate::figures;
use crate::stats::wilson;

/// `v` at a dotted path ("a.b.0.c"); Null when absent.
pub fn at<'a>(v: &'a Value, path: &str) -> &'a Value {
    path.split('.')
        .try_fold(v, |v, k| match k.parse::<usize>() {
            Ok(i) if v.is_array() => v.get(i),
            _ => v.get(k),
        })
        .unwrap_or(&Value::Null)
}

fn num(v: &Value, path: &str) -> Option<f64> {
    at(v, path).as_f64().filter(|x| x.is_finite())
}

fn row(
    what: impl Into<String>,
    paper: Option<Quoted>,
    ours: Result<Ours, String>,
    better: Better,
) -> Row {
    Row {
        what: what.into(),
        paper,
        paper_missing: "not in the paper's text (figure only)",
        ours,
        better,
        note: String::new(),
    }
}

fn with_note(mut r: Row, note: &str) -> Row {
    r.note = note.to_string();
    r
}

fn missing(step: &str) -> String {
    format!("no result of step {step}")
}

/// A share k/n with its Wilson interval, as a row value.
fn share(k: u64, n: u64, what: &str) -> Result<Ours, String> {
    if n == 0 {
        return Err(format!("no {what} runs"));
    }
    let (lo, hi) = wilson(k, n);
    let v = k as f64 / n as f64;
    Ok(Ours {
        value: v,
        interval: Some((lo, hi)),
        text: format!("{:.1}% [{:.1}, {:.1}] ({k}/{n} {what})", 100.0 * v, 100.0 * lo, 100.0 * hi),
    })
}

fn point(value: f64, text: String) -> Result<Ours, String> {
    Ok(Ours { value, interval: None, text })
}

/// Writes `name.json` (the data) and draws `name.svg` with `draw` in `out`.
fn figure(
    out: &Path,
    name: &str,
    caption: &str,
    data: &impl Serialize,
    draw: impl FnOnce(&Path) -> Result<std::path::PathBuf>,
) -> Result<Figure> {
    std::fs::create_dir_all(out)?;
    std::fs::write(out.join(format!("{name}.json")), serde_json::to_string_pretty(data)?)?;
    draw(out)?;
    Ok(Figure { svg: format!("{name}.svg"), json: format!("{name}.json"), caption: caption.into() })
}

/// Every section, from whatever steps have results.
pub fn build(d: &Data, out: &Path) -> Result<Vec<Section>> {
    Ok(vec![
        nilihype(d, out)?,
        warm(d, out)?,
        ucheckpoint(d, out)?,
        hbft(d, out)?,
        questv(d, out)?,
        baseline(d, out)?,
    ])
}

fn cmd_list(names: &[&str]) -> String {
    let mut v = Vec::new();
    for n in names {
        if let Some(s) = super::steps::STEPS.iter().find(|s| s.name == *n) {
            v.push(format!(
                "<code>{}</code>: <code>ninelives {}</code>",
                s.name,
                s.quick.join(" ")
            ));
        }
    }
    format!("Steps (--quick arguments; --full in the report's steps.rs): {}.", v.join("; "))
}

/// The outcome counts of an inject step: (runs, outcomes object).
fn inject<'a>(d: &'a Data, step: &str) -> Option<(u64, &'a Value)> {
    let v = d.get(step)?;
    let o = &v["outcomes"];
    let n = ["non_manifested", "sdc", "detected"].iter().filter_map(|k| o[k].as_u64()).sum();
    Some((n, o))
}

fn recovery_rate(d: &Data, step: &str) -> Result<Ours, String> {
    let (_, o) = inject(d, step).ok_or_else(|| missing(step))?;
    let setup = d[step]["setup"].as_str().unwrap_or("?").to_string();
    share(
        o["recovered"].as_u64().unwrap_or(0),
        o["detected"].as_u64().unwrap_or(0),
        &format!("detected, {setup}"),
    )
}

fn nilihype(d: &Data, out: &Path) -> Result<Section> {
    let mut rows = vec![row(
        "Table I: recovery rate, no enhancement (ours: --repairs none)",
        Some(p::NILI_T1_BASIC),
        recovery_rate(d, "inject-failstop-microreset-norepairs"),
        Better::Higher,
    )];
    for (what, repairs, step, q) in p::NILI_T1_STEPS {
        rows.push(row(
            format!("Table I: {what} (ours: --repairs {repairs})"),
            Some(q),
            recovery_rate(d, step),
            Better::Higher,
        ));
    }
    rows.push(row(
        "Table I: recovery rate, all enhancements (ours: --repairs all)",
        Some(p::NILI_T1_ALL),
        recovery_rate(d, "inject-failstop-microreset"),
        Better::Higher,
    ));
    let mut fig2 = Vec::new();
    for (rec, q) in [("microreset", p::NILI_F2_MICRORESET), ("microreboot", p::NILI_F2_MICROREBOOT)]
    {
        let mut vals = Vec::new();
        for fault in ["failstop", "register", "code"] {
            let step = format!("inject-{fault}-{rec}");
            let r = recovery_rate(d, &step);
            vals.push(match &r {
                Ok(o) => Val::new(
                    o.value,
                    o.interval.map_or(f64::NAN, |i| i.0),
                    o.interval.map_or(f64::NAN, |i| i.1),
                ),
                Err(_) => Val::point(f64::NAN),
            });
            let who =
                if rec == "microreset" { "NiLiHype / microreset" } else { "ReHype / microreboot" };
            rows.push(with_note(
                row(
                    format!("Fig. 2: recovery rate, {who}, {fault} faults"),
                    Some(q),
                    r,
                    Better::Higher,
                ),
                "paper: 3AppVM; ours: the step's setup (1vm in --quick)",
            ));
        }
        fig2.push(BarSeries { label: rec.into(), values: vals });
    }
    // Outcome breakdown of register and code faults without recovery.
    let mut stack_cats = Vec::new();
    let mut stack: Vec<BarSeries> = ["non-manifested", "SDC", "detected"]
        .iter()
        .map(|l| BarSeries { label: l.to_string(), values: Vec::new() })
        .collect();
    for (fault, quoted) in [("register", p::NILI_REG_OUTCOMES), ("code", p::NILI_CODE_OUTCOMES)] {
        let step = format!("inject-{fault}-none");
        let got = inject(d, &step);
        for (i, (key, better)) in [
            ("non_manifested", Better::Neither),
            ("sdc", Better::Lower),
            ("detected", Better::Neither),
        ]
        .iter()
        .enumerate()
        {
            let ours = match got {
                Some((n, o)) => share(o[*key].as_u64().unwrap_or(0), n, &format!("{fault} runs")),
                None => Err(missing(&step)),
            };
            rows.push(row(
                format!("{fault} faults, no recovery: {} share", stack[i].label),
                Some(quoted[i]),
                ours,
                *better,
            ));
        }
        stack_cats.push(format!("{fault}: paper"));
        for (i, q) in quoted.iter().enumerate() {
            stack[i].values.push(Val::point(q.value));
        }
        stack_cats.push(format!("{fault}: ours"));
        for (i, key) in ["non_manifested", "sdc", "detected"].iter().enumerate() {
            stack[i].values.push(match got {
                Some((n, o)) if n > 0 => {
                    let k = o[*key].as_u64().unwrap_or(0);
                    let (lo, hi) = wilson(k, n);
                    Val::new(k as f64 / n as f64, lo, hi)
                }
                _ => Val::point(f64::NAN),
            });
        }
    }
    // Latency (Tables II and III) and the factor.
    let rec = d.get("recovery");
    let lat = |mech: &str| -> Result<Ours, String> {
        let r = rec.ok_or_else(|| missing("recovery"))?;
        let l = &r["latency"][mech];
        let m = num(l, "median_gap_ms").ok_or_else(|| {
            format!(
                "no latency ({})",
                r["latency"]["skipped"].as_str().unwrap_or("no recovered run")
            )
        })?;
        let gaps: Vec<f64> = l["runs"]
            .as_array()
            .map_or(vec![], |a| a.iter().filter_map(|x| x["gap_ms"].as_f64()).collect());
        let (lo, hi) = (
            gaps.iter().copied().fold(f64::INFINITY, f64::min),
            gaps.iter().copied().fold(0.0, f64::max),
        );
        let internal = num(l, "median_vmm_recovery_ms")
            .map_or(String::new(), |x| format!("; inside the VMM {x:.1} ms"));
        Ok(Ours {
            value: m,
            interval: (gaps.len() > 1).then_some((lo, hi)),
            text: format!(
                "{m:.1} ms [{lo:.1}–{hi:.1}] ping gap, median of {} runs{internal}",
                gaps.len()
            ),
        })
    };
    let (reset, reboot) = (lat("microreset"), lat("microreboot"));
    let lat_fig = vec![
        BarSeries {
            label: "ours (median ping gap, min–max)".into(),
            values: [&reset, &reboot]
                .iter()
                .map(|r| match r {
                    Ok(o) => Val::new(
                        o.value,
                        o.interval.map_or(f64::NAN, |i| i.0),
                        o.interval.map_or(f64::NAN, |i| i.1),
                    ),
                    Err(_) => Val::point(f64::NAN),
                })
                .collect(),
        },
        BarSeries {
            label: "paper (Tables III and II)".into(),
            values: vec![Val::point(22.0), Val::point(713.0)],
        },
    ];
    rows.push(with_note(row("Table III: recovery latency, microreset (NiLiHype)", Some(p::NILI_T3_NILIHYPE_MS), reset.clone(), Better::Lower),
        "ours: longest gap of a 1 ms UDP ping to a netbench VM across an injected SIGSEGV in the VMM"));
    rows.push(row(
        "Table II: recovery latency, microreboot (ReHype)",
        Some(p::NILI_T2_REHYPE_MS),
        reboot.clone(),
        Better::Lower,
    ));
    let factor = match (&reset, &reboot) {
        (Ok(a), Ok(b)) if a.value > 0.0 => {
            point(b.value / a.value, format!("{:.1}x", b.value / a.value))
        }
        _ => Err("needs both latencies".into()),
    };
    rows.push(row(
        "§VII-B: microreboot latency / microreset latency",
        Some(p::NILI_FACTOR),
        factor,
        Better::Higher,
    ));
    // Fig. 3: overhead in normal operation.
    let mut f3_cats = Vec::new();
    let mut f3 = vec![
        BarSeries { label: "microreset".into(), values: vec![] },
        BarSeries { label: "microreset without undo log".into(), values: vec![] },
    ];
    match rec.and_then(|r| r["overhead"].as_array()).filter(|a| !a.is_empty()) {
        Some(over) => {
            for w in over {
                let name = w["workload"].as_str().unwrap_or("?").to_string();
                for (i, cfg) in ["microreset", "microreset_no_undo_log"].iter().enumerate() {
                    let r = num(w, &format!("ratio.{cfg}"));
                    let (lo, hi) = (
                        num(w, &format!("ratio_ci95.{cfg}.0")),
                        num(w, &format!("ratio_ci95.{cfg}.1")),
                    );
                    f3[i].values.push(Val::new(
                        r.unwrap_or(f64::NAN),
                        lo.unwrap_or(f64::NAN),
                        hi.unwrap_or(f64::NAN),
                    ));
                    if i == 0 {
                        let ours = r
                            .map(|r| Ours {
                                value: r,
                                interval: lo.zip(hi),
                                text: format!(
                                    "{r:.3} [{:.3}, {:.3}] VMM CPU vs --recovery none",
                                    lo.unwrap_or(f64::NAN),
                                    hi.unwrap_or(f64::NAN)
                                ),
                            })
                            .ok_or_else(|| "no ratio".to_string());
                        rows.push(with_note(row(format!("Fig. 3: normal-operation overhead, {name}"), Some(p::NILI_F3_OVERHEAD), ours, Better::Lower),
                            "paper: total CPU (its hypervisor-cycle bars are not in the text); ours: CPU of the VMM process outside guest mode"));
                    }
                }
                f3_cats.push(name);
            }
        }
        None => rows.push(row(
            "Fig. 3: normal-operation overhead",
            Some(p::NILI_F3_OVERHEAD),
            Err(missing("recovery")),
            Better::Lower,
        )),
    }
    let fault_cats: Vec<String> =
        ["failstop", "register", "code"].iter().map(|s| s.to_string()).collect();
    let figures = vec![
        figure(out, "fig-nilihype-fig2", "Paper Fig. 2 analogue: successful recovery rate per fault type (95% Wilson intervals)",
            &json!({"categories": fault_cats, "series": fig2.iter().map(|s| json!({"label": s.label, "values": s.values})).collect::<Vec<_>>()}),
            |o| bars::grouped(o, "fig-nilihype-fig2", "Recovery rate of detected errors", "Paper Fig. 2 analogue (NiLiHype = microreset, ReHype = microreboot)", "recovered / detected", &fault_cats, &fig2, Some((1.0, "all recovered"))))?,
        figure(out, "fig-nilihype-outcomes", "Paper §VII-A (with Fig. 2): outcomes of register and code faults without recovery, paper beside ours (95% Wilson intervals)",
            &json!({"categories": stack_cats, "series": stack.iter().map(|s| json!({"label": s.label, "values": s.values})).collect::<Vec<_>>()}),
            |o| bars::stacked(o, "fig-nilihype-outcomes", "Fault-injection outcomes", "Paper §VII-A outcome breakdown beside ours", "share of runs", &stack_cats, &stack))?,
        figure(out, "fig-nilihype-latency", "Paper Tables II and III: recovery latency (ms), ours beside the paper's",
            &json!({"categories": ["microreset", "microreboot"], "series": lat_fig.iter().map(|s| json!({"label": s.label, "values": s.values})).collect::<Vec<_>>()}),
            |o| bars::grouped(o, "fig-nilihype-latency", "Recovery latency", "Paper Tables II (ReHype, 713 ms) and III (NiLiHype, 22 ms)", "ms", &["microreset".into(), "microreboot".into()], &lat_fig, None))?,
        figure(out, "fig-nilihype-fig3", "Paper Fig. 3 analogue: VMM CPU in normal operation relative to no recovery (95% bootstrap intervals)",
            &json!({"categories": f3_cats, "series": f3.iter().map(|s| json!({"label": s.label, "values": s.values})).collect::<Vec<_>>()}),
            |o| bars::grouped(o, "fig-nilihype-fig3", "Normal-operation overhead", "Paper Fig. 3 analogue", "VMM CPU / no recovery", &f3_cats, &f3, Some((1.0, "y = 1 (no recovery)"))))?,
    ];
    Ok(Section {
        id: "nilihype",
        title: "VMM recovery: microreset (NiLiHype) and microreboot (ReHype)".into(),
        paper: p::NILIHYPE,
        intro: format!("Fault-injection campaigns against <code>ninelives host</code> (ptrace injector) and the recovery bench. {}",
            cmd_list(&super::steps::STEPS.iter().map(|s| s.name).filter(|n| n.starts_with("inject-") || *n == "recovery").collect::<Vec<_>>())),
        rows,
        figures,
    })
}

fn warm(d: &Data, out: &Path) -> Result<Section> {
    let r = d.get("rejuvenate");
    let mut rows = Vec::new();
    let modes = r.and_then(|r| r["filecache"]["modes"].as_array()).cloned().unwrap_or_default();
    let mode = |m: &str| modes.iter().find(|x| x["mode"] == m);
    for (m, q) in [("warm", p::WARM_F8_WARM), ("cold", p::WARM_F8_COLD)] {
        let ours = match mode(m) {
            Some(x) => match (num(x, "after_1s.relative_cpu"), num(x, "after_1s.relative")) {
                (Some(c), w) => {
                    let wall = w.map_or("?".into(), |w| format!("{:.0}", 100.0 * w));
                    match (
                        num(x, "after_1s_relative_cpu_min"),
                        num(x, "after_1s_relative_cpu_max"),
                        num(x, "reps"),
                    ) {
                        (Some(lo), Some(hi), Some(n)) => Ok(Ours {
                            value: c,
                            interval: Some((lo, hi)),
                            text: format!(
                                "{:.0}% [{:.0}–{:.0}%] per CPU second in the first 1 s, median of {n} ({wall}% per wall second in the median run)",
                                100.0 * c,
                                100.0 * lo,
                                100.0 * hi
                            ),
                        }),
                        _ => point(
                            c,
                            format!(
                                "{:.0}% per CPU second ({wall}% per wall second) in the first 1 s, one run",
                                100.0 * c
                            ),
                        ),
                    }
                }
                _ => Err("no window after the rejuvenation".into()),
            },
            None => Err(missing("rejuvenate (filecache)")),
        };
        rows.push(with_note(
            row(
                format!(
                    "Fig. 8(a): file-read throughput just after a {m} reboot, relative to before"
                ),
                Some(q),
                ours,
                Better::Higher,
            ),
            "ours: filecache VM, 192 MiB data set cached; each repetition against the throughput just before it",
        ));
    }
    let fit = |k: &str| r.and_then(|r| num(r, &format!("model.fits.{k}.per_vm_ms")));
    let fit_text = |k: &str| -> Result<Ours, String> {
        let v = fit(k).ok_or_else(|| missing("rejuvenate (model)"))?;
        let c = r.and_then(|r| num(r, &format!("model.fits.{k}.constant_ms"))).unwrap_or(f64::NAN);
        let r2 = r.and_then(|r| num(r, &format!("model.fits.{k}.r2"))).unwrap_or(f64::NAN);
        point(v, format!("{k}(n) = {v:.2}·n + {c:.2} ms (r² {r2:.2})"))
    };
    rows.push(row(
        "§5.6 model: resume(n), per VM",
        Some(p::WARM_56_RESUME_PER_VM_MS),
        fit_text("resume"),
        Better::Lower,
    ));
    rows.push(row(
        "§5.6 model: boot(n), per VM (cold)",
        Some(p::WARM_56_BOOT_PER_VM_MS),
        fit_text("boot"),
        Better::Lower,
    ));
    rows.push(row("§5.6 model: D_warm(n), per VM", None, fit_text("d_warm"), Better::Lower));
    // A sandbox set with its own TAP carried by warm rejuvenations and by
    // microreboots of its host.
    for (key, what, label, note) in [
        (
            "sandbox_set",
            "rejuvenations",
            "warm rejuvenation carrying a sandbox set with its own TAP",
            "ours: one netbench sandbox on its TAP, pinged every 1 ms across each warm rejuvenation (the new process takes the TAP descriptor over)",
        ),
        (
            "sandbox_link",
            "rejuvenations",
            "warm rejuvenation carrying a sandbox set on a shared link",
            "ours: two netbench sandboxes on one shared TAP (a demux link), both pinged every 1 ms across each warm rejuvenation; the longer of the two members' gaps (the new process takes the TAP and the link's packet sockets over)",
        ),
        (
            "sandbox_microreboot",
            "microreboots",
            "VMM microreboot carrying a sandbox set with its own TAP",
            "ours: the same sandbox on a host started with --recovery microreboot whose API thread crashes (NINELIVES_API_FAULT); the fresh process takes the set over",
        ),
    ] {
        let sb = r.map(|r| &r[key]);
        let ours = match sb.and_then(|s| Some((num(s, "gap_ms.median")?, s))) {
            Some((m, s)) => Ok(Ours {
                value: m,
                interval: num(s, "gap_ms.min").zip(num(s, "gap_ms.max")),
                text: format!(
                    "{m:.1} ms [{:.1}, {:.1}] longest 1 ms ping gap, {} pings lost, {} {what}",
                    num(s, "gap_ms.min").unwrap_or(f64::NAN),
                    num(s, "gap_ms.max").unwrap_or(f64::NAN),
                    s["lost"],
                    s["runs"].as_array().map_or(0, Vec::len)
                ),
            }),
            None => Err(sb.and_then(|s| s["skipped"].as_str()).map_or_else(
                || missing(&format!("rejuvenate ({key})")),
                |w| format!("skipped: {w}"),
            )),
        };
        rows.push(with_note(row(label, None, ours, Better::Lower), note));
    }
    rows.push(row(
        "§5.6 model: r(n) = D_cold − D_warm, per VM",
        None,
        fit_text("r"),
        Better::Higher,
    ));
    // Downtime reduction and absolute downtimes from the grid.
    let runs = r.and_then(|r| r["runs"].as_array()).cloned().unwrap_or_default();
    let cell = |m: &str, n: u64| {
        runs.iter()
            .find(|x| x["mode"] == m && x["vms"] == n)
            .and_then(|x| num(x, "total_downtime_ms"))
    };
    let max_n = runs.iter().filter_map(|x| x["vms"].as_u64()).max();
    let red = match max_n.and_then(|n| Some((n, cell("warm", n)?, cell("cold", n)?))) {
        Some((n, w, c)) if c > 0.0 => point(
            1.0 - w / c,
            format!("{:.1}% ({n} VMs: warm {w:.1} ms, cold {c:.1} ms)", 100.0 * (1.0 - w / c)),
        ),
        _ => Err(missing("rejuvenate (grid)")),
    };
    rows.push(row(
        "downtime reduced by warm-VM reboot (largest n measured)",
        Some(p::WARM_REDUCTION),
        red,
        Better::Higher,
    ));
    for (m, q) in [("warm", p::WARM_11VM_WARM_MS), ("cold", p::WARM_11VM_COLD_MS)] {
        let ours = match max_n.and_then(|n| Some((n, cell(m, n)?))) {
            Some((n, v)) => point(v, format!("{v:.1} ms with {n} VMs")),
            None => Err(missing("rejuvenate (grid)")),
        };
        rows.push(with_note(
            row(format!("{m} reboot downtime"), Some(q), ours, Better::Lower),
            "the paper's 11 VMs booted a full OS each; ours fewer VMs of the reference guest",
        ));
    }
    let mut figures = Vec::new();
    if !modes.is_empty() {
        let series: Vec<figures::Series> = modes
            .iter()
            .map(|m| {
                let before = num(m, "before.bytes_per_cpu_sec").unwrap_or(f64::NAN);
                figures::Series {
                    label: m["mode"].as_str().unwrap_or("?").to_string(),
                    points: m["series"].as_array().map_or(vec![], |s| {
                        s.iter()
                            .filter_map(|x| {
                                Some((
                                    x["t_ms"].as_f64()? / 1e3,
                                    x["bytes_per_cpu_sec"].as_f64()? / before,
                                ))
                            })
                            .collect()
                    }),
                }
            })
            .collect();
        let data: Vec<Value> =
            series.iter().map(|s| json!({"mode": s.label, "points": s.points})).collect();
        figures.push(figure(out, "fig-warm-fig8", "Paper Fig. 8(a) analogue: filecache throughput per CPU second relative to before, around each rejuvenation (t = 0: the reply)", &data,
            |o| figures::time_chart(o, "fig-warm-fig8", "Paper Fig. 8(a) analogue: throughput after a VMM rejuvenation", ("seconds from the rejuvenation's reply", "throughput / before"), &series, Some(1.0)))?);
    }
    if let Some(m) = r.map(|r| &r["model"]["fits"]).filter(|v| v.is_object()) {
        let pts = |k: &str| -> Vec<(f64, f64)> {
            m[k]["points"].as_array().map_or(vec![], |a| {
                a.iter().filter_map(|p| Some((p[0].as_f64()?, p[1].as_f64()?))).collect()
            })
        };
        let series = vec![
            figures::Series { label: "D_warm(n) measured".into(), points: pts("d_warm") },
            figures::Series { label: "D_cold(n) measured".into(), points: pts("d_cold") },
            figures::Series { label: "r(n) = D_cold − D_warm".into(), points: pts("r") },
        ];
        figures.push(figure(
            out,
            "fig-warm-model",
            "Paper §5.6 model on ninelives: downtime of n 256 MiB VMs, warm and cold (ms)",
            m,
            |o| {
                figures::time_chart(
                    o,
                    "fig-warm-model",
                    "Paper §5.6: downtime against the number of VMs",
                    ("VMs", "ms"),
                    &series,
                    None,
                )
            },
        )?);
    }
    Ok(Section {
        id: "warm",
        title: "VMM rejuvenation: warm-VM reboot".into(),
        paper: p::WARM,
        intro: format!("A host process replaced while its VMs run (warm), against shutting the VMs down and booting them again (cold) and saving them to disk. {}", cmd_list(&["rejuvenate"])),
        rows,
        figures,
    })
}

fn ucheckpoint(d: &Data, out: &Path) -> Result<Section> {
    let c = d.get("checkpoint").map(|v| &v["checkpoint"]);
    let matrix = c.and_then(|c| c["matrix"].as_array()).cloned().unwrap_or_default();
    let min_block = matrix.iter().filter_map(|x| x["block_pages"].as_u64()).min().unwrap_or(1);
    let cell = |w: &str, m: &str, i: f64| {
        matrix.iter().find(|x| {
            x["workload"] == w
                && x["mode"] == m
                && x["block_pages"] == min_block
                && x["interval_ms"].as_f64() == Some(i)
        })
    };
    let workloads: Vec<String> = {
        let mut v: Vec<String> =
            matrix.iter().filter_map(|x| x["workload"].as_str().map(String::from)).collect();
        v.dedup();
        v.sort();
        v.dedup();
        v
    };
    let mut rows = Vec::new();
    for w in &workloads {
        let ours = cell(w, "cow-p", 50.0)
            .and_then(|x| num(x, "normalized_time"))
            .map(|v| {
                let x = cell(w, "cow-p", 50.0);
                let spread =
                    x.and_then(|x| Some((num(x, "normalized_min")?, num(x, "normalized_max")?)));
                let n = x.and_then(|x| x["normalized_samples"].as_array()).map_or(1, Vec::len);
                match spread {
                    Some((lo, hi)) => Ours {
                        value: v,
                        interval: Some((lo, hi)),
                        text: format!(
                            "{v:.3} [{lo:.3}–{hi:.3}] (median of {n}; block {min_block})"
                        ),
                    },
                    None => Ours {
                        value: v,
                        interval: None,
                        text: format!("{v:.3} (one run; block {min_block})"),
                    },
                }
            })
            .ok_or_else(|| "no 50 ms CoW-P cell".to_string());
        rows.push(with_note(
            row(
                format!("Fig. 3: normalized execution time, CoW-P at 50 ms, {w}"),
                Some(p::UCK_F3_50MS),
                ours,
                Better::Lower,
            ),
            "paper: SPEC CINT 2006 average",
        ));
    }
    if workloads.is_empty() {
        rows.push(row(
            "Fig. 3: normalized execution time, CoW-P at 50 ms",
            Some(p::UCK_F3_50MS),
            Err(missing("checkpoint")),
            Better::Lower,
        ));
    }
    for (m, q) in [("cow-p", p::UCK_F4_COWP), ("cow-b", p::UCK_F4_COWB)] {
        let ours = cell("memwrite-random", m, 50.0)
            .and_then(|x| num(x, "normalized_time"))
            .map(|v| Ours {
                value: 1.0 / v,
                interval: None,
                text: format!("{:.1}% of unprotected throughput", 100.0 / v),
            })
            .ok_or_else(|| missing("checkpoint"));
        rows.push(with_note(row(format!("Fig. 4 analogue: throughput at 50 ms, {m}"), Some(q), ours, Better::Higher),
            "paper: Apache; ours: memwrite-random (64 MiB of random writes), the most write-heavy case"));
    }
    let red = c
        .and_then(|c| num(c, &format!("cow_p_fault_reduction_pct_50ms.block_{min_block}")))
        .map(|v| Ours {
            value: v,
            interval: None,
            text: format!("{v:.1}% fewer write faults (memwrite-locality)"),
        })
        .ok_or_else(|| missing("checkpoint"));
    rows.push(row(
        "CoW-P's page-fault reduction against CoW-B at 50 ms",
        Some(p::UCK_FAULT_REDUCTION),
        red,
        Better::Higher,
    ));
    for (i, q) in [(50.0, p::UCK_SIZE_50MS), (1000.0, p::UCK_SIZE_1000MS)] {
        let vals: Vec<(String, f64, f64)> = workloads
            .iter()
            .filter_map(|w| {
                let x = cell(w, "cow-p", i)?;
                Some((
                    w.clone(),
                    num(x, "checkpoint_pct_of_memory")?,
                    num(x, "checkpoint_pages_avg")?,
                ))
            })
            .collect();
        let ours = vals
            .iter()
            .map(|v| v.1)
            .fold(None, |a: Option<f64>, b| Some(a.map_or(b, |a| a.max(b))))
            .map(|worst| Ours {
                value: worst,
                interval: None,
                text: format!(
                    "{worst:.2}% of guest memory (worst workload; {})",
                    vals.iter()
                        .map(|(w, pc, pg)| format!("{w} {pc:.2}% = {pg:.0} pages"))
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            })
            .ok_or_else(|| missing("checkpoint"));
        rows.push(row(
            format!("checkpoint size at {i:.0} ms, CoW-P, % of memory"),
            Some(q),
            ours,
            Better::Lower,
        ));
    }
    let rb = c.map(|c| &c["rollback"]);
    let rollback = rb.and_then(|r| num(r, "rollback_ms")).map(|m| {
        let r = rb.unwrap_or(&Value::Null);
        Ours { value: m, interval: None, text: format!("{m:.1} ms median (average {:.1}, max {:.1}) over {} injected runs, {} recovered",
            num(r, "rollback_ms_avg").unwrap_or(f64::NAN), num(r, "rollback_ms_max").unwrap_or(f64::NAN),
            r["runs"].as_u64().unwrap_or(0), r["recovered"].as_u64().unwrap_or(0)) }
    }).ok_or_else(|| missing("checkpoint"));
    rows.push(with_note(row("rollback (recovery) time", Some(p::UCK_ROLLBACK_MS), rollback, Better::Lower),
        "paper: SPEC workloads, failure generated by a program; ours: one injected bit flip per run"));
    if let Some(r) = rb.filter(|r| r.is_object()) {
        let n = r["runs"].as_u64().unwrap_or(0);
        let ok = r["recovered"].as_u64().unwrap_or(0) + r["non_manifested"].as_u64().unwrap_or(0);
        rows.push(row(
            "runs with one injected fault that ended correct (recovered or not manifested)",
            None,
            share(ok, n, "injected"),
            Better::Higher,
        ));
    }
    let mut figures = Vec::new();
    let variants: Vec<(String, u64)> = {
        let mut v: Vec<(String, u64)> = matrix
            .iter()
            .filter_map(|x| Some((x["mode"].as_str()?.to_string(), x["block_pages"].as_u64()?)))
            .collect();
        v.sort();
        v.dedup();
        v
    };
    for w in &workloads {
        let series: Vec<figures::SpreadSeries> = variants
            .iter()
            .map(|(m, b)| figures::SpreadSeries {
                label: format!("{m} (block {b})"),
                points: matrix
                    .iter()
                    .filter(|x| {
                        x["workload"] == w.as_str()
                            && x["mode"] == m.as_str()
                            && x["block_pages"] == *b
                    })
                    .filter_map(|x| {
                        let v = x["normalized_time"].as_f64()?;
                        let lo = x["normalized_min"].as_f64().unwrap_or(f64::NAN);
                        let hi = x["normalized_max"].as_f64().unwrap_or(f64::NAN);
                        Some((x["interval_ms"].as_f64()?, v, lo, hi))
                    })
                    .collect(),
            })
            .collect();
        let name = format!("fig-ucheckpoint-fig3-{w}");
        let data: Vec<&Value> = matrix.iter().filter(|x| x["workload"] == w.as_str()).collect();
        let caption = format!("Paper Fig. 3 analogue ({w}): execution time under checkpointing / unprotected, per interval (medians, bars: min–max of the repetitions)");
        figures.push(figure(out, &name, &caption, &data, |o| {
            figures::ratio_chart(
                o,
                &name,
                &format!("{w}: normalized execution time"),
                "Paper Fig. 3 analogue (6.3% average overhead at 50 ms for SPEC CINT)",
                ("checkpoint interval (ms)", "protected / unprotected time"),
                &series,
                true,
            )
        })?);
    }
    Ok(Section {
        id: "ucheckpoint",
        title: "In-memory checkpoints and rollback: VM-μCheckpoint".into(),
        paper: p::UCKPT,
        intro: format!("The overhead matrix against unprotected runs measured just before each group, CoW-P's fault reduction, checkpoint sizes and single-fault injection runs. {}", cmd_list(&["checkpoint"])),
        rows,
        figures,
    })
}

fn hbft(d: &Data, out: &Path) -> Result<Section> {
    let r = d.get("replicate");
    let rows_j = r.and_then(|r| r["rows"].as_array()).cloned().unwrap_or_default();
    let find = |w: &str, cfg: &str, e: u64| {
        rows_j.iter().find(|x| x["workload"] == w && x["config"] == cfg && x["epoch_ms"] == e)
    };
    let mut workloads: Vec<String> =
        rows_j.iter().filter_map(|x| x["workload"].as_str().map(String::from)).collect();
    workloads.dedup();
    // `bench replicate`'s cells: the defaults (every optimization the bench
    // found best), and the flags that turn them off.
    let best = "default";
    let none_cfg = "--no-selective --no-predict";
    let mut rows = Vec::new();
    let ratio_of = |x: Option<&Value>| x.and_then(|x| num(x, "ratio"));
    let o = |x: Option<&Value>, what: &str| {
        let x = x.ok_or_else(|| "no row".to_string())?;
        let v = num(x, "ratio").ok_or_else(|| "no ratio".to_string())?;
        let n = x["ratio_samples"].as_array().map_or(1, Vec::len);
        Ok(match (num(x, "ratio_min"), num(x, "ratio_max")) {
            (Some(lo), Some(hi)) => Ours {
                value: v,
                interval: Some((lo, hi)),
                text: format!("{v:.3} [{lo:.3}–{hi:.3}] of unreplicated ({what}, median of {n})"),
            },
            _ => Ours {
                value: v,
                interval: None,
                text: format!("{v:.3} of unreplicated ({what}, one run)"),
            },
        })
    };
    for w in workloads.iter().filter(|w| !w.starts_with("kv")) {
        let none = ratio_of(find(w, none_cfg, 20));
        let opt = ratio_of(find(w, best, 20));
        let (none_row, opt_row) = (find(w, none_cfg, 20), find(w, best, 20));
        rows.push(row(
            format!("Fig. 9: {w}, no optimization, 20 ms epochs"),
            Some(p::HBFT_F9_NONE),
            o(none_row, "none"),
            Better::Higher,
        ));
        rows.push(row(
            format!("Fig. 9: {w}, all optimizations ({best})"),
            Some(p::HBFT_F9_OPT),
            o(opt_row, best),
            Better::Higher,
        ));
        let f = match (none, opt) {
            (Some(a), Some(b)) if a > 0.0 => point(b / a, format!("{:.2}x", b / a)),
            _ => Err("needs both rows".into()),
        };
        rows.push(row(
            format!("Fig. 9: {w}, improvement by the optimizations"),
            Some(p::HBFT_F9_FACTOR),
            f,
            Better::Higher,
        ));
    }
    if workloads.is_empty() {
        rows.push(row(
            "Fig. 9: replicated / unreplicated throughput",
            Some(p::HBFT_F9_OPT),
            Err(missing("replicate")),
            Better::Higher,
        ));
    }
    // Request/response: kv under kvload, where output commit holds every
    // reply until its epoch is acknowledged (no HBFT figure: HBFT measured
    // batch workloads; Remus and Taiji report such services).
    for (cfg, what) in [
        (best, "defaults: output-triggered epochs"),
        ("--no-output-epochs", "without output-triggered epochs"),
    ] {
        if let Some(x) = find("kv", cfg, 20) {
            rows.push(row(
                format!("kv requests/s under replication, {what}, 20 ms epochs"),
                None,
                o(Some(x), cfg),
                Better::Higher,
            ));
        }
    }
    rows.push(row("Fig. 10: the memory-tracking mechanism alone (OriginXen worst case)", Some(p::HBFT_F10_WORST),
        Err("no bench runs the dirty tracking alone, without sending epochs (the rows of Fig. 9 include it)".into()), Better::Higher));
    rows.push(row(
        "Fig. 10: the memory-tracking mechanism alone (WFPXen best case)",
        Some(p::HBFT_F10_BEST),
        Err("as above".into()),
        Better::Higher,
    ));
    for w in workloads.iter().filter(|w| w.starts_with("memwrite")) {
        let faults: Vec<String> = [none_cfg, "--no-predict", best, "--histase"]
            .iter()
            .filter_map(|c| {
                Some(format!("{c} {:.0}", num(find(w, c, 20)?, "write_faults_per_epoch")?))
            })
            .collect();
        let v = find(w, "--histase", 20).and_then(|x| num(x, "write_faults_per_epoch"));
        rows.push(row(
            format!("Fig. 11: write faults per epoch, {w}"),
            None,
            v.map(|v| Ours { value: v, interval: None, text: faults.join(", ") })
                .ok_or_else(|| "no rows".to_string()),
            Better::Lower,
        ));
        for (k, q) in [("recall", p::HBFT_F12_RECALL), ("precision", p::HBFT_F12_PRECISION)] {
            let v = find(w, "--histase", 20).and_then(|x| num(x, k));
            rows.push(with_note(
                row(
                    format!("Fig. 12: Histase {k}, {w}"),
                    Some(q),
                    v.map(|v| Ours { value: v, interval: None, text: format!("{v:.3}") })
                        .ok_or_else(|| "no --histase row".to_string()),
                    Better::Higher,
                ),
                "paper: CFP",
            ));
        }
    }
    let mut epochs: Vec<u64> = rows_j
        .iter()
        .filter(|x| x["config"] == best)
        .filter_map(|x| x["epoch_ms"].as_u64())
        .collect();
    epochs.sort();
    epochs.dedup();
    for w in workloads.iter().filter(|w| !w.starts_with("kv")) {
        let vals: Vec<String> = epochs
            .iter()
            .filter_map(|e| Some(format!("{e} ms: {:.3}", ratio_of(find(w, best, *e))?)))
            .collect();
        let last = epochs.last().and_then(|e| ratio_of(find(w, best, *e)));
        rows.push(row(
            format!("Fig. 13: epoch length sweep, {w}"),
            None,
            last.map(|v| Ours { value: v, interval: None, text: vals.join(", ") })
                .ok_or_else(|| "no sweep".to_string()),
            Better::Higher,
        ));
    }
    rows.push(row("Table 2 analogue: software-superpage mapping hit ratio", Some(p::HBFT_T2_HIT),
        Err("ninelives maps all of guest memory in the VMM; there is no limited mapping window to hit or miss".into()), Better::Higher));
    if let Some(k) = r.map(|r| &r["kill_summary"]).filter(|k| k.is_object()) {
        let (n, t) = (k["kills"].as_u64().unwrap_or(0), k["takeovers"].as_u64().unwrap_or(0));
        rows.push(with_note(
            row("primary killed: backup took over", None, share(t, n, "kills"), Better::Higher),
            &format!(
                "lost acknowledged writes: {}; client's longest request median {:.0} ms; \
                 takeover (detection to the vCPUs started) median {:.1} ms [{:.1}, {:.1}], \
                 {} of the VMs built ahead",
                k["lost_acked_writes"],
                num(k, "client_gap_ms_median").unwrap_or(f64::NAN),
                num(k, "takeover_ms_median").unwrap_or(f64::NAN),
                num(k, "takeover_ms_min").unwrap_or(f64::NAN),
                num(k, "takeover_ms_max").unwrap_or(f64::NAN),
                k["prebuilt"]
            ),
        ));
    }
    let mut figures = Vec::new();
    let configs: Vec<String> = {
        let mut v: Vec<String> = rows_j
            .iter()
            .filter(|x| x["epoch_ms"] == 20)
            .filter_map(|x| x["config"].as_str().map(String::from))
            .collect();
        let mut seen = std::collections::HashSet::new();
        v.retain(|c| seen.insert(c.clone()));
        v
    };
    if !workloads.is_empty() {
        let f9: Vec<BarSeries> = configs
            .iter()
            .map(|c| BarSeries {
                label: c.clone(),
                values: workloads
                    .iter()
                    .map(|w| {
                        let x = find(w, c, 20);
                        let m = ratio_of(x).unwrap_or(f64::NAN);
                        match x.map(|x| (num(x, "ratio_min"), num(x, "ratio_max"))) {
                            Some((Some(lo), Some(hi))) => Val::new(m, lo, hi),
                            _ => Val::point(m),
                        }
                    })
                    .collect(),
            })
            .collect();
        let data: Vec<&Value> = rows_j.iter().filter(|x| x["epoch_ms"] == 20).collect();
        figures.push(figure(out, "fig-hbft-fig9", "Paper Fig. 9 analogue: throughput under replication / unreplicated, 20 ms epochs, per optimization (median of the repetitions)", &data,
            |o| bars::grouped(o, "fig-hbft-fig9", "Replicated / unreplicated throughput", "Paper Fig. 9 analogue (unoptimized HBFT ~0.30, optimized ~0.60 of native VM)", "ratio", &workloads, &f9, Some((1.0, "y = 1 (unreplicated)"))))?);
        let mw: Vec<String> =
            workloads.iter().filter(|w| w.starts_with("memwrite")).cloned().collect();
        let f11: Vec<BarSeries> = [none_cfg, "--no-predict", best, "--histase"]
            .iter()
            .map(|c| BarSeries {
                label: c.to_string(),
                values: mw
                    .iter()
                    .map(|w| {
                        Val::point(
                            find(w, c, 20)
                                .and_then(|x| num(x, "write_faults_per_epoch"))
                                .unwrap_or(f64::NAN),
                        )
                    })
                    .collect(),
            })
            .collect();
        figures.push(figure(
            out,
            "fig-hbft-fig11",
            "Paper Fig. 11 analogue: write faults per 20 ms epoch per tracking scheme",
            &data,
            |o| {
                bars::grouped(
                    o,
                    "fig-hbft-fig11",
                    "Write faults per epoch",
                    "Paper Fig. 11 analogue",
                    "faults / epoch",
                    &mw,
                    &f11,
                    None,
                )
            },
        )?);
        let series: Vec<figures::SpreadSeries> = workloads
            .iter()
            .filter(|w| !w.starts_with("kv"))
            .map(|w| figures::SpreadSeries {
                label: w.clone(),
                points: epochs
                    .iter()
                    .filter_map(|e| {
                        let v = ratio_of(find(w, best, *e))?;
                        Some((*e as f64, v, f64::NAN, f64::NAN))
                    })
                    .collect(),
            })
            .collect();
        let data13: Vec<&Value> = rows_j.iter().filter(|x| x["config"] == best).collect();
        figures.push(figure(out, "fig-hbft-fig13", "Paper Fig. 13 analogue: throughput ratio against the epoch length, all optimizations (medians)", &data13,
            |o| figures::ratio_chart(o, "fig-hbft-fig13", "Epoch length sweep", "Paper Fig. 13 analogue", ("epoch (ms)", "replicated / unreplicated"), &series, true))?);
    }
    Ok(Section {
        id: "hbft",
        title: "Primary/backup replication: HBFT".into(),
        paper: p::HBFT,
        intro: format!("Workloads under replication to a backup on the same machine (loopback), against the unreplicated VM of the same run, then a kill campaign. {}", cmd_list(&["replicate"])),
        rows,
        figures,
    })
}

fn questv(d: &Data, out: &Path) -> Result<Section> {
    let s = d.get("sandbox");
    let rows_j = s.and_then(|s| s["fig9"]["rows"].as_array()).cloned().unwrap_or_default();
    let size = |n: u64| rows_j.iter().find(|r| r["size"] == n);
    let spread = |r: &Value, k: &str| -> Option<Ours> {
        let pre = if k.is_empty() { String::new() } else { format!("{k}.") };
        let m = num(r, &format!("{pre}median"))?;
        let (lo, hi) = (num(r, &format!("{pre}min"))?, num(r, &format!("{pre}max"))?);
        Some(Ours {
            value: m, interval: Some((lo, hi)), text: format!("{m:.3} [{lo:.3}–{hi:.3}]")
        })
    };
    let mut rows = Vec::new();
    let small = rows_j.first().and_then(|r| r["size"].as_u64()).unwrap_or(64);
    let target = |k: &str| s.and_then(|s| num(s, &format!("fig9.{k}")));
    rows.push(with_note(
        row(
            format!("Fig. 9: one-way message time, {small} B (ns)"),
            None,
            size(small)
                .and_then(|r| spread(r, "sandbox_one_way_ns"))
                .ok_or_else(|| missing("sandbox")),
            Better::Lower,
        ),
        &target("target_one_way_64b_ns")
            .map_or(String::new(), |t| format!("issue's target for 64 B: {t:.0} ns")),
    ));
    let big = rows_j.last().and_then(|r| r["size"].as_u64()).unwrap_or(4096);
    rows.push(with_note(
        row(
            format!("Fig. 9: streaming throughput, {big} B messages (GB/s)"),
            None,
            size(big)
                .and_then(|r| spread(r, "sandbox_stream_gbps"))
                .ok_or_else(|| missing("sandbox")),
            Better::Higher,
        ),
        &target("target_stream_4k_gbps")
            .map_or(String::new(), |t| format!("issue's target for 4 KiB: {t:.1} GB/s")),
    ));
    let ratio = size(small)
        .and_then(|r| num(r, "one_way_ratio"))
        .map(|v| Ours {
            value: v,
            interval: None,
            text: format!("{v:.3} (sandbox / the same channel between host threads, {small} B)"),
        })
        .ok_or_else(|| missing("sandbox"));
    rows.push(with_note(row("Table 2 analogue: cost under virtualization / without", Some(p::QV_T2_RATIO), ratio, Better::Lower),
        "paper: forkwait cycles, Quest-V / Quest; ours: channel one-way time, sandboxes / host threads"));
    // Table 2 itself: the syscall workload, as time (plain / sandbox
    // throughput), against forkwait's cycles.
    let t2 = s.map(|s| &s["table2"]).filter(|t| t.is_object());
    rows.push(with_note(
        row(
            "Table 2: syscall workload, time in a sandbox / in a plain VM",
            Some(p::QV_T2_RATIO),
            t2.and_then(|t| {
                let (m, lo, hi) =
                    (num(t, "ratio.median")?, num(t, "ratio.min")?, num(t, "ratio.max")?);
                Some(Ours {
                    value: 1.0 / m,
                    interval: Some((1.0 / hi, 1.0 / lo)),
                    text: format!(
                        "{:.3} [{:.3}, {:.3}] ({} repetitions)",
                        1.0 / m,
                        1.0 / hi,
                        1.0 / lo,
                        t["reps"]
                    ),
                })
            })
            .ok_or_else(|| "no bench sandbox result with part table2".to_string()),
            Better::Lower,
        ),
        "64 null syscalls per round through the guest kernel (emulated ring 0 on PVM), each with ring-3 work; issue's target within 2%",
    ));
    // Figs. 7 and 8: the largest page count up to 512, per series.
    let tlb = s.and_then(|s| s["tlb"]["rows"].as_array()).cloned().unwrap_or_default();
    for (access, fig) in [("load", "Fig. 7 (data)"), ("fetch", "Fig. 8 (instructions)")] {
        let r = tlb
            .iter()
            .filter(|r| r["access"].as_str().unwrap_or("load") == access)
            .filter(|r| r["pages"].as_u64().is_some_and(|p| p <= 512))
            .max_by_key(|r| r["pages"].as_u64());
        rows.push(with_note(
            row(
                format!("{fig}: time per access over N pages, sandbox / native"),
                None,
                r.and_then(|r| {
                    let o = spread(r, "ratio")?;
                    Some(Ours { text: format!("{} at {} pages", o.text, r["pages"]), ..o })
                })
                .ok_or_else(|| format!("no bench sandbox result with part tlb ({access})")),
                Better::Lower,
            ),
            "one access per page at a 4,160-byte stride; the paper's figures are plots; issue's target within 5% up to 512 pages",
        ));
    }
    let compute = d.get("bench").and_then(|b| {
        b["results"].as_array()?.iter().find(|r| r["workload"] == "compute").cloned()
    });
    let c = compute
        .as_ref()
        .and_then(|r| {
            let v = 1.0 / num(r, "ratio")?;
            let (lo, hi) = (1.0 / num(r, "ratio_ci95.1")?, 1.0 / num(r, "ratio_ci95.0")?);
            Some(Ours {
                value: v,
                interval: Some((lo, hi)),
                text: format!("{v:.3} [{lo:.3}, {hi:.3}] (compute, time in a VM / natively)"),
            })
        })
        .ok_or_else(|| missing("bench"));
    rows.push(with_note(
        row(
            "Table 2 analogue: compute time in a VM / native",
            Some(p::QV_T2_RATIO),
            c,
            Better::Lower,
        ),
        "guest ring 3 runs natively on PVM too",
    ));
    let t3 = s.map(|s| &s["table3"]).filter(|t| t.is_object());
    rows.push(with_note(
        row(
            "Table 3: ping round trip, RX interrupts multicast to all sharing sandboxes / to one",
            Some(p::QV_T3_RATIO),
            t3.and_then(|t| {
                let v = num(t, "rtt_ratio")?;
                let (m, pr) = (num(t, "multicast.rtt_median_ms.median")?, num(t, "private.rtt_median_ms.median")?);
                point(v, format!("{v:.3} (RTT median {m:.3} ms on a multicast shared TAP / {pr:.3} ms on a private TAP)")).ok()
            })
            .ok_or_else(|| "no bench sandbox result with part interrupts".to_string()),
            Better::Lower,
        ),
        &t3.map_or(String::new(), |t| {
            format!(
                "{} pings every {} ms, {} repetitions; {}RX interrupts pinged/neighbour: private {}/{}, multicast {}/{}; issue's target at most {}",
                t["pings"], t["interval_ms"], t["reps"],
                num(t, "demux_ratio").map_or(String::new(), |d| format!("shared TAP without multicast (demux) / private {d:.3}; ")),
                t["private"]["interrupts_pinged"]["median"], t["private"]["interrupts_neighbour"]["median"],
                t["multicast"]["interrupts_pinged"]["median"], t["multicast"]["interrupts_neighbour"]["median"],
                t["target_at_most"]
            )
        }),
    ));
    let f11 = s.map(|s| &s["fig11"]).filter(|f| f.is_object());
    let f11_rows = f11.and_then(|f| f["rows"].as_array()).cloned().unwrap_or_default();
    rows.push(with_note(
        row(
            "Fig. 11: UDP throughput through a shared TAP / private TAPs, worst of 1–4 sandboxes",
            None,
            f11_rows
                .iter()
                .filter_map(|r| Some((r["clients"].as_u64()?, num(r, "ratio")?)))
                .min_by(|a, b| a.1.total_cmp(&b.1))
                .and_then(|(k, v)| point(v, format!("{v:.3} (at {k} sandboxes)")).ok())
                .ok_or_else(|| "no bench sandbox result with part shared-driver".to_string()),
            Better::Higher,
        ),
        &format!(
            "paper Fig. 11 (plot only): Quest-V's shared NIC driver against Xen PVM/HVM and Linux, 1 to 4 netperf clients of 16 KB messages; ours per sandbox count: {}{}",
            f11_rows
                .iter()
                .map(|r| format!("{}: {:.3}", r["clients"], num(r, "ratio").unwrap_or(f64::NAN)))
                .collect::<Vec<_>>()
                .join(", "),
            f11.and_then(|f| num(f, "target_at_least"))
                .map_or(String::new(), |t| format!("; issue's target at least {t}"))
        ),
    ));
    let iso = s.map(|s| &s["isolation"]).filter(|i| i.is_object());
    rows.push(with_note(
        row(
            "Fig. 10: neighbours unaffected by a sandbox writing wildly",
            Some(p::QV_F10_ISOLATION),
            iso.map_or(Err(missing("sandbox")), |i| {
                share(
                    i["clean_seeds"].as_u64().unwrap_or(0),
                    i["seeds"].as_u64().unwrap_or(0),
                    "seeds clean",
                )
            }),
            Better::Higher,
        ),
        &iso.map_or(String::new(), |i| {
            format!(
                "changed bytes {}, read-only writes aimed {}, reported {}",
                i["changed_bytes"], i["aimed_readonly"], i["reported"]
            )
        }),
    ));
    // Budgets: a row from the sandbox bench's `budget` object when it has one.
    let budget = s.map(|s| &s["budget"]).filter(|b| b.is_object());
    rows.push(with_note(
        row(
            "Fig. 9 budgets: CPU share a budgeted sandbox gets (runtime / period)",
            Some(p::QV_F9_BUDGET),
            budget
                .and_then(|b| spread(b, "share"))
                .ok_or_else(|| "bench sandbox reports no budget row (docs/sandboxes.md, Budgets, has a manual measurement)".to_string()),
            Better::Higher,
        ),
        &budget.and_then(|b| num(b, "target")).map_or(String::new(), |t| format!("configured share {t:.3}")),
    ));
    // Recovery (bench sandbox-recovery): service gap per policy against
    // the paper's web server back in under 0.5 s.
    let rec = d.get("sandbox-recovery");
    let policies = rec.and_then(|r| r["policies"].as_array()).cloned().unwrap_or_default();
    for pol in &policies {
        let name = pol["policy"].as_str().unwrap_or("?");
        let secs = |k: &str| -> Option<(f64, f64, f64)> {
            Some((
                num(pol, &format!("{k}.median"))? / 1e3,
                num(pol, &format!("{k}.min"))? / 1e3,
                num(pol, &format!("{k}.max"))? / 1e3,
            ))
        };
        let runs = pol["runs"].as_array().map_or(0, Vec::len);
        let recovered = pol["runs"]
            .as_array()
            .map_or(0, |r| r.iter().filter(|x| x["recovered"] == true).count());
        let ours = secs("service_gap_ms")
            .map(|(m, lo, hi)| Ours {
                value: m,
                interval: Some((lo, hi)),
                text: format!("{m:.3} s [{lo:.3}–{hi:.3}], median of {runs}"),
            })
            .ok_or_else(|| missing("sandbox-recovery"));
        let det = num(pol, "detection_ms.median")
            .map_or(String::new(), |d| format!("detection {d:.1} ms; "));
        rows.push(with_note(
            row(format!("Fig. 6: service back after a fault in the serving sandbox, policy {name} (s)"), Some(p::QV_F6_RECOVERY), ours, Better::Lower),
            &if name == "remote" {
                format!("{det}taken over {recovered}/{runs}; paper: NIC driver fault under a web server, ours: the owner of an echo service fails and its standby takes its TAP, gap seen by a client pinging every 1 ms")
            } else {
                format!("{det}recovered {recovered}/{runs}; paper: NIC driver fault under a web server, ours: a fault in a channel service sandbox, gap seen by its peer")
            },
        ));
    }
    // Fig. 6 proper: a kv service's longest ping gap from the fault on,
    // with a ping every 1 ms and kvload running (bench sandbox-recovery).
    let fig6 = rec.and_then(|r| r["fig6"].as_array()).cloned().unwrap_or_default();
    for pol in &fig6 {
        let name = pol["policy"].as_str().unwrap_or("?");
        let runs = pol["runs"].as_array().map_or(0, Vec::len);
        let ours = (|| {
            let (m, lo, hi) = (
                num(pol, "ping_gap_ms.median")? / 1e3,
                num(pol, "ping_gap_ms.min")? / 1e3,
                num(pol, "ping_gap_ms.max")? / 1e3,
            );
            Some(Ours {
                value: m,
                interval: Some((lo, hi)),
                text: format!("{m:.3} s [{lo:.3}–{hi:.3}], median of {runs}"),
            })
        })()
        .ok_or_else(|| missing("sandbox-recovery"));
        let kv = num(pol, "kv_gap_ms.median")
            .map_or(String::new(), |k| format!("kv (TCP) gap {k:.0} ms; "));
        let lost: u64 = pol["runs"]
            .as_array()
            .map_or(0, |r| r.iter().filter_map(|x| x["kv_lost"].as_u64()).sum());
        // Output commit (rollback): replies held, median of the runs' medians.
        let mut held: Vec<f64> = pol["runs"].as_array().map_or(Vec::new(), |r| {
            r.iter().filter_map(|x| num(x, "output_commit.hold_ms_median")).collect()
        });
        held.sort_by(f64::total_cmp);
        let held = held.get(held.len() / 2).map_or(String::new(), |h| {
            format!("output commit: replies held {h:.0} ms (median of the runs' medians); ")
        });
        rows.push(with_note(
            row(format!("Fig. 6: longest ping gap of a kv service across a fault, policy {name} (s)"), Some(p::QV_F6_RECOVERY), ours, Better::Lower),
            &format!("{kv}{held}acknowledged kv writes lost over the runs: {lost}; ping every 1 ms and kvload beside it; target < 0.050 s (rollback < 0.020 s)"),
        ));
    }
    // Issue 19: acknowledged kv writes across many rollbacks with output
    // commit (bench sandbox-recovery --kv-rollbacks).
    // A list per release rule (an object in records written before).
    let kv_rollbacks: Vec<&Value> = match rec.map(|r| &r["kv_rollbacks"]) {
        Some(Value::Array(v)) => v.iter().collect(),
        Some(k) if k.is_object() => vec![k],
        _ => Vec::new(),
    };
    for k in kv_rollbacks {
        let n = num(k, "faults").unwrap_or(f64::NAN);
        let rule = k["policy"].as_str().unwrap_or("rollback");
        let ours = num(k, "kv_lost")
            .map(|lost| Ours { value: lost, interval: None, text: format!("{lost:.0}") })
            .ok_or_else(|| missing("sandbox-recovery"));
        rows.push(with_note(
            row(format!("Acknowledged kv writes lost across {n:.0} rollbacks (output commit, {rule})"), None, ours, Better::Lower),
            &format!(
                "{:.0} rollbacks, {:.0} kv ops ({:.0} PUTs), unverified {:.0}; replies held {:.0} ms median, {:.0} ms max; rollbacks past released output {:.0}; target 0",
                num(k, "rollbacks").unwrap_or(f64::NAN),
                num(k, "kv_ops").unwrap_or(f64::NAN),
                num(k, "kv_puts").unwrap_or(f64::NAN),
                num(k, "kv_unverified").unwrap_or(f64::NAN),
                num(k, "output_commit.hold_ms_median").unwrap_or(f64::NAN),
                num(k, "output_commit.hold_ms_max").unwrap_or(f64::NAN),
                num(k, "output_commit.rollbacks_past_released_output").unwrap_or(f64::NAN),
            ),
        ));
    }
    // Issue 19: acknowledged kv writes across many takeovers with the state
    // region (bench sandbox-recovery --kv-takeovers).
    if let Some(k) = rec.map(|r| &r["kv_takeovers"]).filter(|k| k.is_object()) {
        let n = num(k, "faults").unwrap_or(f64::NAN);
        let ours = num(k, "kv_lost")
            .map(|lost| Ours { value: lost, interval: None, text: format!("{lost:.0}") })
            .ok_or_else(|| missing("sandbox-recovery"));
        rows.push(with_note(
            row(format!("Acknowledged kv writes lost across {n:.0} takeovers (state region)"), None, ours, Better::Lower),
            &format!(
                "{:.0} takeovers ({:.0} ok), {:.0} kv ops ({:.0} PUTs), unverified {:.0}; table loads {:.0}, corrupt entries dropped {:.0}; target 0",
                num(k, "takeovers").unwrap_or(f64::NAN),
                num(k, "takeovers_ok").unwrap_or(f64::NAN),
                num(k, "kv_ops").unwrap_or(f64::NAN),
                num(k, "kv_puts").unwrap_or(f64::NAN),
                num(k, "kv_unverified").unwrap_or(f64::NAN),
                num(k, "table_loads").unwrap_or(f64::NAN),
                num(k, "table_dropped").unwrap_or(f64::NAN),
            ),
        ));
    }
    if policies.is_empty() {
        rows.push(row(
            "Fig. 6: service back after a fault in the serving sandbox (s)",
            Some(p::QV_F6_RECOVERY),
            Err(missing("sandbox-recovery")),
            Better::Lower,
        ));
    }
    // Table 1: the restart policy's phases (ms after detection).
    let restart = policies.iter().find(|p| p["policy"] == "restart");
    let phases = restart.and_then(|r| r["phases_ms"].as_array()).map(|ph| {
        ph.iter()
            .filter_map(|x| Some(format!("{} {:.1} ms", x[0].as_str()?, num(&x[1], "median")?)))
            .collect::<Vec<_>>()
            .join(", ")
    });
    rows.push(with_note(
        row(
            "Table 1: recovery phases of a faulty driver (restart; new VM ready, ms after detection)",
            None,
            restart
                .and_then(|r| r["phases_ms"].as_array())
                .and_then(|ph| ph.iter().find(|x| x[0] == "image"))
                .and_then(|x| {
                    let (m, lo, hi) = (num(&x[1], "median")?, num(&x[1], "min")?, num(&x[1], "max")?);
                    m.is_finite().then(|| Ours { value: m, interval: Some((lo, hi)), text: format!("{m:.1} ms [{lo:.1}–{hi:.1}]") })
                })
                .ok_or_else(|| missing("sandbox-recovery")),
            Better::Lower,
        ),
        &phases.map_or(String::new(), |p| format!("phases (median, ms after detection): {p}; the paper's Table 1 gives cycles per phase")),
    ));
    // Any further result of `bench sandbox` (rows other benches add later):
    // every object with a median, one level deep, as a row of its own.
    if let Some(obj) = s.and_then(Value::as_object) {
        for (k, v) in obj {
            if ["fig9", "isolation", "budget", "provenance"].contains(&k.as_str()) {
                continue;
            }
            let mut add = |label: String, x: &Value| {
                if let Some(o) = spread(x, "").or_else(|| {
                    let m = num(x, "median")?;
                    Some(Ours { value: m, interval: None, text: format!("{m:.3}") })
                }) {
                    rows.push(with_note(
                        row(label, None, Ok(o), Better::Lower),
                        "from bench sandbox (median [min–max])",
                    ));
                }
            };
            if v.get("median").is_some() {
                add(format!("bench sandbox: {k}"), v);
            } else if let Some(o) = v.as_object() {
                for (f, x) in o {
                    if x.get("median").is_some() {
                        add(format!("bench sandbox: {k}.{f}"), x);
                    }
                }
            } else if let Some(a) = v.as_array() {
                for x in a {
                    let label = x["name"].as_str().or_else(|| x["what"].as_str()).unwrap_or("row");
                    if let Some(o) = x.as_object() {
                        for (f, y) in o {
                            if y.get("median").is_some() {
                                add(format!("bench sandbox: {k} {label} {f}"), y);
                            }
                        }
                    }
                }
            }
        }
    }
    let mut figures = Vec::new();
    if !rows_j.is_empty() {
        let pts = |k: &str| -> Vec<(f64, f64)> {
            rows_j
                .iter()
                .filter_map(|r| {
                    Some(((r["size"].as_f64()?).log2(), num(r, &format!("{k}.median"))?))
                })
                .collect()
        };
        let series = vec![
            figures::Series { label: "sandboxes (VMs)".into(), points: pts("sandbox_one_way_ns") },
            figures::Series { label: "host threads".into(), points: pts("native_one_way_ns") },
        ];
        figures.push(figure(
            out,
            "fig-questv-fig9",
            "Paper Fig. 9 analogue: one-way message time against message size (medians)",
            &rows_j,
            |o| {
                figures::line_chart(
                    o,
                    "fig-questv-fig9",
                    "Paper Fig. 9 analogue: channel message time",
                    "log2(message bytes)",
                    "one-way ns (log)",
                    &series,
                )
            },
        )?);
        let cats: Vec<String> =
            rows_j.iter().filter_map(|r| r["size"].as_u64().map(|s| format!("{s} B"))).collect();
        let sp = |k: &str| -> Vec<Val> {
            rows_j
                .iter()
                .map(|r| {
                    Val::new(
                        num(r, &format!("{k}.median")).unwrap_or(f64::NAN),
                        num(r, &format!("{k}.min")).unwrap_or(f64::NAN),
                        num(r, &format!("{k}.max")).unwrap_or(f64::NAN),
                    )
                })
                .collect()
        };
        let bs = vec![
            BarSeries { label: "sandboxes".into(), values: sp("sandbox_stream_gbps") },
            BarSeries { label: "host threads".into(), values: sp("native_stream_gbps") },
        ];
        figures.push(figure(out, "fig-questv-stream", "Quest-V channel throughput analogue: streaming GB/s per message size (median, min–max)", &rows_j,
            |o| bars::grouped(o, "fig-questv-stream", "Channel streaming throughput", "Paper §4.5 analogue (Fig. 9 gives times only)", "GB/s", &cats, &bs, None))?);
    }
    Ok(Section {
        id: "questv",
        title: "Sandboxes: Quest-V".into(),
        paper: p::QUESTV,
        intro: format!("Two sandboxes (VMs) joined by a shared-memory channel, against the same channel code between two host threads; then a sandbox writing at random addresses beside a neighbour; then a fault in a serving sandbox under each recovery policy. The paper's Fig. 9 is a plot without numbers in its text (times grow linearly with message size), so its rows have no ratio. {}", cmd_list(&["sandbox", "sandbox-recovery"])),
        rows,
        figures,
    })
}

fn baseline(d: &Data, out: &Path) -> Result<Section> {
    let b = d.get("bench");
    let res = b.and_then(|b| b["results"].as_array()).cloned().unwrap_or_default();
    let mut rows = Vec::new();
    let mut cats = Vec::new();
    let mut vals = Vec::new();
    for r in res.iter().filter(|r| r["ratio"].is_number()) {
        let name = format!(
            "{}{}",
            r["workload"].as_str().unwrap_or("?"),
            r["pattern"].as_str().map_or(String::new(), |p| format!(" {p}"))
        );
        let (v, lo, hi) = (
            num(r, "ratio").unwrap_or(f64::NAN),
            num(r, "ratio_ci95.0").unwrap_or(f64::NAN),
            num(r, "ratio_ci95.1").unwrap_or(f64::NAN),
        );
        let mut x = row(
            format!("guest / native throughput, {name}"),
            None,
            Ok(Ours {
                value: v,
                interval: Some((lo, hi)),
                text: format!("{v:.3} [{lo:.3}, {hi:.3}] (n={})", r["guest"]["n"]),
            }),
            Better::Higher,
        );
        x.paper_missing = "(ninelives' own baseline)";
        rows.push(x);
        cats.push(name);
        vals.push(Val::new(v, lo, hi));
    }
    if let Some(m) = b.and_then(|b| num(b, "boot.median_ms")) {
        let (lo, hi) = (
            b.and_then(|b| num(b, "boot.min_ms")).unwrap_or(f64::NAN),
            b.and_then(|b| num(b, "boot.max_ms")).unwrap_or(f64::NAN),
        );
        let mut x = row(
            "boot to the first workload instruction (ms)",
            None,
            Ok(Ours {
                value: m,
                interval: Some((lo, hi)),
                text: format!("{m:.2} ms [{lo:.2}–{hi:.2}]"),
            }),
            Better::Lower,
        );
        x.paper_missing = "(ninelives' own baseline)";
        rows.push(x);
    }
    if rows.is_empty() {
        rows.push(row("guest / native throughput", None, Err(missing("bench")), Better::Higher));
    }
    let mut figures = Vec::new();
    if !cats.is_empty() {
        let s = vec![BarSeries { label: "guest / native".into(), values: vals }];
        figures.push(figure(out, "fig-baseline", "Guest / native throughput per workload (median of interleaved pairs, 95% bootstrap interval)", &res,
            |o| bars::grouped(o, "fig-baseline", "Guest / native throughput", "ninelives' virtualization overhead (no paper figure)", "ratio", &cats, &s, Some((1.0, "y = 1 (native)"))))?);
    }
    Ok(Section {
        id: "baseline",
        title: "Baseline: each workload in a VM against the same code natively".into(),
        paper: "ninelives (no paper)",
        intro: format!(
            "Interleaved native and guest runs of each workload. {}",
            cmd_list(&["bench"])
        ),
        rows,
        figures,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_reach_into_objects_and_arrays() {
        let v = json!({"a": {"b": [1, {"c": 2.5}]}});
        assert_eq!(num(&v, "a.b.1.c"), Some(2.5));
        assert_eq!(num(&v, "a.b.0"), Some(1.0));
        assert_eq!(num(&v, "a.x"), None);
        assert!(at(&v, "a.b.7").is_null());
    }

    #[test]
    fn no_data_gives_not_measured_rows_and_no_figures() {
        let dir = tempfile::tempdir().unwrap();
        let s = build(&Data::new(), dir.path()).unwrap();
        assert_eq!(s.len(), 6);
        assert!(s.iter().all(|s| s.figures.iter().all(|f| dir.path().join(&f.svg).exists())));
        assert!(s.iter().flat_map(|s| &s.rows).all(|r| r.ours.is_err()));
    }

    #[test]
    fn questv_has_recovery_rows_against_half_a_second_and_extra_sandbox_rows() {
        let dir = tempfile::tempdir().unwrap();
        let mut d = Data::new();
        let sm = |m: f64| json!({"median": m, "min": m * 0.5, "max": m * 2.0});
        d.insert(
            "sandbox-recovery".into(),
            json!({"policies": [
                {"policy": "restart", "service_gap_ms": sm(2000.0), "detection_ms": sm(2.0),
                 "phases_ms": [["image", sm(40.0)]], "runs": [{"recovered": true}]},
                {"policy": "rollback", "service_gap_ms": sm(250.0), "detection_ms": sm(7.0),
                 "phases_ms": [], "runs": [{"recovered": true}]},
                {"policy": "remote", "service_gap_ms": sm(30.0), "detection_ms": sm(1.0),
                 "phases_ms": [], "runs": [{"recovered": true}]}
            ]}),
        );
        d.insert(
            "sandbox".into(),
            json!({"fig9": {"rows": []}, "syscall": sm(900.0),
            "doorbell": {"round_trip_ns": sm(5000.0), "label": "x"},
            "table3": {"rtt_ratio": 1.004, "pings": 1000, "interval_ms": 3.0, "reps": 3,
                "target_at_most": 1.01,
                "private": {"rtt_median_ms": sm(0.5), "interrupts_pinged": sm(1000.0), "interrupts_neighbour": sm(20.0)},
                "multicast": {"rtt_median_ms": sm(0.502), "interrupts_pinged": sm(1000.0), "interrupts_neighbour": sm(900.0)}},
            "fig11": {"target_at_least": 0.9, "rows": [
                {"clients": 1, "ratio": 0.95}, {"clients": 2, "ratio": 0.85}, {"clients": 3, "ratio": 0.99}]},
            "table2": {"reps": 5, "ratio": {"median": 0.5, "min": 0.25, "max": 1.0}},
            "tlb": {"rows": [
                {"access": "load", "pages": 64, "ratio": sm(1.5)},
                {"access": "load", "pages": 512, "ratio": sm(1.02)},
                {"access": "load", "pages": 2048, "ratio": sm(3.0)},
                {"access": "fetch", "pages": 512, "ratio": sm(1.01)}]}}),
        );
        let s = questv(&d, dir.path()).unwrap();
        let find = |w: &str| {
            s.rows.iter().find(|r| r.what.contains(w)).unwrap_or_else(|| panic!("no row {w}"))
        };
        let remote = find("policy remote");
        assert_eq!(remote.ours.as_ref().unwrap().value, 0.03);
        assert!(remote.note.contains("standby takes its TAP"), "{}", remote.note);
        let restart = find("policy restart");
        assert_eq!(restart.ours.as_ref().unwrap().value, 2.0);
        assert_eq!(restart.paper.as_ref().unwrap().value, 0.5);
        let v = crate::report::html::verdict(
            restart.ours.as_ref().ok(),
            restart.paper.as_ref(),
            restart.better,
        );
        assert!(matches!(v, crate::report::html::Verdict::Behind(_)), "{v:?}");
        let rb = find("policy rollback");
        let v = crate::report::html::verdict(rb.ours.as_ref().ok(), rb.paper.as_ref(), rb.better);
        assert!(!matches!(v, crate::report::html::Verdict::Behind(_)), "{v:?}");
        assert_eq!(find("Table 1").ours.as_ref().unwrap().value, 40.0);
        let t3 = find("Table 3");
        assert_eq!(t3.ours.as_ref().unwrap().value, 1.004);
        assert!(t3.note.contains("multicast 1000.0/900.0"), "{}", t3.note);
        let f11 = find("Fig. 11");
        assert_eq!(f11.ours.as_ref().unwrap().value, 0.85);
        assert!(f11.ours.as_ref().unwrap().text.contains("at 2 sandboxes"));
        // Table 2 as time: plain / sandbox throughput, its interval inverted.
        let t2 = find("Table 2: syscall").ours.as_ref().unwrap();
        assert_eq!((t2.value, t2.interval), (2.0, Some((1.0, 4.0))));
        // Figs. 7/8: each series at its largest page count up to 512.
        let f7 = find("Fig. 7 (data)").ours.as_ref().unwrap();
        assert_eq!(f7.value, 1.02);
        assert!(f7.text.contains("at 512 pages"), "{}", f7.text);
        assert_eq!(find("Fig. 8 (instructions)").ours.as_ref().unwrap().value, 1.01);
        assert_eq!(find("bench sandbox: syscall").ours.as_ref().unwrap().value, 900.0);
        assert_eq!(
            find("bench sandbox: doorbell.round_trip_ns").ours.as_ref().unwrap().value,
            5000.0
        );
    }
}
