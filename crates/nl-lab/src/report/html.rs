//! The report page: the machine, a summary, and per paper a table of its
//! numbers beside ours (each row classified ahead / behind / level) and
//! the figures, each with the JSON behind it.

use std::fmt::Write;

use super::papers::{Better, Quoted};
use super::Machine;

/// Our number in a row.
#[derive(Clone, Debug)]
pub struct Ours {
    pub value: f64,
    /// A 95% interval (Wilson, bootstrap) or the spread (min–max) of the
    /// repetitions; `None` for a single measurement.
    pub interval: Option<(f64, f64)>,
    /// How it is shown, with its unit and sample size.
    pub text: String,
}

/// One row: a quantity of a paper, its number and ours.
#[derive(Clone, Debug)]
pub struct Row {
    pub what: String,
    pub paper: Option<Quoted>,
    /// Why there is no paper number (e.g. "bars only, not in the text").
    pub paper_missing: &'static str,
    /// Ours, or why there is none.
    pub ours: Result<Ours, String>,
    pub better: Better,
    pub note: String,
}

/// A figure: the SVG file and the JSON behind it (names relative to the
/// report directory), and its caption naming the paper's figure.
#[derive(Clone, Debug)]
pub struct Figure {
    pub svg: String,
    pub json: String,
    pub caption: String,
}

/// One paper's part of the report.
#[derive(Clone, Debug)]
pub struct Section {
    pub id: &'static str,
    pub title: String,
    pub paper: &'static str,
    /// What we ran, in a sentence or two, with the steps' commands.
    pub intro: String,
    pub rows: Vec<Row>,
    pub figures: Vec<Figure>,
}

/// Where a row stands.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Verdict {
    /// Better than the paper by this factor (≥ 1).
    Ahead(f64),
    /// Worse than the paper by this factor (≥ 1).
    Behind(f64),
    /// The paper's number is inside our interval.
    Level,
    /// No better direction: ours / paper.
    Ratio(f64),
    NotMeasured,
    NoPaperNumber,
}

/// Classifies `ours` against `paper`: level when the paper's number is
/// inside our interval, otherwise ahead or behind by the ratio of the
/// point values (ours/paper when higher is better, paper/ours when lower
/// is), always stated as a factor ≥ 1.
pub fn verdict(ours: Option<&Ours>, paper: Option<&Quoted>, better: Better) -> Verdict {
    let Some(o) = ours.filter(|o| o.value.is_finite()) else {
        return Verdict::NotMeasured;
    };
    let Some(p) = paper else {
        return Verdict::NoPaperNumber;
    };
    if let Some((lo, hi)) = o.interval {
        if lo <= p.value && p.value <= hi {
            return Verdict::Level;
        }
    }
    if o.value == p.value {
        return Verdict::Level;
    }
    let r = match better {
        Better::Higher | Better::Neither => o.value / p.value,
        Better::Lower => p.value / o.value,
    };
    match better {
        Better::Neither => Verdict::Ratio(o.value / p.value),
        _ if r >= 1.0 => Verdict::Ahead(r),
        _ => Verdict::Behind(1.0 / r),
    }
}

fn factor(r: f64) -> String {
    if r.is_infinite() {
        "(the paper's number is 0)".into()
    } else if r >= 100.0 {
        format!("×{r:.0}")
    } else {
        format!("×{r:.2}")
    }
}

/// The verdict's words and CSS class.
pub fn verdict_text(v: Verdict) -> (String, &'static str) {
    match v {
        Verdict::Ahead(r) => (format!("ahead {}", factor(r)), "ahead"),
        Verdict::Behind(r) => (format!("behind {}", factor(r)), "behind"),
        Verdict::Level => ("level (the paper's number is inside our interval)".into(), "level"),
        Verdict::Ratio(r) => {
            (format!("{} of the paper's (no better direction)", factor(r)), "ratio")
        }
        Verdict::NotMeasured => ("not measured".into(), "nm"),
        Verdict::NoPaperNumber => ("no number in the paper's text".into(), "nm"),
    }
}

/// Whether an interval is wide: its width over a third of the value's
/// scale (a small campaign's interval), shown as such.
pub fn is_wide(o: &Ours) -> bool {
    match o.interval {
        Some((lo, hi)) => {
            let scale = o.value.abs().max(if o.value.abs() <= 1.0 { 1.0 } else { 0.0 });
            hi - lo > scale / 3.0
        }
        None => false,
    }
}

