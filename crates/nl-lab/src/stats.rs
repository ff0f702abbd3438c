//! The lab's statistics, defined once: percentiles, the median, a summary
//! of repeated samples (median and spread), the Wilson score interval of a
//! proportion, and a bootstrap interval for the ratio of two medians.
//!
//! Percentiles interpolate linearly between the closest ranks (the
//! definition of NumPy's default and of R's type 7): `percentile(v, 0.5)`
//! of an even-sized sample is the mean of its two middle values.

use serde::Serialize;

/// z for a two-sided 95% interval.
const Z95: f64 = 1.959_964;

/// The `q`-quantile (0 ≤ q ≤ 1) of `v` (any order; NaN and infinite
/// values are left out);
/// NaN for an empty sample.
pub fn percentile(v: &[f64], q: f64) -> f64 {
    let mut s: Vec<f64> = v.iter().copied().filter(|x| x.is_finite()).collect();
    s.sort_by(f64::total_cmp);
    percentile_sorted(&s, q)
}

/// [`percentile`] of a sample already sorted ascending.
pub fn percentile_sorted(s: &[f64], q: f64) -> f64 {
    if s.is_empty() {
        return f64::NAN;
    }
    let pos = q.clamp(0.0, 1.0) * (s.len() - 1) as f64;
    let (lo, hi) = (pos.floor() as usize, pos.ceil() as usize);
    s[lo] + (s[hi] - s[lo]) * (pos - lo as f64)
}

/// The median of `v` (NaN if empty).
pub fn median(v: &[f64]) -> f64 {
    percentile(v, 0.5)
}

/// Repeated samples of one quantity: every sample, and the median with the
/// spread (min, max) the tables show.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Summary {
    pub n: usize,
    pub median: f64,
    pub min: f64,
    pub max: f64,
    pub samples: Vec<f64>,
}

impl Summary {
    pub fn of(samples: &[f64]) -> Summary {
        let finite = samples.iter().copied().filter(|x| x.is_finite());
        Summary {
            n: samples.len(),
            median: median(samples),
            min: finite.clone().fold(f64::NAN, f64::min),
            max: finite.fold(f64::NAN, f64::max),
            samples: samples.to_vec(),
        }
    }

    /// "median [min–max] (n=N)" with `digits` decimals.
    pub fn show(&self, digits: usize) -> String {
        format!(
            "{:.d$} [{:.d$}–{:.d$}] (n={})",
            self.median,
            self.min,
            self.max,
            self.n,
            d = digits
        )
    }
}

/// Wilson score interval (95%) for `k` successes out of `n` trials; (0, 1)
/// when there were no trials.
pub fn wilson(k: u64, n: u64) -> (f64, f64) {
    if n == 0 {
        return (0.0, 1.0);
    }
    let (n, p, z) = (n as f64, k as f64 / n as f64, Z95);
    let denom = 1.0 + z * z / n;
    let centre = (p + z * z / (2.0 * n)) / denom;
    let half = z * ((p * (1.0 - p) / n + z * z / (4.0 * n * n)).sqrt()) / denom;
    ((centre - half).max(0.0), (centre + half).min(1.0))
}

/// A ratio of two medians with its 95% bootstrap interval.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Ratio {
    pub ratio: f64,
    pub lo: f64,
    pub hi: f64,
}

impl Ratio {
    /// "ratio [lo, hi]" with `digits` decimals.
    pub fn show(&self, digits: usize) -> String {
        format!("{:.d$} [{:.d$}, {:.d$}]", self.ratio, self.lo, self.hi, d = digits)
    }
}

/// Resamplings of [`ratio_interval`].
pub const BOOTSTRAP_RESAMPLES: usize = 2000;

