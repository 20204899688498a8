//! Learning from feedback on the GPU: events (a prompt, a response and a signal) become real
//! gradient steps on the language-model loss with respect to a per-layer PEFT LoRA adapter that is
//! live in generation (the same bind-group path as any loaded adapter), then export to a standard
//! PEFT directory.
//!
//! What can learn today: the LoRA of the seven projections of the model's last layer when it is a
//! full-attention layer (as in every Qwen 3.5 checkpoint): `q_proj`, `k_proj`, `v_proj`, `o_proj`,
//! `gate_proj`, `up_proj`, `down_proj`. The backward pass runs through lm_head, the final norm,
//! that layer's MLP, post-attention norm, `o_proj`, the gated softmax attention and the per-head
//! q/k norm and RoPE into the three input projections; the frozen forward below it runs without
//! gradients. Earlier layers (the backward would have to cross this layer's input norm and, below
//! it, Gated DeltaNet layers and their delta rule) are typed [`LearnError::NotLearnable`] errors.
//!
//! The loss of a batch of `E` events is `(1/E) Σ_e w_e · mean_t CE(response token t)`, where
//! `w_e = 1` for a preferred (supervised) response and `w_e = score − baseline` for a scored one,
//! the baseline being a running mean of past scores (starting at 0.5), so a score under the
//! baseline pushes the response's log-likelihood down and one above pushes it up.

mod export;
mod trainer;

pub(crate) use export::export_peft;
pub(crate) use trainer::Trainer;

use std::path::PathBuf;

use crate::error::LearnError;
use crate::lora::{ConfigSource, ModuleDelta, ParsedAdapter, PeftConfig, Proj, MAX_SCALING};
use crate::model::TextConfig;
use crate::runtime::SplitMix64;

/// The projections whose LoRA the backward pass reaches (in the last layer).
pub const LEARNABLE: [Proj; 7] =
    [Proj::QProj, Proj::KProj, Proj::VProj, Proj::OProj, Proj::GateProj, Proj::UpProj, Proj::DownProj];

/// Largest rank of a new trainable adapter (PEFT fine-tunes use 4 to 256).
pub const MAX_TRAIN_RANK: usize = 1024;

/// Most elements of one LoRA matrix of a new trainable adapter (2^28: 1 GiB of f32), checked
/// before A is initialised on the host.
pub const MAX_LORA_ELEMENTS: usize = 1 << 28;

/// Largest AdamW learning rate: an Adam step moves every weight by about `lr`, and LoRA weights
/// are of order 1/√in, so a rate above 1 replaces the adapter with noise in one step (1e30 made
/// every logit non-finite).
pub const MAX_LR: f32 = 1.0;

/// Largest weight decay and anchor strength (absurd values overflow the update).
pub const MAX_DECAY: f32 = 1e3;

/// A new trainable adapter.
#[derive(Clone, Debug)]
pub struct TrainSpec {
    /// LoRA rank r.
    pub rank: usize,
    /// LoRA alpha (scaling alpha / r).
    pub alpha: f32,
    /// Targeted projections (each must be in [`LEARNABLE`]).
    pub targets: Vec<Proj>,
    /// Targeted layers (`None`: the last layer, the only one supported today).
    pub layers: Option<Vec<usize>>,
    /// Seed of A's Kaiming-uniform initialisation (B starts at zero, as in PEFT).
    pub seed: u64,
    /// Adapter id (`None`: "feedback").
    pub id: Option<String>,
}

impl Default for TrainSpec {
    fn default() -> Self {
        Self { rank: 8, alpha: 16.0, targets: LEARNABLE.to_vec(), layers: None, seed: 0, id: None }
    }
}

/// What an event says about its response.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Signal {
    /// The preferred or corrected response: supervised cross-entropy.
    Preferred,
    /// A quality score in [0, 1]: reward-weighted likelihood (see the module docs).
    Score(f32),
}

/// One piece of feedback as text; the prompt is a user message rendered with the chat template
/// and the response is the assistant's reply followed by the end-of-turn token.
#[derive(Clone, Debug)]
pub struct FeedbackEvent {
    /// The user's message.
    pub prompt: String,
    /// The response.
    pub response: String,
    /// The signal.
    pub signal: Signal,
}

/// One piece of feedback as token ids: the loss covers the response tokens, each predicted from
/// everything before it.
#[derive(Clone, Debug)]
pub struct TokenEvent {
    /// The context (at least one token).
    pub prompt: Vec<u32>,
    /// The response (at least one token).
    pub response: Vec<u32>,
    /// The signal.
    pub signal: Signal,
}

