//! The twelve LoRA-targetable projections of Qwen 3.5, their widths, and which projections share
//! an input (and therefore one shrink dispatch).

use crate::model::{LayerType, TextConfig};

/// A linear projection of a decoder layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Proj {
    /// `self_attn.q_proj` (its output includes the gate rows).
    QProj,
    /// `self_attn.k_proj`.
    KProj,
    /// `self_attn.v_proj`.
    VProj,
    /// `self_attn.o_proj`.
    OProj,
    /// `linear_attn.in_proj_qkv`.
    InProjQkv,
    /// `linear_attn.in_proj_z`.
    InProjZ,
    /// `linear_attn.in_proj_b`.
    InProjB,
    /// `linear_attn.in_proj_a`.
    InProjA,
    /// `linear_attn.out_proj`.
    OutProj,
    /// `mlp.gate_proj`.
    GateProj,
    /// `mlp.up_proj`.
    UpProj,
    /// `mlp.down_proj`.
    DownProj,
}

/// Projections that read the same input within a layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum InputGroup {
    /// The normalised input of the token mixer (q/k/v, or the four GDN input projections).
    MixerIn = 0,
    /// The token mixer's output projection.
    MixerOut = 1,
    /// The normalised input of the MLP (gate, up).
    MlpIn = 2,
    /// The MLP's down projection.
    MlpOut = 3,
}

impl Proj {
    /// All twelve, in the order used inside an input group.
    pub const ALL: [Proj; 12] = [
        Proj::QProj,
        Proj::KProj,
        Proj::VProj,
        Proj::OProj,
        Proj::InProjQkv,
        Proj::InProjZ,
        Proj::InProjB,
        Proj::InProjA,
        Proj::OutProj,
        Proj::GateProj,
        Proj::UpProj,
        Proj::DownProj,
    ];

    /// The gated attention's projections (full-attention layers).
    pub const ATTENTION: [Proj; 4] = [Proj::QProj, Proj::KProj, Proj::VProj, Proj::OProj];
    /// The Gated DeltaNet's projections (linear-attention layers).
    pub const GDN: [Proj; 5] = [Proj::InProjQkv, Proj::InProjZ, Proj::InProjB, Proj::InProjA, Proj::OutProj];
    /// The MLP's projections (every layer).
    pub const MLP: [Proj; 3] = [Proj::GateProj, Proj::UpProj, Proj::DownProj];

    /// Position in [`Proj::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }

    /// The leaf name PEFT's `target_modules` uses.
    pub fn name(self) -> &'static str {
        self.path().rsplit('.').next().unwrap_or_default()
    }

    /// The module path inside a layer (`self_attn.q_proj`, …).
    pub fn path(self) -> &'static str {
        match self {
            Proj::QProj => "self_attn.q_proj",
            Proj::KProj => "self_attn.k_proj",
            Proj::VProj => "self_attn.v_proj",
            Proj::OProj => "self_attn.o_proj",
            Proj::InProjQkv => "linear_attn.in_proj_qkv",
            Proj::InProjZ => "linear_attn.in_proj_z",
            Proj::InProjB => "linear_attn.in_proj_b",
            Proj::InProjA => "linear_attn.in_proj_a",
            Proj::OutProj => "linear_attn.out_proj",
            Proj::GateProj => "mlp.gate_proj",
            Proj::UpProj => "mlp.up_proj",
            Proj::DownProj => "mlp.down_proj",
        }
    }

    /// Parse a module path inside a layer.
    pub fn from_path(path: &str) -> Option<Proj> {
        Proj::ALL.into_iter().find(|p| p.path() == path)
    }

    /// The layer type that has this projection (`None`: every layer, the MLP).
    pub fn layer_type(self) -> Option<LayerType> {
        match self {
            Proj::QProj | Proj::KProj | Proj::VProj | Proj::OProj => Some(LayerType::Full),
            Proj::InProjQkv | Proj::InProjZ | Proj::InProjB | Proj::InProjA | Proj::OutProj => Some(LayerType::Linear),
            Proj::GateProj | Proj::UpProj | Proj::DownProj => None,
        }
    }

    /// `(in_features, out_features)` for this model.
    pub fn dims(self, c: &TextConfig) -> (usize, usize) {
        let h = c.hidden_size;
        let attn = c.num_heads * c.head_dim;
        let kv = c.num_kv_heads * c.head_dim;
        match self {
            Proj::QProj => (h, 2 * attn),
            Proj::KProj | Proj::VProj => (h, kv),
            Proj::OProj => (attn, h),
            Proj::InProjQkv => (h, c.conv_dim()),
            Proj::InProjZ => (h, c.value_dim()),
            Proj::InProjB | Proj::InProjA => (h, c.linear_value_heads),
            Proj::OutProj => (c.value_dim(), h),
            Proj::GateProj | Proj::UpProj => (h, c.intermediate_size),
            Proj::DownProj => (c.intermediate_size, h),
        }
    }

    /// The input group.
    pub fn group(self) -> InputGroup {
        match self {
            Proj::QProj | Proj::KProj | Proj::VProj => InputGroup::MixerIn,
            Proj::InProjQkv | Proj::InProjZ | Proj::InProjB | Proj::InProjA => InputGroup::MixerIn,
            Proj::OProj | Proj::OutProj => InputGroup::MixerOut,
            Proj::GateProj | Proj::UpProj => InputGroup::MlpIn,
            Proj::DownProj => InputGroup::MlpOut,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_groups_share_inputs() {
        for p in Proj::ALL {
            assert_eq!(Proj::from_path(p.path()), Some(p));
            assert!(p.path().ends_with(p.name()));
        }
        let cfg = TextConfig::from_json(
            r#"{"model_type":"qwen3_5_text","vocab_size":16,"hidden_size":8,"intermediate_size":12,
            "num_hidden_layers":2,"num_attention_heads":2,"num_key_value_heads":1,"head_dim":8,
            "linear_conv_kernel_dim":4,"linear_key_head_dim":3,"linear_value_head_dim":5,
            "linear_num_key_heads":1,"linear_num_value_heads":2,"rope_parameters":{"rope_theta":1e7}}"#,
        )
        .expect("config");
        for a in Proj::ALL {
            for b in Proj::ALL {
                if a.group() == b.group() && a.layer_type() == b.layer_type() {
                    assert_eq!(a.dims(&cfg).0, b.dims(&cfg).0, "{a:?} and {b:?} share an input");
                }
            }
        }
    }
}
