//! Every tolerance of the test suite, each with its reason.

/// Logits vs transformers, per position: ‖ours − ref‖ / ‖ref‖. Both sides compute in f32, but
/// summation orders differ (tiled GPU dot products vs BLAS; the recurrent delta rule vs
/// transformers' chunked prefill), so agreement is at f32 rounding level, ~1e-6..1e-5.
pub const LOGITS_REL: f32 = 1e-4;

/// Logits vs transformers, max |ours − ref| (logits are O(1..10) here).
pub const LOGITS_MAX_ABS: f32 = 2e-3;

/// Residual stream vs transformers' per-layer hidden states, relative per layer: only used to
/// name the first layer that diverges when logits fail.
pub const HIDDEN_REL: f32 = 1e-4;

/// A kernel vs the CPU reference with inputs of order 1 (absolute part): the GPU's f32 sums (up
/// to ~1,000 terms, blocked) against the reference's (in f64 for `linear`, whose sequential f32
/// sum over 1,024 terms erred by 3.9e-4 on a matvec output an H200 got within 8.5e-5).
pub const KERNEL_ATOL: f32 = 1e-4;

/// A kernel vs the CPU reference, relative part.
pub const KERNEL_RTOL: f32 = 1e-4;

/// Two GPU paths that differ only in batching (prefill chunking, prefill vs decode): the same
/// f32 math, but decode uses the matvec kernel and prefill the tiled matmul, which sum in other
/// orders; the differences compound over layers (seen: up to 1.5e-5 on the 8-layer fixture).
pub const PATHS_REL: f32 = 1e-4;

/// LoRA gradients vs PyTorch autograd, per tensor: ‖ours − ref‖ / ‖ref‖. Both sides are f32, but
/// the backward sums over the vocabulary (lm_head), the hidden and intermediate widths and the
/// tokens in other orders, and the forward underneath already differs at LOGITS_REL; the issue's
/// bound.
pub const GRAD_REL: f32 = 1e-3;

/// An AdamW step on the GPU vs the same update in f64 on the CPU from the same gradients: f32
/// rounding of the moments, the square root and the division, on weights of order 1 moved by
/// steps of order lr = 1e-2.
pub const OPTIM_ABS: f32 = 1e-6;

/// Logits vs mlx-lm's own forward on the same MLX checkpoint, per position: ‖ours − mlx‖ /
/// ‖mlx‖. mlx-lm computes in the checkpoint dtype (bf16 activations, quantized matmuls in the
/// scale dtype: 8 bits of mantissa), we in f32 on the same weights; on these 4-layer random
/// models the bf16 rounding reaches 0.32 (mlx_q4_g64, first positions; 0.07 for mlx_bf16). The
/// exact check is the test beside this one: transformers on the dequantized weights in f32,
/// which mlx-lm's own forward with its parameters cast to f32 matches at 1.5e-5
/// (`make_mlx.py` stops above 1e-3), agrees with us at LOGITS_REL.
pub const MLX_LOGITS_REL: f32 = 0.4;

/// Wall time a hostile adapter input (a 200,000-key pattern map, a catastrophic regex) may take
/// to be refused, on a debug-profile test build on a 2-core CI machine: refusal happens before
/// any key is compiled, so real times are milliseconds; the bound only catches a regression to
/// the 39.5 s the unbounded parser took.
pub const HOSTILE_INPUT_SECONDS: f64 = 5.0;

/// Logits vs mlx-lm's own forward, max |ours − mlx|: no bound. Rounding to bf16 is relative, so
/// the largest logits carry the largest absolute differences and MLX_LOGITS_REL alone is the
/// meaningful check; the absolute one is LOGITS_MAX_ABS against transformers on the same weights.
pub const MLX_LOGITS_MAX_ABS: f32 = f32::INFINITY;

/// A copy without arithmetic (the GDN conv history: the last K − 1 inputs moved from one buffer
/// of the pair to the other) must be exact.
pub const EXACT: f32 = 0.0;

/// 600 matvecs accumulated into the same three outputs (the uniform-arena test) vs 600 × one CPU
/// product, absolute part: the GPU adds 600 rounded products of order 1..3 one after another, so
/// the running sums reach ~10³, where one f32 rounding is ~6e-5, and up to 600 of them add up.
pub const ACCUMULATED_ATOL: f32 = 1e-2;

