//! Token selection from logits: greedy, or seeded sampling with temperature, top-k and top-p
//! (the order transformers applies its warpers in).

use crate::error::RunError;
use crate::runtime::GenerateParams;

/// Candidates beyond top-k a GPU pass returns: room for values that the division by the
/// temperature makes equal at the k-th place (ties are then broken by id, not by the raw logit).
const TIE_MARGIN: usize = 8;

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
    /// per distinct id however often it occurs).
    pub fn sample_after(&mut self, logits: &[f32], history: &[u32]) -> u32 {
        if !self.penalizes() {
            return self.sample(logits);
        }
        let mut l = logits.to_vec();
        let distinct: std::collections::BTreeSet<u32> = history.iter().copied().collect();
        for id in distinct {
            if let Some(v) = l.get_mut(id as usize) {
                *v = self.penalized(*v);
            }
        }
        self.sample(&l)
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
    /// `vocab` logits (at most `max`), when this sampler can choose from candidates at all: top-k
    /// sampling, with `TIE_MARGIN` more than k.
    pub(crate) fn gpu_candidates(&self, vocab: usize, max: usize) -> Option<usize> {
        let k = self.top_k + TIE_MARGIN;
        (self.temperature > 0.0 && self.top_k > 0 && k <= max && k <= vocab).then_some(k)
    }

    /// The choice [`Sampler::sample_after`] makes, from the GPU's candidates: `cands` are the
    /// best (id, logit) pairs of the tokens outside the history in `sample`'s order, `history`
    /// the distinct history ids (ascending) with their logits. `None` (nothing drawn) when the candidates
    /// cannot prove the top k: a history id or an id past the vocabulary among them, or the last
    /// candidate tying the k-th after the division by the temperature (then the caller samples
    /// from the whole row).
    pub(crate) fn sample_candidates(
        &mut self,
        cands: &[(u32, f32)],
        history: &[(u32, f32)],
        vocab: usize,
    ) -> Option<u32> {
        let in_history = |id: u32| history.binary_search_by_key(&id, |&(h, _)| h).is_ok();
        let last = cands.last()?;
        if cands.iter().any(|&(id, _)| id as usize >= vocab || in_history(id)) {
            return None;
        }
        let t = self.temperature;
        let mut all: Vec<(u32, f32)> = cands.iter().map(|&(id, l)| (id, l / t)).collect();
        all.extend(history.iter().map(|&(id, l)| (id, self.penalized(l) / t)));
        all.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        if all.first().is_some_and(|&(_, l)| !l.is_finite()) {
            // The division overflowed (see `sample`): the whole row decides, greedily.
            return None;
        }
        let kth = all.get(self.top_k.max(1) - 1)?.1;
        // Every token outside the candidates scales to at most the last one's value.
        if (last.1 / t).total_cmp(&kth) != std::cmp::Ordering::Less {
            return None;
        }
        Some(self.choose(all))
    }

    /// Whether this is greedy decoding with no repetition penalty (the choice the GPU makes).
    pub(crate) fn is_plain_greedy(&self) -> bool {
        self.temperature == 0.0 && self.repetition_penalty == 1.0
    }

    /// Greedy decoding.
    pub fn greedy() -> Self {
        Self { repetition_penalty: 1.0, temperature: 0.0, top_k: 0, top_p: 1.0, rng: SplitMix64(0) }
    }

    /// Pick a token from one row of logits.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        if self.temperature == 0.0 {
            return argmax(logits);
        }
        // Logits so large that the division overflows (|l| > 3.4e33 at the smallest temperature):
        // the distribution is the argmax's.
        let best = argmax(logits);
        if logits.get(best as usize).is_some_and(|&l| !(l / self.temperature).is_finite()) {
            return best;
        }
        let cand: Vec<(u32, f32)> = logits.iter().enumerate().map(|(i, &l)| (i as u32, l / self.temperature)).collect();
        self.choose(cand)
    }

    /// Sort (id, scaled logit) candidates, keep top-k, then top-p, and draw.
    fn choose(&mut self, mut cand: Vec<(u32, f32)>) -> u32 {
        cand.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        if self.top_k > 0 {
            cand.truncate(self.top_k.max(1));
        }
        let max = cand[0].1;
        let mut probs: Vec<f64> = cand.iter().map(|&(_, l)| ((l - max) as f64).exp()).collect();
        let total: f64 = probs.iter().sum();
        probs.iter_mut().for_each(|p| *p /= total);
        if self.top_p < 1.0 {
            let mut cum = 0.0;
            let mut keep = probs.len();
            for (i, p) in probs.iter().enumerate() {
                cum += p;
                if cum >= self.top_p as f64 {
                    keep = i + 1;
                    break;
                }
            }
            probs.truncate(keep);
            let total: f64 = probs.iter().sum();
            probs.iter_mut().for_each(|p| *p /= total);
        }
        let mut u = self.rng.next_f64();
        for (i, p) in probs.iter().enumerate() {
            if u < *p {
                return cand[i].0;
            }
            u -= p;
        }
        cand[probs.len() - 1].0
    }
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
            (0..20).map(|_| s.sample(&logits)).collect::<Vec<_>>()
        };
        assert_eq!(draw(7), draw(7));
        let mut top3: Vec<u32> = (0..50).collect();
        top3.sort_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]));
        top3.truncate(3);
        assert!(draw(7).iter().all(|t| top3.contains(t)));
    }

    #[test]
    fn tiny_top_p_is_greedy() {
        let logits = [0.1, 2.0, 0.3, 1.9];
        let mut s = Sampler::new(1.0, 0, 1e-6, 3).expect("valid params");
        assert!((0..10).all(|_| s.sample(&logits) == 1));
    }

    #[test]
    fn repetition_penalty_follows_transformers() {
        let p = GenerateParams { repetition_penalty: 2.0, ..Default::default() };
        let mut s = Sampler::from_params(&p).expect("valid");
        // Token 0 (logit 3) is penalised to 1.5, below token 1 (2.0); a negative logit falls.
        assert_eq!(s.sample_after(&[3.0, 2.0, -1.0], &[0]), 1);
        assert_eq!(s.sample_after(&[3.0, 2.0, -1.0], &[]), 0);
        assert_eq!(s.sample_after(&[-1.0, -1.5], &[0]), 1);
        // Once per distinct id: 3 / 2 = 1.5 still beats 1.0 (twice it would be 0.75).
        assert_eq!(s.sample_after(&[3.0, 1.0], &[0, 0]), 0);
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
                let want = full.sample_after(&logits, &history);
                let got = gpu.sample_candidates(&cands, &hist, vocab);
                assert_eq!(got, Some(want), "case {case} draw {draw}");
            }
        }
    }

    #[test]
    fn candidates_that_cannot_prove_the_top_k_draw_nothing() {
        let p = GenerateParams { temperature: 1.0, top_k: 2, ..Default::default() };
        let mut s = Sampler::from_params(&p).expect("p");
        let k = s.gpu_candidates(64, 128).expect("k");
        // Every logit equal: the last candidate ties the second, an id outside could rank above it.
        let (cands, hist) = gpu_view(&[1.0; 64], &[], k);
        assert_eq!(s.sample_candidates(&cands, &hist, 64), None);
        // A history id among the candidates (the pass did not mask it), or an id past the vocabulary.
        let logits: Vec<f32> = (0..64).map(|i| i as f32).collect();
        let (cands, _) = gpu_view(&logits, &[], k);
        assert_eq!(s.sample_candidates(&cands, &[(63, 63.0)], 64), None);
        assert_eq!(s.sample_candidates(&cands, &[], 60), None);
        assert!(s.sample_candidates(&cands, &[], 64).is_some());
        // Greedy and sampling without top-k take no candidates.
        assert_eq!(Sampler::greedy().gpu_candidates(64, 128), None);
        assert_eq!(Sampler::new(1.0, 0, 0.9, 0).expect("p").gpu_candidates(64, 128), None);
        assert_eq!(Sampler::new(1.0, 121, 1.0, 0).expect("p").gpu_candidates(1000, 128), None);
    }

    #[test]
    fn temperatures_below_the_minimum_are_greedy() {
        let logits = [0.5, 3.0, 2.9, -1.0];
        for t in [1e-40, 1e-30, 1e-6, MIN_TEMPERATURE / 2.0] {
            let mut s = Sampler::new(t, 0, 1.0, 5).expect("valid");
            assert!(s.is_plain_greedy(), "{t}");
            assert!((0..20).all(|_| s.sample(&logits) == 1), "{t}");
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
        assert!((0..20).all(|_| s.sample(&logits) == 2));
        let mut s = Sampler::new(MIN_TEMPERATURE, 2, 1.0, 5).expect("valid");
        let k = s.gpu_candidates(16, 128).expect("k");
        let (cands, hist) = gpu_view(&logits, &[], k);
        assert_eq!(s.sample_candidates(&cands, &hist, 16), None, "the whole row decides");
        assert!((0..20).all(|_| s.sample_after(&logits, &[]) == 2));
    }

    #[test]
    fn bad_parameters_are_typed_errors() {
        assert!(matches!(Sampler::new(-1.0, 0, 1.0, 0), Err(RunError::BadParam { name: "temperature", .. })));
        assert!(matches!(Sampler::new(1.0, 0, 0.0, 0), Err(RunError::BadParam { name: "top_p", .. })));
    }
}
