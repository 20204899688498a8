//! Token selection from logits: greedy, or seeded sampling with temperature, top-k and top-p
//! (the order transformers applies its warpers in).

use crate::error::RunError;
use crate::runtime::GenerateParams;

/// Candidates beyond top-k a GPU pass returns: room for values that the division by the
/// temperature makes equal at the k-th place (ties are then broken by id, not by the raw logit).
const TIE_MARGIN: usize = 8;

/// Candidates a GPU pass returns for sampling without top-k (top-p, or the temperature alone):
/// the top-p nucleus, or the draw, must fall among them, else the whole row decides.
const NO_TOP_K_CANDIDATES: usize = 64;

/// How close (in probability) a top-p cut-off or a draw may come to a boundary and still be
/// decided from the GPU's softmax mass: that mass is summed in f32 over blocks of 4,096 f32
/// exponentials (relative error about 1e-6, below 1e-5 for any row), so a margin of 1e-4 makes
/// the decision the same as the whole row's f64 sums; closer cases go to the whole row.
const MASS_MARGIN: f64 = 1e-4;

/// Temperatures below this are greedy: dividing logits by a smaller one overflows f32 for
/// ordinary logits (1e-40, a subnormal, turns every logit above 3.4e-2 into +inf and the
/// softmax into NaN) and the distribution it stands for is the argmax anyway (at 1e-5 a logit gap
/// of 1e-3 is already a factor e^100).
pub const MIN_TEMPERATURE: f32 = 1e-5;

/// (id, logit) pairs, best first.
pub(crate) type Candidates = Vec<(u32, f32)>;

/// A small deterministic PRNG (SplitMix64) so that a seed reproduces a generation.
#[derive(Clone, Debug)]
pub(crate) struct SplitMix64(pub(crate) u64);

impl SplitMix64 {
    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub(crate) fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Chooses the next token.
#[derive(Clone, Debug)]
pub struct Sampler {
    repetition_penalty: f32,
    temperature: f32,
    top_k: usize,
    top_p: f32,
    rng: SplitMix64,
}

impl Sampler {
    /// `temperature == 0` is greedy (argmax, first index on ties), and so is any temperature
    /// below [`MIN_TEMPERATURE`]; `top_k == 0` and `top_p == 1` disable those filters.
    pub fn new(temperature: f32, top_k: usize, top_p: f32, seed: u64) -> Result<Self, RunError> {
        if !temperature.is_finite() || temperature < 0.0 {
            return Err(RunError::BadParam { name: "temperature", value: temperature.to_string(), expected: ">= 0" });
        }
        let temperature = if temperature < MIN_TEMPERATURE { 0.0 } else { temperature };
        if !(top_p > 0.0 && top_p <= 1.0) {
            return Err(RunError::BadParam { name: "top_p", value: top_p.to_string(), expected: "in (0, 1]" });
        }
        Ok(Self { repetition_penalty: 1.0, temperature, top_k, top_p, rng: SplitMix64(seed) })
    }

    /// The sampler a [`GenerateParams`] describes.
    pub fn from_params(p: &GenerateParams) -> Result<Self, RunError> {
        if !(p.repetition_penalty.is_finite() && p.repetition_penalty > 0.0) {
            return Err(RunError::BadParam {
                name: "repetition_penalty",
                value: p.repetition_penalty.to_string(),
                expected: "> 0",
            });
        }
        let mut s = Self::new(p.temperature, p.top_k, p.top_p, p.seed)?;
        s.repetition_penalty = p.repetition_penalty;
        Ok(s)
    }

    /// Pick a token after applying the repetition penalty to the ids in `history`
    /// (transformers' rule: positive logits are divided by the penalty, negative multiplied, once
    /// per distinct id however often it occurs); an empty row is a `BadParam` error.
    pub fn sample_after(&mut self, logits: &[f32], history: &[u32]) -> Result<u32, RunError> {
        let l = self.penalized_row(logits, history);
        self.sample(&l)
    }

