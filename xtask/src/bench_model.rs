//! `cargo xtask bench-model DIR`: the benchmark's random-weight model at the Qwen3.5-0.8B text
//! dimensions, and its rank-16 PEFT adapter on all 12 projections (`DIR-lora-r16`), written in
//! Rust from a seed: what `make_fixtures.py --bench-model` writes with torch (the same names,
//! shapes, dtypes, config and initialisation rules; other random values), for machines without
//! Python, such as a lent GPU machine with no network. Tensors are streamed to the file, never
//! held whole.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

use anyhow::{Context, Result};
use qwen35_wgpu::Proj;
use serde_json::{json, Value};

/// A model's text dimensions.
#[derive(Clone, Copy, Debug)]
pub struct Dims {
    pub vocab: usize,
    pub hidden: usize,
    pub intermediate: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub linear_k_heads: usize,
    pub linear_v_heads: usize,
    pub linear_k_dim: usize,
    pub linear_v_dim: usize,
}

/// Qwen3.5-0.8B's text dimensions (`make_fixtures.py`'s `BENCH_MODEL`).
pub const QWEN35_0_8B: Dims = Dims {
    vocab: 248_320,
    hidden: 1024,
    intermediate: 3584,
    layers: 24,
    heads: 8,
    kv_heads: 2,
    head_dim: 256,
    linear_k_heads: 16,
    linear_v_heads: 16,
    linear_k_dim: 128,
    linear_v_dim: 128,
};

const CONV_KERNEL: usize = 4;
const RANK: usize = 16;
const ALPHA: usize = 32;
/// Every layer whose index is 3 mod 4 is full attention (Qwen 3.5's pattern).
const FULL_EVERY: usize = 4;

/// How a tensor's values are drawn.
#[derive(Clone, Copy)]
enum Init {
    /// Normal with this standard deviation.
    Normal(f32),
    /// Uniform in [-1, 1).
    Uniform,
    /// This value everywhere.
    Fill(f32),
}

struct Tensor {
    name: String,
    shape: Vec<usize>,
    init: Init,
}

/// SplitMix64, with normals by Box–Muller.
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    fn normal(&mut self) -> f32 {
        let u = 1.0 - self.unit();
        let v = self.unit();
        ((-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()) as f32
    }

    fn draw(&mut self, init: Init) -> f32 {
        match init {
            Init::Normal(std) => self.normal() * std,
            Init::Uniform => (2.0 * self.unit() - 1.0) as f32,
            Init::Fill(v) => v,
        }
    }
}

fn is_full(layer: usize) -> bool {
    layer % FULL_EVERY == FULL_EVERY - 1
}

/// The checkpoint's tensors, in name order, with `make_fixtures.py`'s initialisation: matrices
/// (and the conv taps) normal with std 1 / sqrt(last dim), the offset norms 0, the gated norm 1,
/// dt_bias 1, A_log uniform in [-1, 1).
fn model_tensors(d: &Dims) -> Vec<Tensor> {
    let mat = |name: String, rows: usize, cols: usize| Tensor {
        name,
        shape: vec![rows, cols],
        init: Init::Normal(1.0 / (cols as f32).sqrt()),
    };
    let vec = |name: String, n: usize, init: Init| Tensor { name, shape: vec![n], init };
    let h = d.hidden;
    let mut t =
        vec![mat("model.embed_tokens.weight".into(), d.vocab, h), vec("model.norm.weight".into(), h, Init::Fill(0.0))];
    for l in 0..d.layers {
        let p = format!("model.layers.{l}.");
        t.push(vec(format!("{p}input_layernorm.weight"), h, Init::Fill(0.0)));
        t.push(vec(format!("{p}post_attention_layernorm.weight"), h, Init::Fill(0.0)));
        t.push(mat(format!("{p}mlp.gate_proj.weight"), d.intermediate, h));
        t.push(mat(format!("{p}mlp.up_proj.weight"), d.intermediate, h));
        t.push(mat(format!("{p}mlp.down_proj.weight"), h, d.intermediate));
        if is_full(l) {
            let a = format!("{p}self_attn.");
            t.push(mat(format!("{a}q_proj.weight"), 2 * d.heads * d.head_dim, h));
            t.push(mat(format!("{a}k_proj.weight"), d.kv_heads * d.head_dim, h));
            t.push(mat(format!("{a}v_proj.weight"), d.kv_heads * d.head_dim, h));
            t.push(mat(format!("{a}o_proj.weight"), h, d.heads * d.head_dim));
            t.push(vec(format!("{a}q_norm.weight"), d.head_dim, Init::Fill(0.0)));
            t.push(vec(format!("{a}k_norm.weight"), d.head_dim, Init::Fill(0.0)));
        } else {
            let a = format!("{p}linear_attn.");
            let key = d.linear_k_heads * d.linear_k_dim;
            let value = d.linear_v_heads * d.linear_v_dim;
            let channels = 2 * key + value;
            t.push(mat(format!("{a}in_proj_qkv.weight"), channels, h));
            t.push(mat(format!("{a}in_proj_z.weight"), value, h));
            t.push(mat(format!("{a}in_proj_b.weight"), d.linear_v_heads, h));
            t.push(mat(format!("{a}in_proj_a.weight"), d.linear_v_heads, h));
            t.push(mat(format!("{a}out_proj.weight"), h, value));
            t.push(Tensor {
                name: format!("{a}conv1d.weight"),
                shape: vec![channels, 1, CONV_KERNEL],
                init: Init::Normal(1.0 / (CONV_KERNEL as f32).sqrt()),
            });
            t.push(vec(format!("{a}A_log"), d.linear_v_heads, Init::Uniform));
            t.push(vec(format!("{a}dt_bias"), d.linear_v_heads, Init::Fill(1.0)));
            t.push(vec(format!("{a}norm.weight"), d.linear_v_dim, Init::Fill(1.0)));
        }
    }
    t.sort_by(|a, b| a.name.cmp(&b.name));
    t
}