/// Optimiser settings of one step.
#[derive(Clone, Debug)]
pub struct LearnOptions {
    /// AdamW learning rate (> 0).
    pub lr: f32,
    /// AdamW β1.
    pub beta1: f32,
    /// AdamW β2.
    pub beta2: f32,
    /// AdamW ε.
    pub eps: f32,
    /// Decoupled weight decay (towards zero).
    pub weight_decay: f32,
    /// Global gradient-norm clip (0: none).
    pub max_grad_norm: f32,
    /// Strength of the L2 pull towards the weights the adapter started from.
    pub anchor_l2: f32,
    /// Momentum of the running score baseline.
    pub baseline_momentum: f32,
}

impl Default for LearnOptions {
    fn default() -> Self {
        Self {
            lr: 1e-4,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
            max_grad_norm: 1.0,
            anchor_l2: 0.01,
            baseline_momentum: 0.9,
        }
    }
}

/// What one step did.
#[derive(Clone, Debug)]
pub struct LearnReport {
    /// Steps taken so far (this one included).
    pub step: u64,
    /// Mean cross-entropy of each event's response tokens before the step.
    pub event_ce: Vec<f32>,
    /// Global gradient norm before clipping.
    pub grad_norm: f32,
    /// The score baseline after the step.
    pub baseline: f32,
}

/// The gradient of one adapted projection (for checks against an autograd oracle).
#[derive(Clone, Debug)]
pub struct ModuleGrad {
    /// The layer.
    pub layer: usize,
    /// The projection.
    pub proj: Proj,
    /// ∂L/∂A `[r, in]`.
    pub a: Vec<f32>,
    /// ∂L/∂B `[out, r]`.
    pub b: Vec<f32>,
}

fn bad(name: impl Into<String>, expected: &str, found: impl std::fmt::Display) -> LearnError {
    LearnError::BadInput { name: name.into(), expected: expected.into(), found: found.to_string() }
}

impl LearnOptions {
    /// Check every field.
    pub fn validate(&self) -> Result<(), LearnError> {
        let positive = |name: &str, v: f32| {
            if v.is_finite() && v > 0.0 {
                Ok(())
            } else {
                Err(bad(name, "a finite number > 0", v))
            }
        };
        let non_negative = |name: &str, v: f32| {
            if v.is_finite() && v >= 0.0 {
                Ok(())
            } else {
                Err(bad(name, "a finite number ≥ 0", v))
            }
        };
        let unit = |name: &str, v: f32| {
            if (0.0..1.0).contains(&v) {
                Ok(())
            } else {
                Err(bad(name, "a number in [0, 1)", v))
            }
        };
        positive("lr", self.lr)?;
        if self.lr > MAX_LR {
            return Err(bad("lr", &format!("at most {MAX_LR}"), self.lr));
        }
        for (name, v) in [("weight_decay", self.weight_decay), ("anchor_l2", self.anchor_l2)] {
            if v > MAX_DECAY {
                return Err(bad(name, &format!("at most {MAX_DECAY}"), v));
            }
        }
        positive("eps", self.eps)?;
        unit("beta1", self.beta1)?;
        unit("beta2", self.beta2)?;
        unit("baseline_momentum", self.baseline_momentum)?;
        non_negative("weight_decay", self.weight_decay)?;
        non_negative("max_grad_norm", self.max_grad_norm)?;
        non_negative("anchor_l2", self.anchor_l2)
    }
}

/// Check a batch against the model's vocabulary and the session's capacity (`max_tokens` per
/// event, `max_response` response tokens per event).
pub(crate) fn validate_events(
    events: &[TokenEvent],
    vocab: usize,
    max_tokens: usize,
    max_response: usize,
) -> Result<(), LearnError> {
    if events.is_empty() {
        return Err(bad("events", "at least one event", "none"));
    }
    for (i, e) in events.iter().enumerate() {
        if e.prompt.is_empty() {
            return Err(bad(format!("events[{i}].prompt"), "at least one token", "none"));
        }
        if e.response.is_empty() {
            return Err(bad(format!("events[{i}].response"), "at least one token", "none"));
        }
        for (field, ids) in [("prompt", &e.prompt), ("response", &e.response)] {
            if let Some((j, id)) = ids.iter().enumerate().find(|(_, &id)| id as usize >= vocab) {
                return Err(bad(format!("events[{i}].{field}[{j}]"), &format!("a token id < {vocab}"), id));
            }
        }
        let total = e.prompt.len() + e.response.len();
        if total > max_tokens {
            return Err(bad(format!("events[{i}]"), &format!("at most {max_tokens} tokens in all"), total));
        }
        if e.response.len() > max_response {
            return Err(bad(
                format!("events[{i}].response"),
                &format!("at most {max_response} tokens"),
                e.response.len(),
            ));
        }
        if let Signal::Score(s) = e.signal {
            if !(0.0..=1.0).contains(&s) {
                return Err(bad(format!("events[{i}].score"), "a number in [0, 1]", s));
            }
        }
    }
    Ok(())
}