/// median(`num`) / median(`den`) and its 95% percentile-bootstrap interval:
/// both samples are resampled with replacement [`BOOTSTRAP_RESAMPLES`]
/// times (a fixed seed, so a result can be recomputed exactly), and the
/// interval is the 2.5th and 97.5th percentiles of the resampled ratios.
/// NaN everywhere when a sample is empty or the baseline's median is not
/// positive.
pub fn ratio_interval(num: &[f64], den: &[f64]) -> Ratio {
    let nan = Ratio { ratio: f64::NAN, lo: f64::NAN, hi: f64::NAN };
    let (m_num, m_den) = (median(num), median(den));
    if num.is_empty() || den.is_empty() || m_den.is_nan() || m_den <= 0.0 || m_num.is_nan() {
        return nan;
    }
    let mut rng = fastrand::Rng::with_seed(0x6e69_6e65_6c69_7665);
    let mut ratios = Vec::with_capacity(BOOTSTRAP_RESAMPLES);
    let mut a = vec![0.0; num.len()];
    let mut b = vec![0.0; den.len()];
    for _ in 0..BOOTSTRAP_RESAMPLES {
        a.iter_mut().for_each(|x| *x = num[rng.usize(..num.len())]);
        b.iter_mut().for_each(|x| *x = den[rng.usize(..den.len())]);
        let d = median(&b);
        if d > 0.0 {
            ratios.push(median(&a) / d);
        }
    }
    ratios.sort_by(f64::total_cmp);
    Ratio {
        ratio: m_num / m_den,
        lo: percentile_sorted(&ratios, 0.025),
        hi: percentile_sorted(&ratios, 0.975),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_interpolate_between_ranks() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
        assert_eq!(percentile(&[1.0, 2.0, 3.0, 4.0, 5.0], 0.25), 2.0);
        assert_eq!(percentile(&[10.0, 20.0], 0.99), 19.9);
        assert_eq!(percentile(&[7.0], 0.99), 7.0);
        assert!(median(&[]).is_nan());
        assert_eq!(median(&[f64::NAN, 1.0, f64::INFINITY, 3.0]), 2.0);
    }

    #[test]
    fn summary_keeps_samples_and_spread() {
        let s = Summary::of(&[3.0, 1.0, 2.0]);
        assert_eq!((s.n, s.median, s.min, s.max), (3, 2.0, 1.0, 3.0));
        assert_eq!(s.samples, vec![3.0, 1.0, 2.0]);
        assert_eq!(s.show(1), "2.0 [1.0–3.0] (n=3)");
    }

    #[test]
    fn wilson_interval() {
        let (lo, hi) = wilson(50, 100);
        assert!((lo - 0.4038).abs() < 1e-3 && (hi - 0.5962).abs() < 1e-3, "{lo} {hi}");
        assert_eq!(wilson(0, 0), (0.0, 1.0));
        let (lo, hi) = wilson(0, 10);
        assert_eq!(lo, 0.0);
        assert!((hi - 0.2775).abs() < 1e-3, "{hi}");
    }

    #[test]
    fn ratio_interval_brackets_the_ratio_and_narrows_with_agreement() {
        let r = ratio_interval(&[2.0, 2.2, 1.8, 2.1, 1.9], &[1.0, 1.1, 0.9, 1.0, 1.0]);
        assert!((r.ratio - 2.0).abs() < 1e-9);
        // Noisy samples: the interval strictly brackets the point estimate.
        assert!(r.lo < r.ratio && r.ratio < r.hi, "{r:?}");
        assert!(r.lo > 1.5 && r.hi < 2.5, "{r:?}");
        // Identical samples: no spread at all.
        let same = ratio_interval(&[3.0; 4], &[1.5; 4]);
        assert_eq!((same.ratio, same.lo, same.hi), (2.0, 2.0, 2.0));
        // Noisier samples give a wider interval.
        let wide = ratio_interval(&[1.0, 3.0, 2.0, 4.0, 0.5], &[1.0, 1.1, 0.9, 1.0, 1.0]);
        assert!(wide.hi - wide.lo > r.hi - r.lo, "{wide:?} vs {r:?}");
        assert!(ratio_interval(&[], &[1.0]).ratio.is_nan());
        assert!(ratio_interval(&[1.0], &[0.0]).ratio.is_nan());
    }
}