/// The adapter's tensors: per adapted projection `lora_A` `[r, in]` (normal, std 1 / sqrt(in))
/// and `lora_B` `[out, r]` (normal, std 0.1 / sqrt(r): a nonzero update of moderate size).
fn adapter_tensors(d: &Dims) -> Vec<Tensor> {
    let model = model_tensors(d);
    let mut t = Vec::new();
    for m in &model {
        let Some(module) = m.name.strip_suffix(".weight") else { continue };
        let proj = module.rsplit('.').next().unwrap_or("");
        if m.shape.len() != 2 || !Proj::ALL.iter().any(|p| p.name() == proj) {
            continue;
        }
        let (out, inp) = (m.shape[0], m.shape[1]);
        let base = format!("base_model.model.{module}");
        t.push(Tensor {
            name: format!("{base}.lora_A.weight"),
            shape: vec![RANK, inp],
            init: Init::Normal(1.0 / (inp as f32).sqrt()),
        });
        t.push(Tensor {
            name: format!("{base}.lora_B.weight"),
            shape: vec![out, RANK],
            init: Init::Normal(0.1 / (RANK as f32).sqrt()),
        });
    }
    t.sort_by(|a, b| a.name.cmp(&b.name));
    t
}

/// Write `tensors` as a safetensors file in bf16 (else f32), values
/// from `rng`, streamed in blocks.
fn write_safetensors(path: &Path, tensors: &[Tensor], bf16: bool, rng: &mut Rng) -> Result<u64> {
    let width = if bf16 { 2 } else { 4 };
    let dtype = if bf16 { "BF16" } else { "F32" };
    let mut header = serde_json::Map::new();
    header.insert("__metadata__".into(), json!({"format": "pt"}));
    let mut offset = 0usize;
    for t in tensors {
        let bytes = t.shape.iter().product::<usize>() * width;
        header.insert(
            t.name.clone(),
            json!({"dtype": dtype, "shape": t.shape, "data_offsets": [offset, offset + bytes]}),
        );
        offset += bytes;
    }
    let mut text = Value::Object(header).to_string().into_bytes();
    text.resize(text.len().next_multiple_of(8), b' ');
    let file = File::create(path).with_context(|| format!("creating {}", path.display()))?;
    let mut w = BufWriter::with_capacity(1 << 22, file);
    w.write_all(&(text.len() as u64).to_le_bytes())?;
    w.write_all(&text)?;
    let mut block = Vec::with_capacity(1 << 20);
    for t in tensors {
        let mut left = t.shape.iter().product::<usize>();
        while left > 0 {
            let n = left.min(1 << 18);
            block.clear();
            for _ in 0..n {
                let v = rng.draw(t.init);
                if bf16 {
                    block.extend_from_slice(&half::bf16::from_f32(v).to_bits().to_le_bytes());
                } else {
                    block.extend_from_slice(&v.to_le_bytes());
                }
            }
            w.write_all(&block)?;
            left -= n;
        }
    }
    w.flush()?;
    Ok(offset as u64)
}

