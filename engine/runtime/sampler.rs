//! Token selection from logits: greedy, or seeded sampling with temperature, top-k and top-p
//! (the order transformers applies its warpers in).

use crate::error::RunError;
use crate::runtime::GenerateParams;

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
    /// `temperature == 0` is greedy (argmax, first index on ties); `top_k == 0` and
    /// `top_p == 1` disable those filters.
    pub fn new(temperature: f32, top_k: usize, top_p: f32, seed: u64) -> Result<Self, RunError> {
        if !temperature.is_finite() || temperature < 0.0 {
            return Err(RunError::BadParam { name: "temperature", value: temperature.to_string(), expected: ">= 0" });
        }
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
    /// (transformers' rule: positive logits are divided by the penalty, negative multiplied).
    pub fn sample_after(&mut self, logits: &[f32], history: &[u32]) -> u32 {
        if self.repetition_penalty == 1.0 {
            return self.sample(logits);
        }
        let mut l = logits.to_vec();
        for &id in history {
            if let Some(v) = l.get_mut(id as usize) {
                *v = if *v > 0.0 { *v / self.repetition_penalty } else { *v * self.repetition_penalty };
            }
        }
        self.sample(&l)
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
        let mut cand: Vec<(u32, f32)> =
            logits.iter().enumerate().map(|(i, &l)| (i as u32, l / self.temperature)).collect();
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
    }

    #[test]
    fn bad_parameters_are_typed_errors() {
        assert!(matches!(Sampler::new(-1.0, 0, 1.0, 0), Err(RunError::BadParam { name: "temperature", .. })));
        assert!(matches!(Sampler::new(1.0, 0, 0.0, 0), Err(RunError::BadParam { name: "top_p", .. })));
    }
}