/// Whether the backward reaches `proj` of `layer`: one of the [`LEARNABLE`] projections of the
/// last layer.
pub(crate) fn check_learnable(config: &TextConfig, layer: usize, proj: Proj) -> Result<(), LearnError> {
    let last = config.num_layers() - 1;
    let why = if layer != last {
        format!("only the last layer ({last}) can learn; the backward stops at its input")
    } else if !LEARNABLE.contains(&proj) {
        "Gated DeltaNet projections need the delta-rule backward, not implemented".to_string()
    } else {
        return Ok(());
    };
    Err(LearnError::NotLearnable { layer, module: proj.path().into(), why })
}

/// The PEFT-initialised adapter a [`TrainSpec`] describes: A Kaiming-uniform (bound 1/√in, as
/// `nn.init.kaiming_uniform_(a=√5)`) from the seed, B zero, so it starts as the base model.
pub(crate) fn init_adapter(config: &TextConfig, spec: &TrainSpec) -> Result<ParsedAdapter, LearnError> {
    let last = config.num_layers() - 1;
    let layers = spec.layers.clone().unwrap_or_else(|| vec![last]);
    if layers.is_empty() {
        return Err(bad("layers", "at least one layer", "none"));
    }
    for (i, &layer) in layers.iter().enumerate() {
        if layer > last {
            return Err(bad(format!("layers[{i}]"), &format!("a layer index < {}", last + 1), layer));
        }
        if layers[..i].contains(&layer) {
            return Err(bad("layers", "distinct layer indices", format!("{layer} twice")));
        }
    }
    if spec.rank == 0 || spec.rank > MAX_TRAIN_RANK {
        return Err(bad("rank", &format!("1..={MAX_TRAIN_RANK}"), spec.rank));
    }
    if !(spec.alpha.is_finite() && spec.alpha > 0.0) {
        return Err(bad("alpha", "a finite number > 0", spec.alpha));
    }
    if f64::from(spec.alpha) / spec.rank as f64 > MAX_SCALING {
        return Err(bad("alpha", &format!("alpha / rank ({}) of at most {MAX_SCALING}", spec.rank), spec.alpha));
    }
    if spec.targets.is_empty() {
        return Err(bad("targets", "at least one projection", "none"));
    }
    let mut deltas = Vec::new();
    for &layer in &layers {
        for (k, &proj) in spec.targets.iter().enumerate() {
            if spec.targets[..k].contains(&proj) {
                return Err(bad("targets", "distinct projections", proj.name()));
            }
            check_learnable(config, layer, proj)?;
            let (fan_in, fan_out) = proj.dims(config);
            let elements = spec.rank.checked_mul(fan_in.max(fan_out)).filter(|&n| n <= MAX_LORA_ELEMENTS);
            if elements.is_none() {
                return Err(bad(
                    "rank",
                    &format!("a rank whose {} LoRA matrices hold at most {MAX_LORA_ELEMENTS} elements", proj.name()),
                    spec.rank,
                ));
            }
            let mut rng = SplitMix64(spec.seed ^ ((layer as u64) << 32) ^ (k as u64 + 1).wrapping_mul(0x9E37_79B9));
            let bound = 1.0 / (fan_in as f64).sqrt();
            let a = (0..spec.rank * fan_in).map(|_| ((rng.next_f64() * 2.0 - 1.0) * bound) as f32).collect();
            let scaling = spec.alpha / spec.rank as f32;
            deltas.push(ModuleDelta { layer, proj, rank: spec.rank, scaling, a, b: vec![0.0; fan_out * spec.rank] });
        }
    }
    let name = spec.id.clone().unwrap_or_else(|| "feedback".into());
    let mut config = PeftConfig::none();
    config.source = ConfigSource::Trainable;
    Ok(ParsedAdapter { path: PathBuf::new(), name, config, deltas, ignored: Vec::new(), ignored_count: 0 })
}