/// The same, relative part.
pub const ACCUMULATED_RTOL: f32 = 1e-4;

/// Reported gradient norm (the optimiser's f32 sum of squares over every tensor, on the GPU) vs
/// the f64 norm of the same gradients on the CPU, relative: f32 rounding of a few thousand
/// squares.
pub const GRAD_NORM_REL: f32 = 1e-4;

// Effect floors: a check that something changed (or is non-trivial) at least this much, so that
// the comparison beside it cannot pass vacuously.

/// An adapter must move the logits (‖with − base‖ / ‖base‖) by more than this, 100 × LOGITS_REL,
/// so that the parity check against peft would catch an adapter that is not applied.
pub const ADAPTER_EFFECT_REL: f32 = 1e-2;

/// The oracle's gradient of a LoRA tensor must have at least this norm for GRAD_REL to test
/// anything: relative to a gradient that is ~0, any rounding passes or fails at random.
pub const ORACLE_GRAD_NORM_MIN: f32 = 1e-4;

/// Three learning steps at lr 1e-2 must move the logits by more than this relative amount, ten
/// times PATHS_REL (the noise of two forward paths).
pub const LEARN_EFFECT_REL: f32 = 1e-3;

/// Three steps on a scored event must move the response's cross-entropy by more than this many
/// nats/token in the direction of the score: far above the f32 rounding of a CE of order 1, so a
/// step that did nothing cannot pass by noise.
pub const CE_MOVE_NATS: f32 = 1e-3;

/// Drift bound for prompts that were not trained on: the per-token cross-entropy of the base
/// model's own answer may rise by at most this many nats after teaching one answer (the anchor
/// and the small adapter keep the rest of the model's behaviour).
pub const DRIFT_NATS: f32 = 0.05;

/// A sequence decoded one token at a time up to the context limit vs a full prefill of the same
/// ids, per position: ‖decode − prefill‖ / ‖prefill‖. PATHS_REL's two summation orders, plus the
/// recurrent GDN states and the KV cache carrying each step's rounding forward; the difference
/// does not grow with length (measured on lavapipe, `odd_untied_f32`: worst 2.5e-5 over 1,024
/// positions, 2.6e-5 over 4,096; 2.5e-6 and 8.4e-7 at the last position).
pub const LONG_DECODE_REL: f32 = 1e-4;

/// A top-k block's softmax mass (`topk_blocks`: Σ exp((l − m)/T) over 4,096 logits in f32, 16
/// terms per invocation, then a tree of 8 levels) vs the f64 sum, relative: 24 f32 additions
/// deep (~1.4e-6) plus the exponentials' few-ulp errors; the sampler's own margin for these
/// sums is ten times this.
pub const TOPK_MASS_REL: f64 = 1e-5;

/// One learning step must move the logits of a stacked set holding the learner's adapter by
/// more than this (‖after − before‖ / ‖before‖): both are the same deterministic kernels on the
/// same inputs, so a step that did not reach the stack gives exactly 0; the floor only keeps
/// the check clear of a change in the last bit of one logit.
pub const STEP_EFFECT_REL: f32 = 1e-6;

/// The RoPE table's cos / sin vs the formula in f64 (cos(p · θ^(−2i/R))), absolute, per unit of
/// position, in units of 2^-24: the table rounds as transformers does, in f32, the inverse
/// frequency (powf and a division: ≤ 2 ulp, so the angle ≤ 2 p ulp) and the angle p · inv (≤ 1 p
/// ulp since inv ≤ 1); cos and sin move by at most the angle's error. One more per position
/// for slack; the f32 output's own rounding is ROPE_ABS_ULPS.
pub const ROPE_ULPS_PER_POSITION: f64 = 4.0;

/// The RoPE table's output rounding to f32, in units of 2^-24 (half an ulp of values ≤ 1, twice).
pub const ROPE_ABS_ULPS: f64 = 2.0;

/// A kept token's probability vs transformers' (its processors on the same f32 scores, the
/// softmax in f64), absolute: the engine exponentiates f32 differences `l − max` (one rounding
/// of up to |l − max| · 2^-24, under 2e-6 relative for the differences that carry weight here)
/// and renormalises in f64.
pub const SAMPLING_PROB_ABS: f64 = 1e-6;
