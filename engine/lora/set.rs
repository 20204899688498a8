//! Adapter sets: several resident adapters active at once, each with its scale and optional
//! per-layer / per-projection factors. Their deltas are summed as peft sums its active adapters
//! (`base_model.set_adapter([...])`): `y = W·x + Σᵢ sᵢ·fᵢ(layer, proj)·(alpha/r)ᵢ·Bᵢ·Aᵢ·x`.
//!
//! On the GPU a set of one adapter binds it directly (the factors go into each segment's scale).
//! Several adapters are stacked (`LoraAdapter::stack`): per (layer, input group)
//! their A matrices are concatenated along the rank (`[A₁; A₂]`, one shrink dispatch) and each
//! projection's B matrices side by side (`[B₁ | B₂]`, one fused expand), and a table of one factor
//! per rank column (`sᵢ·fᵢ·(alpha/r)ᵢ`, written into the session's t buffer) gives every
//! adapter's ranks their own scale. Changing scales or factors rewrites that table only; the
//! stack is rebuilt (the resident adapters' weights read back and uploaded as one) when the set's
//! nonzero members change; a session keeps the last stack it built.

use std::ops::Range;

use crate::error::AdapterError;
use crate::lora::{Proj, MAX_SCALE};

/// Most adapters one set stacks.
pub const MAX_SET: usize = 16;

/// Most rules of one [`LayerScales`].
pub const MAX_LAYER_RULES: usize = 1024;

/// Factors that multiply one adapter's scale per (layer, projection): every rule whose layers
/// and projections match multiplies in its factor (1 where none matches). A factor of 0 turns the
/// adapter off there.
///
/// ```
/// use qwen35_wgpu::lora::{LayerScales, Proj};
/// // Only the last 8 of 24 layers, and no attention LoRA.
/// let f = LayerScales::default().layers(0..16, 0.0).projections(&Proj::ATTENTION, 0.0);
/// assert_eq!(f.factor(20, Proj::GateProj), 1.0);
/// assert_eq!(f.factor(20, Proj::QProj), 0.0);
/// assert_eq!(f.factor(3, Proj::GateProj), 0.0);
/// ```
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LayerScales {
    rules: Vec<Rule>,
}

#[derive(Clone, Debug, PartialEq)]
struct Rule {
    layers: Option<Range<usize>>,
    projs: Option<Vec<Proj>>,
    factor: f32,
}

impl LayerScales {
    /// Multiply every projection of `layers` by `factor`.
    pub fn layers(mut self, layers: Range<usize>, factor: f32) -> Self {
        self.rules.push(Rule { layers: Some(layers), projs: None, factor });
        self
    }

    /// Multiply `projs` in every layer by `factor`.
    pub fn projections(mut self, projs: &[Proj], factor: f32) -> Self {
        self.rules.push(Rule { layers: None, projs: Some(projs.to_vec()), factor });
        self
    }

    /// Multiply `projs` of `layers` by `factor`.
    pub fn at(mut self, layers: Range<usize>, projs: &[Proj], factor: f32) -> Self {
        self.rules.push(Rule { layers: Some(layers), projs: Some(projs.to_vec()), factor });
        self
    }

    /// Whether no rule is set (every factor 1).
    pub fn is_empty(&self) -> bool {
        self.rules.is_empty()
    }

    /// The factor of `proj` in `layer`.
    pub fn factor(&self, layer: usize, proj: Proj) -> f32 {
        self.rules
            .iter()
            .filter(|r| r.layers.as_ref().is_none_or(|l| l.contains(&layer)))
            .filter(|r| r.projs.as_ref().is_none_or(|p| p.contains(&proj)))
            .map(|r| r.factor)
            .product()
    }

    /// Check the rules for a model of `num_layers` layers (`adapter` names the adapter in the
    /// error): finite factors, the product of them within [`MAX_SCALE`], layer ranges inside the
    /// model and not empty, at most [`MAX_LAYER_RULES`] rules.
    pub fn check(&self, adapter: &str, num_layers: usize) -> Result<(), AdapterError> {
        let bad = |field: String, expected: &str, found: String| AdapterError::BadLayerScales {
            adapter: adapter.to_string(),
            field,
            expected: expected.to_string(),
            found,
        };
        if self.rules.len() > MAX_LAYER_RULES {
            return Err(bad("rules".into(), "at most 1024 rules", self.rules.len().to_string()));
        }
        for (i, r) in self.rules.iter().enumerate() {
            if !(r.factor.is_finite() && r.factor.abs() <= MAX_SCALE) {
                return Err(bad(
                    format!("rule {i} factor"),
                    "a finite number with |factor| <= 1000",
                    r.factor.to_string(),
                ));
            }
            if let Some(l) = &r.layers {
                if l.start >= l.end || l.end > num_layers {
                    return Err(bad(
                        format!("rule {i} layers"),
                        &format!("a non-empty range within 0..{num_layers}"),
                        format!("{}..{}", l.start, l.end),
                    ));
                }
            }
        }
        for layer in 0..num_layers {
            for proj in Proj::ALL {
                let f = self.factor(layer, proj);
                if !(f.is_finite() && f.abs() <= MAX_SCALE) {
                    return Err(bad(
                        format!("layers.{layer}.{}", proj.path()),
                        "a product of factors with |product| <= 1000",
                        f.to_string(),
                    ));
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn factors_multiply_where_rules_match() {
        let f = LayerScales::default().layers(0..2, 0.5).projections(&[Proj::QProj], 3.0).at(1..2, &[Proj::QProj], 2.0);
        assert_eq!(f.factor(0, Proj::QProj), 1.5);
        assert_eq!(f.factor(1, Proj::QProj), 3.0);
        assert_eq!(f.factor(1, Proj::KProj), 0.5);
        assert_eq!(f.factor(2, Proj::KProj), 1.0);
        assert_eq!(f.factor(2, Proj::QProj), 3.0);
        assert!(LayerScales::default().check("a", 4).is_ok());
    }

    #[test]
    fn bad_rules_are_typed_errors() {
        for (f, field) in [
            (LayerScales::default().layers(0..5, 1.0), "rule 0 layers"),
            (LayerScales::default().layers(2..2, 1.0), "rule 0 layers"),
            (LayerScales::default().projections(&[Proj::QProj], f32::NAN), "rule 0 factor"),
            (LayerScales::default().layers(0..4, 100.0).layers(1..2, 100.0), "layers.1.self_attn.q_proj"),
        ] {
            match f.check("a", 4) {
                Err(AdapterError::BadLayerScales { field: got, .. }) => assert_eq!(got, field),
                other => panic!("{field}: {other:?}"),
            }
        }
    }
}