/// `s` with `&`, `<`, `>`, `"` escaped for HTML text and attributes.
pub fn esc(s: &str) -> String {
    let mut o = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => o.push_str("&amp;"),
            '<' => o.push_str("&lt;"),
            '>' => o.push_str("&gt;"),
            '"' => o.push_str("&quot;"),
            c => o.push(c),
        }
    }
    o
}

const STYLE: &str = "body{font-family:sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;line-height:1.4}\
table{border-collapse:collapse;margin:1em 0;font-size:14px}td,th{border:1px solid #ccc;padding:4px 8px;vertical-align:top}\
th{background:#f3f3f3}.ahead{background:#e3f6e3}.behind{background:#fbe4e4}.level{background:#eef}\
.nm{color:#777}.wide{color:#a60}figure{margin:1.5em 0}figure img{max-width:100%;border:1px solid #ddd}\
figcaption{font-size:14px}code{background:#f6f6f6}";

/// The script the headless-browser test relies on: once the page has
/// loaded, every `<img>` gets `data-state="loaded"` (decoded, non-zero
/// size) or `"broken"`, and `#render-check` says how many of each.
const CHECK_SCRIPT: &str = "window.addEventListener('load',function(){var ok=0,bad=0;\
document.querySelectorAll('img').forEach(function(i){var g=i.complete&&i.naturalWidth>0;\
i.setAttribute('data-state',g?'loaded':'broken');if(g){ok++}else{bad++}});\
var e=document.getElementById('render-check');e.textContent='figures loaded: '+ok+', broken: '+bad;\
e.setAttribute('data-loaded',ok);e.setAttribute('data-broken',bad);});";