    /// The distribution [`Sampler::sample_after`] draws from: the tokens it keeps after the
    /// repetition penalty, the temperature, top-k and top-p (best first, ties by id), each with
    /// its probability (the kept weights renormalised; one token with probability 1 when greedy).
    /// The random state is not touched.
    pub fn distribution(&self, logits: &[f32], history: &[u32]) -> Result<Vec<(u32, f64)>, RunError> {
        let l = self.penalized_row(logits, history);
        let Some(cand) = self.scaled(&l)? else {
            return Ok(vec![(argmax(&l), 1.0)]);
        };
        let (kept, w, total) = self.kept(cand);
        Ok(kept.iter().zip(w).map(|(&(id, _), w)| (id, w / total)).collect())
    }

    /// `logits` with the repetition penalty applied to the distinct ids in `history`.
    fn penalized_row<'a>(&self, logits: &'a [f32], history: &[u32]) -> std::borrow::Cow<'a, [f32]> {
        if !self.penalizes() {
            return std::borrow::Cow::Borrowed(logits);
        }
        let mut l = logits.to_vec();
        let distinct: std::collections::BTreeSet<u32> = history.iter().copied().collect();
        for id in distinct {
            if let Some(v) = l.get_mut(id as usize) {
                *v = self.penalized(*v);
            }
        }
        std::borrow::Cow::Owned(l)
    }

    fn penalized(&self, v: f32) -> f32 {
        if v > 0.0 {
            v / self.repetition_penalty
        } else {
            v * self.repetition_penalty
        }
    }

    /// Whether the sampler reads the history (a repetition penalty other than 1).
    pub(crate) fn penalizes(&self) -> bool {
        self.repetition_penalty != 1.0
    }

    /// How many candidates a GPU pass must hand [`Sampler::sample_candidates`] for a choice over
    /// `vocab` logits (at most `max`), when this sampler can choose from candidates at all: with
    /// top-k, `TIE_MARGIN` more than k; without, `NO_TOP_K_CANDIDATES` and the row's softmax
    /// mass ([`Sampler::needs_mass`]).
    pub(crate) fn gpu_candidates(&self, vocab: usize, max: usize) -> Option<usize> {
        if self.temperature == 0.0 {
            return None;
        }
        let k = if self.top_k > 0 {
            self.top_k.saturating_add(TIE_MARGIN)
        } else {
            NO_TOP_K_CANDIDATES.min(max).min(vocab)
        };
        (k > 0 && k <= max && k <= vocab).then_some(k)
    }

    /// Whether the candidates need the row's softmax mass beside them (sampling without top-k),
    /// and at which inverse temperature the GPU sums it.
    pub(crate) fn needs_mass(&self) -> Option<f32> {
        (self.temperature > 0.0 && self.top_k == 0).then(|| 1.0 / self.temperature)
    }

    /// The choice [`Sampler::sample_after`] makes, from the GPU's candidates: `cands` are the
    /// best (id, logit) pairs of the tokens outside the history in `sample`'s order, `history`
    /// the distinct history ids (ascending) with their logits, and without top-k `masses` the
    /// row's softmax mass outside the history per block of logits (`(m, s)`, `s = Σ exp((l − m) ·
    /// inv_t)` at [`Sampler::needs_mass`]'s inverse temperature). `None` (nothing drawn) when the
    /// candidates cannot decide: a history id or an id past the vocabulary among them; with
    /// top-k, the last candidate tying the k-th after the division by the temperature; without,
    /// the top-p nucleus or the draw reaching past the candidates or within `MASS_MARGIN` of a
    /// boundary (then the caller samples from the whole row, with the same random draw).
    pub(crate) fn sample_candidates(
        &mut self,
        cands: &[(u32, f32)],
        history: &[(u32, f32)],
        vocab: usize,
        masses: &[(f32, f32)],
    ) -> Option<u32> {
        let in_history = |id: u32| history.binary_search_by_key(&id, |&(h, _)| h).is_ok();
        let last = cands.last()?;
        if cands.iter().any(|&(id, _)| id as usize >= vocab || in_history(id)) {
            return None;
        }
        let t = self.temperature;
        let hist: Vec<f32> = history.iter().map(|&(_, l)| self.penalized(l) / t).collect();
        let mut all: Vec<(u32, f32)> = cands.iter().map(|&(id, l)| (id, l / t)).collect();
        all.extend(history.iter().zip(&hist).map(|(&(id, _), &l)| (id, l)));
        all.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        if all.first().is_some_and(|&(_, l)| !l.is_finite()) {
            // The division overflowed (see `sample`): the whole row decides, greedily.
            return None;
        }
        if self.top_k == 0 {
            // With every token among them (a small vocabulary), nothing lies outside.
            let bound = if cands.len() + history.len() >= vocab { f32::NEG_INFINITY } else { last.1 / t };
            return self.choose_with_mass(&all, bound, &hist, masses);
        }
        let kth = all.get(self.top_k.max(1) - 1)?.1;
        // Every token outside the candidates scales to at most the last one's value.
        if (last.1 / t).total_cmp(&kth) != std::cmp::Ordering::Less {
            return None;
        }
        Some(self.choose(all))
    }

    /// Sampling without top-k from the sorted scaled candidates and history `all`, every token
    /// outside them scaling to at most `bound`; `hist` the history's scaled logits. The row's
    /// total weight is the blocks' masses plus the history's; the entries above `bound` are the
    /// head of the whole row's order, so a nucleus or a draw inside them (clear of the margin)
    /// is the whole row's.
    fn choose_with_mass(&mut self, all: &[(u32, f32)], bound: f32, hist: &[f32], masses: &[(f32, f32)]) -> Option<u32> {
        let head = all.iter().take_while(|&&(_, l)| l > bound).count();
        let max = all.first()?.1;
        let w: Vec<f64> = all[..head].iter().map(|&(_, l)| ((l - max) as f64).exp()).collect();
        let total = self.mass_total(max, hist, masses);
        if !(total.is_finite() && total > 0.0) {
            return None;
        }
        let margin = mass_margin(max);
        if self.top_p < 1.0 {
            let keep = nucleus(&w, total, self.top_p as f64, margin)?;
            let kept = w[..keep].iter().sum();
            return Some(self.draw(&all[..keep], &w[..keep], kept));
        }
        // The draw over the whole row, from a copy of the generator: committed only when the
        // candidates decide it, so the whole row's draw (the fallback) uses the same number.
        let mut rng = self.rng.clone();
        let i = landing(&w, total, rng.next_f64(), margin)?;
        self.rng = rng;
        Some(all[i].0)
    }

    /// The row's total weight relative to its largest scaled logit `max`: the blocks' masses
    /// (each block's largest logit scaled as the whole row scales it) and the history's
    /// scaled logits `hist`.
    fn mass_total(&self, max: f32, hist: &[f32], masses: &[(f32, f32)]) -> f64 {
        let t = self.temperature;
        let outside: f64 = masses.iter().map(|&(m, s)| s as f64 * ((m / t - max) as f64).exp()).sum();
        outside + hist.iter().map(|&l| ((l - max) as f64).exp()).sum::<f64>()
    }

    /// Whether this is greedy decoding with no repetition penalty (the choice the GPU makes).
    pub(crate) fn is_plain_greedy(&self) -> bool {
        self.temperature == 0.0 && self.repetition_penalty == 1.0
    }

    /// Greedy decoding.
    pub fn greedy() -> Self {
        Self { repetition_penalty: 1.0, temperature: 0.0, top_k: 0, top_p: 1.0, rng: SplitMix64(0) }
    }

    /// Pick a token from one row of logits (an empty row is a `BadParam` error).
    pub fn sample(&mut self, logits: &[f32]) -> Result<u32, RunError> {
        match self.scaled(logits)? {
            Some(cand) => Ok(self.choose(cand)),
            None => Ok(argmax(logits)),
        }
    }

    /// The (id, logit / temperature) pairs of a row, or `None` when the choice is the argmax:
    /// greedy, or logits so large that the division overflows (|l| > 3.4e33 at the smallest
    /// temperature; the distribution is the argmax's). An empty row is a `BadParam` error.
    fn scaled(&self, logits: &[f32]) -> Result<Option<Vec<(u32, f32)>>, RunError> {
        if logits.is_empty() {
            return Err(RunError::BadParam {
                name: "logits",
                value: "an empty row".into(),
                expected: "at least one logit",
            });
        }
        let best = argmax(logits);
        if self.temperature == 0.0 || logits.get(best as usize).is_some_and(|&l| !(l / self.temperature).is_finite()) {
            return Ok(None);
        }
        Ok(Some(logits.iter().enumerate().map(|(i, &l)| (i as u32, l / self.temperature)).collect()))
    }

    /// Draw from the (id, scaled logit) candidates [`Sampler::kept`] keeps.
    fn choose(&mut self, cand: Vec<(u32, f32)>) -> u32 {
        let (kept, w, total) = self.kept(cand);
        self.draw(&kept, &w, total)
    }

    /// The candidates top-k, then top-p keep (sorted best first), their weights relative to the
    /// best, and the weights' sum.
    fn kept(&self, mut cand: Vec<(u32, f32)>) -> (Vec<(u32, f32)>, Vec<f64>, f64) {
        cand.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        if self.top_k > 0 {
            cand.truncate(self.top_k.max(1));
        }
        let max = cand[0].1;
        let mut w: Vec<f64> = cand.iter().map(|&(_, l)| ((l - max) as f64).exp()).collect();
        let total: f64 = w.iter().sum();
        // The nucleus where the cumulated probability first reaches top-p (no margin: this is
        // the whole row), else every candidate.
        let keep = if self.top_p < 1.0 { nucleus(&w, total, self.top_p as f64, 0.0) } else { None };
        let keep = keep.unwrap_or(w.len());
        // The kept weights renormalised by their own sum (the top-p nucleus's draw depends on
        // the nucleus alone, which is what lets candidates reproduce it exactly).
        let kept = if keep == w.len() { total } else { w[..keep].iter().sum() };
        cand.truncate(keep);
        w.truncate(keep);
        (cand, w, kept)
    }

    /// Draw from `cand` with weights `w` summing to `total`.
    fn draw(&mut self, cand: &[(u32, f32)], w: &[f64], total: f64) -> u32 {
        cand[draw_index(w, total, self.rng.next_f64())].0
    }
}