fn config_json(d: &Dims) -> Value {
    let layer_types: Vec<&str> =
        (0..d.layers).map(|l| if is_full(l) { "full_attention" } else { "linear_attention" }).collect();
    json!({
        "architectures": ["Qwen3_5ForCausalLM"],
        "attention_bias": false,
        "attention_dropout": 0.0,
        "bos_token_id": null,
        "dtype": "bfloat16",
        "eos_token_id": null,
        "head_dim": d.head_dim,
        "hidden_act": "silu",
        "hidden_size": d.hidden,
        "initializer_range": 0.02,
        "intermediate_size": d.intermediate,
        "layer_types": layer_types,
        "linear_conv_kernel_dim": CONV_KERNEL,
        "linear_key_head_dim": d.linear_k_dim,
        "linear_num_key_heads": d.linear_k_heads,
        "linear_num_value_heads": d.linear_v_heads,
        "linear_value_head_dim": d.linear_v_dim,
        "max_position_embeddings": 4096,
        "model_type": "qwen3_5_text",
        "num_attention_heads": d.heads,
        "num_hidden_layers": d.layers,
        "num_key_value_heads": d.kv_heads,
        "pad_token_id": null,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {
            "mrope_interleaved": true,
            "mrope_section": [12, 10, 10],
            "partial_rotary_factor": 0.25,
            "rope_theta": 10000000.0,
            "rope_type": "default"
        },
        "tie_word_embeddings": true,
        "use_cache": true,
        "vocab_size": d.vocab
    })
}

fn adapter_config() -> Value {
    json!({
        "peft_type": "LORA",
        "r": RANK,
        "lora_alpha": ALPHA,
        "lora_dropout": 0.0,
        "bias": "none",
        "use_rslora": false,
        "use_dora": false,
        "fan_in_fan_out": false,
        "inference_mode": true,
        "target_modules": Proj::ALL.map(Proj::name),
        "rank_pattern": {},
        "alpha_pattern": {},
        "layers_to_transform": null,
        "layers_pattern": null,
        "modules_to_save": null
    })
}

/// Write the model to `dir` and its adapter to `dir` + `-lora-r16`, from `seed`.
pub fn write(dir: &Path, d: &Dims, seed: u64) -> Result<()> {
    let adapter_dir = dir.with_file_name(format!(
        "{}-lora-r16",
        dir.file_name().context("the model directory needs a name")?.to_string_lossy()
    ));
    let mut rng = Rng(seed);
    for (out, config, file, tensors, bf16) in [
        (dir, config_json(d), "model.safetensors", model_tensors(d), true),
        (adapter_dir.as_path(), adapter_config(), "adapter_model.safetensors", adapter_tensors(d), false),
    ] {
        std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
        let name = if bf16 { "config.json" } else { "adapter_config.json" };
        std::fs::write(out.join(name), serde_json::to_string_pretty(&config)? + "\n")?;
        let bytes = write_safetensors(&out.join(file), &tensors, bf16, &mut rng)?;
        eprintln!("wrote {} ({} tensors, {:.1} MB)", out.display(), tensors.len(), bytes as f64 / 1e6);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    /// Tiny dimensions with both layer kinds: the engine loads the model and the adapter, and a
    /// forward with and without the adapter gives finite, different logits.
    #[test]
    fn the_engine_loads_what_it_writes() {
        let d = Dims {
            vocab: 96,
            hidden: 64,
            intermediate: 96,
            layers: 4,
            heads: 2,
            kv_heads: 1,
            head_dim: 32,
            linear_k_heads: 2,
            linear_v_heads: 4,
            linear_k_dim: 16,
            linear_v_dim: 16,
        };
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/xtask-test/bench-model-tiny");
        write(&dir, &d, 1).expect("written");
        let ctx = Arc::new(qwen35_wgpu::GpuContext::new().expect("a GPU adapter (lavapipe in CI)"));
        let model = Arc::new(qwen35_wgpu::Model::load(ctx, &dir).expect("model loads"));
        assert_eq!(model.config.layer_types.len(), 4);
        let adapter = qwen35_wgpu::LoraAdapter::load(&model, &dir.with_file_name("bench-model-tiny-lora-r16"))
            .expect("adapter loads");
        let logits = |lora: Option<Arc<qwen35_wgpu::LoraAdapter>>| {
            let mut s =
                qwen35_wgpu::Session::new(model.clone(), qwen35_wgpu::SessionOptions::default()).expect("session");
            if let Some(a) = lora {
                s.set_adapters(vec![qwen35_wgpu::ActiveAdapter::new(a, 1.0)]).expect("active");
            }
            s.feed(&[1, 5, 9]).expect("forward").last().expect("a row").to_vec()
        };
        let base = logits(None);
        let with = logits(Some(Arc::new(adapter)));
        assert!(base.iter().chain(&with).all(|v| v.is_finite()));
        assert_ne!(base, with, "the adapter changes the logits");
    }
}