/// The whole page.
pub fn page(m: &Machine, sections: &[Section], measured_here: bool) -> String {
    let mut h = String::new();
    let _ = write!(
        h,
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>ninelives report</title>\
         <style>{STYLE}</style><script>{CHECK_SCRIPT}</script></head><body>\n<h1>ninelives: the papers' results and ours</h1>\n"
    );
    // The machine.
    let _ = write!(
        h,
        "<h2 id=\"machine\">Machine</h2>\n<table>\
         <tr><th>CPU</th><td>{}</td></tr><tr><th>cores</th><td>{}</td></tr>\
         <tr><th>memory</th><td>{:.1} GiB</td></tr><tr><th>kernel</th><td>{}</td></tr>\
         <tr><th>KVM backend</th><td>{}</td></tr>\
         <tr><th>load average before / after</th><td>{} / {}</td></tr>\
         <tr><th>git revision</th><td>{}</td></tr><tr><th>date</th><td>{}</td></tr>\
         <tr><th>size</th><td>{}{}</td></tr></table>\n",
        esc(&m.cpu),
        m.cores,
        m.mem_gib,
        esc(&m.kernel),
        esc(&m.kvm_backend),
        esc(&m.loadavg_before),
        esc(&m.loadavg_after),
        esc(&m.git_revision),
        esc(&m.date),
        esc(&m.size),
        if m.elapsed_s > 0.0 {
            format!(", measured in {:.1} min", m.elapsed_s / 60.0)
        } else {
            String::new()
        }
    );
    if !m.steps.is_empty() {
        h.push_str("<table><tr><th>step</th><th>command</th><th>seconds</th><th>result</th><th>load average before / after</th></tr>\n");
        let order = super::steps::STEPS.iter().map(|s| s.name);
        for name in order.filter(|n| m.steps.contains_key(*n)) {
            let r = &m.steps[name];
            let _ = writeln!(
                h,
                "<tr><td>{name}</td><td><code>{}</code></td><td>{:.0}</td><td>{}</td><td>{} / {}</td></tr>",
                esc(&r.command),
                r.elapsed_s,
                if r.exit_ok { "ok" } else { "failed or stopped (see the rows it feeds)" },
                esc(&r.loadavg_before),
                esc(&r.loadavg_after)
            );
        }
        h.push_str("</table>\n");
    }
    if !measured_here {
        h.push_str("<p>The results were read from an earlier run (<code>--from</code>); the machine above is the one that measured them where <code>machine.json</code> was given.</p>\n");
    }
    // The summary.
    let rows: Vec<(&Row, Verdict)> = sections
        .iter()
        .flat_map(|s| s.rows.iter())
        .map(|r| (r, verdict(r.ours.as_ref().ok(), r.paper.as_ref(), r.better)))
        .collect();
    let count = |f: &dyn Fn(Verdict) -> bool| rows.iter().filter(|(_, v)| f(*v)).count();
    let ahead = count(&|v| matches!(v, Verdict::Ahead(_)));
    let behind = count(&|v| matches!(v, Verdict::Behind(_)));
    let level = count(&|v| matches!(v, Verdict::Level));
    let ratio = count(&|v| matches!(v, Verdict::Ratio(_)));
    let nm = count(&|v| v == Verdict::NotMeasured);
    let np = count(&|v| v == Verdict::NoPaperNumber);
    let wide = rows.iter().filter(|(r, _)| r.ours.as_ref().is_ok_and(is_wide)).count();
    let figures: usize = sections.iter().map(|s| s.figures.len()).sum();
    let _ = write!(
        h,
        "<h2 id=\"summary\">Summary</h2>\n<p>{} rows over {} papers: ahead of the paper in {ahead}, behind in {behind}, \
         level (the paper's number inside our interval) in {level}, {ratio} without a better direction, \
         {np} with no number in the paper's text (ours shown alone), and {nm} not measured; {figures} figures. \
         The papers ran on dedicated servers (Xen on Nehalem and Core 2 machines, SPEC and Apache workloads); \
         ninelives runs its own synthetic workloads on the machine above, a {}-core {} host shared with other work, \
         so a ratio says where we stand, not that the systems were compared on equal terms. \
         Intervals are 95% (Wilson for shares of campaign runs, bootstrap for ratios of medians) or the min–max spread \
         of the repetitions; {wide} rows have a <span class=\"wide\">wide</span> interval, from a small campaign{}, which says how little they pin down.</p>\n",
        rows.len(),
        sections.len(),
        m.cores,
        esc(&m.kvm_backend),
        if m.size == "quick" { " (this is a --quick run)" } else { "" }
    );
    let _ = writeln!(h, "<p id=\"render-check\">figures not checked (scripts off)</p>");
    h.push_str("<ul>");
    for s in sections {
        let _ = write!(h, "<li><a href=\"#{}\">{}</a></li>", s.id, esc(&s.title));
    }
    h.push_str("<li><a href=\"data/machine.json\">machine.json</a></li></ul>\n");
    for s in sections {
        section(&mut h, s);
    }
    h.push_str("</body></html>\n");
    h
}