/// How far (in probability) a top-p cut-off or a draw must be from a boundary to be decided from
/// the GPU's mass, for a row whose largest scaled logit is `max`: `MASS_MARGIN` for the f32 sums,
/// plus the f32 rounding of the scaled exponents (about one ulp of |l / T| each, which the whole
/// row and the GPU round differently; the weights that count lie within ~64 of `max`).
fn mass_margin(max: f32) -> f64 {
    MASS_MARGIN + 8.0 * f32::EPSILON as f64 * (max.abs() as f64 + 64.0)
}

/// The size of the top-p nucleus over the head weights `w` of a row of total weight `total`
/// (cumulated in order), when its cut-off lies inside the head and clear of `p` by `margin`.
fn nucleus(w: &[f64], total: f64, p: f64, margin: f64) -> Option<usize> {
    let mut cum = 0.0;
    for (i, wi) in w.iter().enumerate() {
        let before = cum;
        cum += wi / total;
        if cum >= p - margin {
            let clear = cum >= p + margin && (i == 0 || before < p - margin);
            return clear.then_some(i + 1);
        }
    }
    None
}

/// Where a draw `u` over a row of total weight `total` lands among the head weights `w`
/// (cumulated in order): its index when it is inside the head and clear of the boundaries by
/// `margin`.
fn landing(w: &[f64], total: f64, u: f64, margin: f64) -> Option<usize> {
    let mut cum = 0.0;
    for (i, wi) in w.iter().enumerate() {
        let next = cum + wi / total;
        if u < next + margin {
            let clear = u < next - margin && (i == 0 || u >= cum + margin);
            return clear.then_some(i);
        }
        cum = next;
    }
    None
}

