//! `ninelives report`: the page written from committed step results
//! (`tests/fixtures/report/`) names every paper's figures and tables, every
//! file it links exists, and a real headless browser (Debian's chromium)
//! renders every figure.

use crate::common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{skip, Prereq};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/report")
}

/// Writes the report from the fixtures into a new temporary directory.
fn write_report() -> tempfile::TempDir {
    let out = tempfile::tempdir().unwrap();
    let o = common::run_cli(&[
        "report",
        "--from",
        fixtures().to_str().unwrap(),
        "--out",
        out.path().to_str().unwrap(),
    ]);
    assert!(o.status.success(), "report failed: {}", common::stderr(&o));
    out
}

/// The values of every `attr="..."` in `html`.
fn attr_values(html: &str, attr: &str) -> Vec<String> {
    let key = format!("{attr}=\"");
    html.split(&key).skip(1).filter_map(|s| s.split('"').next().map(String::from)).collect()
}

/// Every figure the report must draw from the fixtures.
const FIGURES: &[&str] = &[
    "fig-nilihype-fig2",
    "fig-nilihype-outcomes",
    "fig-nilihype-latency",
    "fig-nilihype-fig3",
    "fig-warm-fig8",
    "fig-warm-model",
    "fig-ucheckpoint-fig3-memwrite-random",
    "fig-hbft-fig9",
    "fig-hbft-fig11",
    "fig-hbft-fig13",
    "fig-questv-fig9",
    "fig-questv-stream",
    "fig-baseline",
];

/// The papers' items the page must show, each beside ours.
const ITEMS: &[&str] = &[
    "Table I:",
    "Fig. 2:",
    "Table II:",
    "Table III:",
    "Fig. 3: normal-operation overhead",
    "Fig. 8(a)",
    "§5.6 model",
    "Fig. 3: normalized execution time",
    "Fig. 4 analogue",
    "checkpoint size at 50 ms",
    "rollback (recovery) time",
    "Fig. 9:",
    "Fig. 10:",
    "Fig. 11:",
    "Fig. 12:",
    "Fig. 13:",
    "Table 2 analogue: software-superpage",
    "Fig. 9: one-way message time",
    "Fig. 10: neighbours unaffected",
];

#[test]
fn report_from_results_names_every_figure_and_links_only_existing_files() {
    let out = write_report();
    let html = std::fs::read_to_string(out.path().join("index.html")).unwrap();
    for f in FIGURES {
        assert!(html.contains(&format!("<img src=\"{f}.svg\"")), "figure {f} is not on the page");
        assert!(html.contains(&format!("href=\"{f}.json\"")), "figure {f} has no data link");
    }
    for item in ITEMS {
        assert!(html.contains(item), "the page has no row for {item}");
    }
    // Every local file the page points at exists.
    let mut links = attr_values(&html, "src");
    links.extend(attr_values(&html, "href").into_iter().filter(|h| !h.starts_with('#')));
    assert!(links.len() >= 2 * FIGURES.len(), "{links:?}");
    for l in &links {
        assert!(!l.contains("://"), "link {l} leaves the report directory");
        assert!(out.path().join(l).is_file(), "the page links {l}, which was not written");
    }
    // The machine and the verdicts.
    for needle in
        ["KVM backend", "load average", "git revision", "ahead ×", "behind ×", "not measured"]
    {
        assert!(html.contains(needle), "no {needle:?} on the page");
    }
}

#[test]
fn report_refuses_a_step_result_that_is_not_json() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("bench.json"), "{ not json").unwrap();
    let o = common::run_cli(&[
        "report",
        "--from",
        dir.path().to_str().unwrap(),
        "--out",
        dir.path().join("r").to_str().unwrap(),
    ]);
    common::assert_clean_error(&o, "bench.json: not JSON");
    let o = common::run_cli(&["report", "--only", "nosuchstep"]);
    common::assert_clean_error(&o, "no step named \"nosuchstep\"");
}

/// Debian's chromium (or another Chromium build), if installed.
fn chromium() -> Option<PathBuf> {
    ["chromium", "chromium-browser", "google-chrome"].iter().find_map(|b| {
        std::env::var_os("PATH")?
            .to_str()?
            .split(':')
            .map(|d| Path::new(d).join(b))
            .find(|p| p.is_file())
    })
}

/// The page's DOM after chromium loaded it and ran its scripts.
fn dump_dom(browser: &Path, page: &Path) -> String {
    let profile = tempfile::tempdir().unwrap();
    let mut child = Command::new(browser)
        .args(["--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=10000"])
        .arg(format!("--user-data-dir={}", profile.path().display()))
        .arg("--dump-dom")
        .arg(format!("file://{}", page.display()))
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("chromium starts");
    let mut stdout = child.stdout.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        std::io::Read::read_to_string(&mut stdout, &mut s).map(|_| s)
    });
    let t = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if t.elapsed() > Duration::from_secs(120) {
            let _ = child.kill();
            let _ = child.wait();
            panic!("chromium did not finish within 120 s");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    reader.join().unwrap().unwrap()
}

/// (loaded, broken) as the page's script counted them.
fn render_counts(dom: &str) -> (usize, usize) {
    let el = dom.split("id=\"render-check\"").nth(1).expect("no #render-check in the DOM");
    let tag = el.split('>').next().unwrap();
    let n = |k: &str| -> usize {
        attr_values(tag, k)
            .first()
            .unwrap_or_else(|| panic!("no {k} on #render-check: the script did not run: {tag}"))
            .parse()
            .unwrap()
    };
    (n("data-loaded"), n("data-broken"))
}

#[test]
fn report_renders_every_figure_in_a_headless_browser() {
    let Some(browser) = chromium() else {
        skip(Prereq::Browser, "no chromium on PATH (apt-get install chromium)");
        return;
    };
    let out = write_report();
    let page = out.path().join("index.html");
    let images = std::fs::read_to_string(&page).unwrap().matches("<img ").count();
    assert!(images >= FIGURES.len(), "{images} images on the page");
    let dom = dump_dom(&browser, &page);
    let (loaded, broken) = render_counts(&dom);
    assert_eq!((loaded, broken), (images, 0), "figures loaded/broken in chromium");
    assert_eq!(dom.matches("data-state=\"loaded\"").count(), images);
    // The check itself can fail: with one SVG gone, chromium reports it broken.
    std::fs::remove_file(out.path().join("fig-hbft-fig9.svg")).unwrap();
    let dom = dump_dom(&browser, &page);
    assert_eq!(render_counts(&dom), (images - 1, 1), "a missing figure must show as broken");
}