fn section(h: &mut String, s: &Section) {
    let _ = write!(
        h,
        "<h2 id=\"{}\">{}</h2>\n<p><em>{}</em></p>\n<p>{}</p>\n<table><tr><th>quantity</th><th>paper</th><th>ours</th><th>where we stand</th><th>note</th></tr>\n",
        s.id,
        esc(&s.title),
        esc(s.paper),
        s.intro
    );
    for r in &s.rows {
        let v = verdict(r.ours.as_ref().ok(), r.paper.as_ref(), r.better);
        let (words, class) = verdict_text(v);
        let paper = match &r.paper {
            Some(p) => format!("{} <small>({})</small>", esc(p.text), esc(p.cite)),
            None => format!("<span class=\"nm\">{}</span>", esc(r.paper_missing)),
        };
        let ours = match &r.ours {
            Ok(o) if is_wide(o) => {
                format!("<span class=\"wide\">{} (wide: small sample)</span>", esc(&o.text))
            }
            Ok(o) => esc(&o.text),
            Err(why) => format!("<span class=\"nm\">not measured: {}</span>", esc(why)),
        };
        let _ = writeln!(
            h,
            "<tr class=\"{class}\"><td>{}</td><td>{paper}</td><td>{ours}</td><td>{}</td><td>{}</td></tr>",
            esc(&r.what),
            esc(&words),
            esc(&r.note)
        );
    }
    h.push_str("</table>\n");
    for f in &s.figures {
        let _ = writeln!(
            h,
            "<figure><img src=\"{}\" alt=\"{}\"><figcaption>{} (<a href=\"{}\">SVG</a>, <a href=\"{}\">data</a>)</figcaption></figure>",
            esc(&f.svg),
            esc(&f.caption),
            esc(&f.caption),
            esc(&f.svg),
            esc(&f.json)
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ours(value: f64, interval: Option<(f64, f64)>) -> Ours {
        Ours { value, interval, text: format!("{value}") }
    }

    const P: Quoted = Quoted { value: 2.0, text: "2", cite: "Table X" };

    #[test]
    fn rows_are_ahead_behind_or_level_by_the_right_factor() {
        assert_eq!(verdict(Some(&ours(4.0, None)), Some(&P), Better::Higher), Verdict::Ahead(2.0));
        assert_eq!(verdict(Some(&ours(1.0, None)), Some(&P), Better::Higher), Verdict::Behind(2.0));
        // Lower is better: a smaller number of ours is ahead.
        assert_eq!(verdict(Some(&ours(1.0, None)), Some(&P), Better::Lower), Verdict::Ahead(2.0));
        assert_eq!(verdict(Some(&ours(8.0, None)), Some(&P), Better::Lower), Verdict::Behind(4.0));
        // The paper's number inside our interval: level, whatever the point value.
        assert_eq!(
            verdict(Some(&ours(3.0, Some((1.5, 3.5)))), Some(&P), Better::Higher),
            Verdict::Level
        );
        // Outside the interval: classified by the point values.
        assert_eq!(
            verdict(Some(&ours(3.0, Some((2.5, 3.5)))), Some(&P), Better::Higher),
            Verdict::Ahead(1.5)
        );
        assert_eq!(verdict(Some(&ours(3.0, None)), Some(&P), Better::Neither), Verdict::Ratio(1.5));
        assert_eq!(verdict(None, Some(&P), Better::Higher), Verdict::NotMeasured);
        assert_eq!(
            verdict(Some(&ours(f64::NAN, None)), Some(&P), Better::Higher),
            Verdict::NotMeasured
        );
        assert_eq!(verdict(Some(&ours(1.0, None)), None, Better::Higher), Verdict::NoPaperNumber);
        assert_eq!(verdict_text(Verdict::Behind(2.0)).0, "behind ×2.00");
        assert_eq!(verdict_text(Verdict::Ahead(2.5)).1, "ahead");
    }

    #[test]
    fn wide_intervals_are_flagged() {
        assert!(is_wide(&ours(0.5, Some((0.2, 0.8)))));
        assert!(!is_wide(&ours(0.5, Some((0.45, 0.55)))));
        assert!(!is_wide(&ours(100.0, Some((90.0, 110.0)))));
        assert!(is_wide(&ours(100.0, Some((50.0, 150.0)))));
        assert!(!is_wide(&ours(1.0, None)));
    }

    #[test]
    fn page_names_every_row_figure_and_verdict_escaped() {
        let s = Section {
            id: "nilihype",
            title: "NiLiHype <recovery>".into(),
            paper: "paper",
            intro: "we ran <code>x</code>".into(),
            rows: vec![
                Row {
                    what: "rate & more".into(),
                    paper: Some(P),
                    paper_missing: "",
                    ours: Ok(ours(1.0, None)),
                    better: Better::Higher,
                    note: String::new(),
                },
                Row {
                    what: "latency".into(),
                    paper: Some(P),
                    paper_missing: "",
                    ours: Err("no bench".into()),
                    better: Better::Lower,
                    note: String::new(),
                },
            ],
            figures: vec![Figure {
                svg: "fig-a.svg".into(),
                json: "fig-a.json".into(),
                caption: "Paper Fig. 2 analogue".into(),
            }],
        };
        let m = Machine { cpu: "cpu".into(), kvm_backend: "PVM".into(), ..Machine::default() };
        let p = page(&m, &[s], true);
        assert!(p.contains("NiLiHype &lt;recovery&gt;") && p.contains("rate &amp; more"));
        assert!(p.contains("<img src=\"fig-a.svg\"") && p.contains("href=\"fig-a.json\""));
        assert!(p.contains("behind ×2.00") && p.contains("not measured: no bench"));
        assert!(p.contains("Paper Fig. 2 analogue") && p.contains("PVM"));
        assert!(p.contains("ahead of the paper in 0, behind in 1") && p.contains("1 not measured"));
        assert!(p.contains("id=\"render-check\""));
    }
}