/// The index `Sampler::draw` picks with the number `u` from weights `w` summing to `total`.
fn draw_index(w: &[f64], total: f64, mut u: f64) -> usize {
    for (i, wi) in w.iter().enumerate() {
        let p = wi / total;
        if u < p {
            return i;
        }
        u -= p;
    }
    w.len() - 1
}

/// Index of the largest value (first on ties; NaN never wins).
pub fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] || v[best].is_nan() {
            best = i;
        }
    }
    best as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_picks_first_maximum() {
        assert_eq!(argmax(&[0.0, 3.0, 3.0, -1.0]), 1);
        assert_eq!(argmax(&[f32::NAN, 1.0]), 1);
    }

    #[test]
    fn seeded_sampling_is_reproducible_and_respects_top_k() {
        let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin()).collect();
        let draw = |seed| {
            let mut s = Sampler::new(1.0, 3, 1.0, seed).expect("valid params");
            (0..20).map(|_| s.sample(&logits).expect("a row")).collect::<Vec<_>>()
        };
        assert_eq!(draw(7), draw(7));
        let mut top3: Vec<u32> = (0..50).collect();
        top3.sort_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]));
        top3.truncate(3);
        assert!(draw(7).iter().all(|t| top3.contains(t)));
    }

    #[test]
    fn an_empty_row_or_a_top_k_past_any_vocabulary_is_no_panic() {
        for t in [0.0, 1.0] {
            let mut s = Sampler::new(t, 3, 1.0, 1).expect("valid params");
            assert!(matches!(s.sample(&[]), Err(RunError::BadParam { name: "logits", .. })), "temperature {t}");
            assert!(matches!(s.sample_after(&[], &[0]), Err(RunError::BadParam { name: "logits", .. })));
        }
        // top_k + the tie margin overflowed usize: no GPU candidates, the whole row (all of it kept).
        let mut s = Sampler::new(1.0, usize::MAX, 1.0, 5).expect("valid params");
        assert_eq!(s.gpu_candidates(248_320, 128), None);
        let logits = [0.0, 0.5, 1.0];
        let mut seen = [false; 3];
        for _ in 0..200 {
            seen[s.sample(&logits).expect("a row") as usize] = true;
        }
        assert_eq!(seen, [true; 3]);
    }

    #[test]
    fn tiny_top_p_is_greedy() {
        let logits = [0.1, 2.0, 0.3, 1.9];
        let mut s = Sampler::new(1.0, 0, 1e-6, 3).expect("valid params");
        assert!((0..10).all(|_| s.sample(&logits).expect("a row") == 1));
    }

    #[test]
    fn repetition_penalty_follows_transformers() {
        let p = GenerateParams { repetition_penalty: 2.0, ..Default::default() };
        let mut s = Sampler::from_params(&p).expect("valid");
        // Token 0 (logit 3) is penalised to 1.5, below token 1 (2.0); a negative logit falls.
        assert_eq!(s.sample_after(&[3.0, 2.0, -1.0], &[0]).expect("a row"), 1);
        assert_eq!(s.sample_after(&[3.0, 2.0, -1.0], &[]).expect("a row"), 0);
        assert_eq!(s.sample_after(&[-1.0, -1.5], &[0]).expect("a row"), 1);
        // Once per distinct id: 3 / 2 = 1.5 still beats 1.0 (twice it would be 0.75).
        assert_eq!(s.sample_after(&[3.0, 1.0], &[0, 0]).expect("a row"), 0);
    }

    /// What the GPU pass hands over: the `k` best (id, logit) outside `history` by raw logit, and
    /// the distinct history ids with their logits.
    fn gpu_view(logits: &[f32], history: &[u32], k: usize) -> (Candidates, Candidates) {
        let distinct: std::collections::BTreeSet<u32> = history.iter().copied().collect();
        let mut cands: Vec<(u32, f32)> =
            logits.iter().enumerate().map(|(i, &l)| (i as u32, l)).filter(|(i, _)| !distinct.contains(i)).collect();
        cands.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        cands.truncate(k);
        (cands, distinct.iter().map(|&i| (i, logits[i as usize])).collect())
    }

    #[test]
    fn candidates_choose_what_the_whole_row_chooses() {
        let mut state = SplitMix64(11);
        for case in 0..60 {
            let vocab = 40 + case * 7;
            let logits: Vec<f32> = (0..vocab).map(|_| (state.next_f64() as f32 - 0.5) * 12.0).collect();
            let history: Vec<u32> = (0..case % 9).map(|i| ((i * 37 + case) % vocab) as u32).collect();
            let p = GenerateParams {
                temperature: [0.3, 0.7, 1.0, 1.9][case % 4],
                top_k: [1, 2, 5, 20, 33][case % 5],
                top_p: [1.0, 0.9, 0.5][case % 3],
                repetition_penalty: [1.0, 1.3, 0.8][case % 3],
                seed: case as u64,
                ..Default::default()
            };
            let (mut full, mut gpu) = (Sampler::from_params(&p).expect("p"), Sampler::from_params(&p).expect("p"));
            let k = gpu.gpu_candidates(vocab, 128).expect("top-k sampling takes candidates");
            let (cands, hist) = gpu_view(&logits, &history, k);
            for draw in 0..5 {
                let want = full.sample_after(&logits, &history).expect("a row");
                let got = gpu.sample_candidates(&cands, &hist, vocab, &[]);
                assert_eq!(got, Some(want), "case {case} draw {draw}");
            }
        }
    }

    /// The blocks' softmax masses the GPU pass computes (`topk.wgsl`), in f32 the same way:
    /// per block of `block` logits outside `history`, its largest and Σ exp((l − m) · inv_t).
    fn gpu_masses(logits: &[f32], history: &[u32], inv_t: f32, block: usize) -> Vec<(f32, f32)> {
        logits
            .chunks(block)
            .enumerate()
            .map(|(b, chunk)| {
                let outside = |&(i, _): &(usize, &f32)| !history.contains(&((b * block + i) as u32));
                let m = chunk.iter().enumerate().filter(outside).map(|(_, &l)| l).fold(-3e38f32, f32::max);
                let s = chunk.iter().enumerate().filter(outside).map(|(_, &l)| ((l - m) * inv_t).exp()).sum();
                (m, s)
            })
            .collect()
    }

    /// Without top-k (top-p, or the temperature alone), the candidates and the row's mass choose
    /// what the whole row chooses whenever they decide, with the same random draws, and they
    /// decide most peaked rows (the nucleus or the draw inside the 64 best).
    #[test]
    fn candidates_and_the_rows_mass_choose_what_the_whole_row_chooses() {
        let mut state = SplitMix64(23);
        let mut decided = 0;
        let mut draws = 0;
        for case in 0..80 {
            let vocab = 100 + case * 97;
            // Zipf-like rows (probability ~ rank^-a at temperature 1, ranks shuffled, some noise),
            // as a language model's rows are.
            let a = [1.2f32, 1.6, 2.0][case % 3];
            let logits: Vec<f32> = (0..vocab)
                .map(|i| -a * (1.0 + ((i * 7919 + case * 31) % vocab) as f32).ln() + state.next_f64() as f32 * 0.3)
                .collect();
            // History: some of the most likely tokens (their mass counts beside the blocks') and
            // a few others.
            let mut order: Vec<u32> = (0..vocab as u32).collect();
            order.sort_by(|&x, &y| logits[y as usize].total_cmp(&logits[x as usize]));
            let mut history: Vec<u32> = (0..case % 7).map(|i| ((i * 53 + case) % vocab) as u32).collect();
            history.extend(order.iter().step_by(3).take(case % 4));
            let p = GenerateParams {
                temperature: [0.3, 0.6, 0.8, 1.0, 0.7][case % 5],
                top_k: 0,
                top_p: [1.0, 0.95, 0.8, 0.5][case % 4 / 2 + case % 3 % 2],
                repetition_penalty: [1.0, 1.3][case % 2],
                seed: case as u64,
                ..Default::default()
            };
            let (mut full, mut gpu) = (Sampler::from_params(&p).expect("p"), Sampler::from_params(&p).expect("p"));
            let k = gpu.gpu_candidates(vocab, 128).expect("sampling takes candidates");
            let inv_t = gpu.needs_mass().expect("without top-k the mass comes too");
            let distinct: Vec<u32> = if gpu.penalizes() { history.clone() } else { Vec::new() };
            let (cands, hist) = gpu_view(&logits, &distinct, k);
            let masses = gpu_masses(&logits, &distinct, inv_t, 1000);
            for draw in 0..6 {
                let got = gpu.sample_candidates(&cands, &hist, vocab, &masses);
                let want = full.sample_after(&logits, &history).expect("a row");
                draws += 1;
                if let Some(id) = got {
                    decided += 1;
                    assert_eq!(id, want, "case {case} draw {draw}");
                } else {
                    // The whole row draws instead, with the number the candidates did not use.
                    assert_eq!(
                        gpu.sample_after(&logits, &history).expect("a row"),
                        want,
                        "case {case} draw {draw}: fallback"
                    );
                }
            }
        }
        // The choices above are exact either way; this guards the GPU path's purpose, choosing
        // without the whole row: on these Zipf-like rows the candidates decide 404 of 480 draws
        // (84 %), and a change that sent most draws to the fallback would fall under 70 %.
        assert!(decided * 10 >= draws * 7, "candidates decided {decided} of {draws} draws");
    }

    /// At a low temperature the scaled logits are large, and the whole row and the GPU round
    /// their exponents differently (about an ulp of |l / T| each): the margin grows with them, so
    /// at no random number does the mass decide a draw the whole row makes differently (with
    /// the f32 sums' margin alone, some would).
    #[test]
    fn low_temperature_draws_decided_from_the_mass_are_the_whole_rows() {
        let t = 0.002f32;
        let mut logits = vec![24.362213f32, 24.36215, 24.35591];
        logits.extend((0..50).map(|i| 24.0 - i as f32 * 0.01));
        let s = Sampler::new(t, 0, 1.0, 0).expect("p");
        // The whole row, as `choose` weighs it.
        let mut all: Vec<(u32, f32)> = logits.iter().enumerate().map(|(i, &l)| (i as u32, l / t)).collect();
        all.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        let max = all[0].1;
        let w: Vec<f64> = all.iter().map(|&(_, l)| ((l - max) as f64).exp()).collect();
        let total: f64 = w.iter().sum();
        // The GPU's view: the three best (a head of two) and the masses.
        let (cands, _) = gpu_view(&logits, &[], 3);
        let bound = cands[2].1 / t;
        let head = all.iter().take_while(|&&(_, l)| l > bound).count();
        let mass = s.mass_total(max, &[], &gpu_masses(&logits, &[], 1.0 / t, 4096));
        let wrong = |margin: f64| {
            (0..1_000_000).any(|step| {
                let u = step as f64 / 1e6;
                landing(&w[..head], mass, u, margin).is_some_and(|i| i != draw_index(&w, total, u))
            })
        };
        assert!(!wrong(mass_margin(max)), "a draw decided from the mass differs from the whole row's");
        assert!(wrong(MASS_MARGIN), "the f32 sums' margin alone decides some draws wrongly here");
    }

    #[test]
    fn candidates_that_cannot_prove_the_top_k_draw_nothing() {
        let p = GenerateParams { temperature: 1.0, top_k: 2, ..Default::default() };
        let mut s = Sampler::from_params(&p).expect("p");
        let k = s.gpu_candidates(64, 128).expect("k");
        // Every logit equal: the last candidate ties the second, an id outside could rank above it.
        let (cands, hist) = gpu_view(&[1.0; 64], &[], k);
        assert_eq!(s.sample_candidates(&cands, &hist, 64, &[]), None);
        // A history id among the candidates (the pass did not mask it), or an id past the vocabulary.
        let logits: Vec<f32> = (0..64).map(|i| i as f32).collect();
        let (cands, _) = gpu_view(&logits, &[], k);
        assert_eq!(s.sample_candidates(&cands, &[(63, 63.0)], 64, &[]), None);
        assert_eq!(s.sample_candidates(&cands, &[], 60, &[]), None);
        assert!(s.sample_candidates(&cands, &[], 64, &[]).is_some());
        // Greedy takes no candidates, nor a top-k the pass cannot hold; without top-k, 64 (or
        // the whole vocabulary when smaller) and the mass.
        assert_eq!(Sampler::greedy().gpu_candidates(64, 128), None);
        assert_eq!(Sampler::new(1.0, 121, 1.0, 0).expect("p").gpu_candidates(1000, 128), None);
        let s = Sampler::new(0.5, 0, 0.9, 0).expect("p");
        assert_eq!((s.gpu_candidates(1000, 128), s.needs_mass()), (Some(64), Some(2.0)));
        assert_eq!(Sampler::new(1.0, 0, 1.0, 0).expect("p").gpu_candidates(40, 128), Some(40));
        assert_eq!(Sampler::new(1.0, 5, 1.0, 0).expect("p").needs_mass(), None);
    }

    #[test]
    fn temperatures_below_the_minimum_are_greedy() {
        let logits = [0.5, 3.0, 2.9, -1.0];
        for t in [1e-40, 1e-30, 1e-6, MIN_TEMPERATURE / 2.0] {
            let mut s = Sampler::new(t, 0, 1.0, 5).expect("valid");
            assert!(s.is_plain_greedy(), "{t}");
            assert!((0..20).all(|_| s.sample(&logits).expect("a row") == 1), "{t}");
        }
        assert!(!Sampler::new(MIN_TEMPERATURE, 0, 1.0, 5).expect("valid").is_plain_greedy());
    }

    #[test]
    fn logits_that_overflow_the_division_are_chosen_greedily() {
        // 1e34 / 1e-5 is +inf in f32: the softmax would be NaN and the draw garbage.
        let mut logits = vec![1e34f32; 16];
        logits[1] = -3e38;
        logits[2] = 3e38;
        logits[3] = 2e38;
        let mut s = Sampler::new(MIN_TEMPERATURE, 0, 1.0, 5).expect("valid");
        assert!((0..20).all(|_| s.sample(&logits).expect("a row") == 2));
        let mut s = Sampler::new(MIN_TEMPERATURE, 2, 1.0, 5).expect("valid");
        let k = s.gpu_candidates(16, 128).expect("k");
        let (cands, hist) = gpu_view(&logits, &[], k);
        assert_eq!(s.sample_candidates(&cands, &hist, 16, &[]), None, "the whole row decides");
        assert!((0..20).all(|_| s.sample_after(&logits, &[]).expect("a row") == 2));
    }

    #[test]
    fn bad_parameters_are_typed_errors() {
        assert!(matches!(Sampler::new(-1.0, 0, 1.0, 0), Err(RunError::BadParam { name: "temperature", .. })));
        assert!(matches!(Sampler::new(1.0, 0, 0.0, 0), Err(RunError::BadParam { name: "top_p", .. })));
    }
}
