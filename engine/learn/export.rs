//! Writing a trained adapter as a standard PEFT directory (`adapter_config.json` +
//! `adapter_model.safetensors`, f32, keys `base_model.model.{prefix}layers.{i}.{module}.lora_{A,B}.weight`
//! with the model's [`Model::module_prefix`](crate::model::Model::module_prefix):
//! `model.language_model.` on a VLM save or an MLX conversion of one, else `model.`), loadable by
//! `PeftModel.from_pretrained` on the checkpoint's class and by this engine's `load_adapter`.

use std::collections::BTreeMap;
use std::path::Path;

use safetensors::tensor::{Dtype as StDtype, TensorView};

use crate::error::LearnError;
use crate::learn::ModuleGrad;
use crate::lora::LoraAdapter;
use crate::model::Model;

fn path_of(dir: &Path) -> std::path::PathBuf {
    dir.join("adapter_model.safetensors")
}

fn export_err(path: &Path, message: impl ToString) -> LearnError {
    LearnError::Export { path: path.to_path_buf(), message: message.to_string() }
}

/// Write `weights` (the adapter's current A and B per module) into `dir` (created if missing,
/// once the adapter is known to export). alpha is written as scaling · r, so every module keeps
/// its exact scaling.
pub(crate) fn export_peft(
    dir: &Path,
    model: &Model,
    adapter: &LoraAdapter,
    weights: &[ModuleGrad],
) -> Result<(), LearnError> {
    let mut tensors: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    let mut modules = Vec::new();
    let mut ranks = BTreeMap::new();
    let mut alphas = BTreeMap::new();
    for w in weights {
        let (fan_in, fan_out) = w.proj.dims(&model.config);
        let rank = w.b.len() / fan_out;
        let scaling =
            adapter.group(w.layer, w.proj.group()).and_then(|g| g.member(w.proj)).map(|m| m.scaling).ok_or_else(
                || export_err(dir, format!("layers.{}.{} is not in the adapter", w.layer, w.proj.path())),
            )?;
        let name = format!("{}layers.{}.{}", model.module_prefix, w.layer, w.proj.path());
        ranks.insert(name.clone(), rank);
        alphas.insert(name.clone(), scaling as f64 * rank as f64);
        let key = format!("base_model.model.{name}");
        tensors.push((format!("{key}.lora_A.weight"), vec![rank, fan_in], bytemuck::cast_slice(&w.a).to_vec()));
        tensors.push((format!("{key}.lora_B.weight"), vec![fan_out, rank], bytemuck::cast_slice(&w.b).to_vec()));
        if !modules.contains(&w.proj.name()) {
            modules.push(w.proj.name());
        }
    }
    // Two modules of one key would make the safetensors writer panic: refuse them here.
    let mut keys = std::collections::BTreeSet::new();
    if let Some((k, ..)) = tensors.iter().find(|(k, ..)| !keys.insert(k.as_str())) {
        return Err(export_err(&path_of(dir), format!("the adapter holds {k} twice")));
    }
    let Some((first, &r)) = ranks.iter().next() else {
        return Err(export_err(dir, "the adapter has no modules"));
    };
    let alpha = alphas[first];
    let rank_pattern: BTreeMap<_, _> = ranks.iter().filter(|(_, &v)| v != r).collect();
    let alpha_pattern: BTreeMap<_, _> = alphas.iter().filter(|(_, &v)| v != alpha).collect();
    let mut layers: Vec<usize> = weights.iter().map(|w| w.layer).collect();
    layers.sort_unstable();
    layers.dedup();
    let cfg = serde_json::json!({
        "peft_type": "LORA",
        "r": r,
        "lora_alpha": alpha,
        "target_modules": modules,
        "layers_to_transform": layers,
        "rank_pattern": rank_pattern,
        "alpha_pattern": alpha_pattern,
        "use_rslora": false,
        "use_dora": false,
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": false,
        "init_lora_weights": true,
        "modules_to_save": null,
        "base_model_name_or_path": null,
        "task_type": null,
    });
    // Both files are written under temporary names first, then moved into place (`io::install_pair`): a
    // failed export leaves an earlier one in `dir` whole, never a config without its weights.
    let cfg_path = dir.join("adapter_config.json");
    let cfg_tmp = dir.join("adapter_config.json.tmp");
    let path = dir.join("adapter_model.safetensors");
    let tmp = dir.join("adapter_model.safetensors.tmp");
    let views = tensors
        .iter()
        .map(|(k, shape, bytes)| {
            TensorView::new(StDtype::F32, shape.clone(), bytes)
                .map(|v| (k.clone(), v))
                .map_err(|e| export_err(&path, e))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let meta = [("format".to_string(), "pt".to_string())].into_iter().collect();
    let text = serde_json::to_string_pretty(&cfg).map_err(|e| export_err(&cfg_path, e))?;
    std::fs::create_dir_all(dir).map_err(|e| export_err(dir, e))?;
    let written = safetensors::serialize_to_file(views, Some(meta), &tmp)
        .map_err(|e| export_err(&path, e))
        .and_then(|()| std::fs::write(&cfg_tmp, text).map_err(|e| export_err(&cfg_path, e)))
        .and_then(|()| {
            crate::io::install_pair((&tmp, &path), (&cfg_tmp, &cfg_path)).map_err(|(p, e)| export_err(&p, e))
        });
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
        let _ = std::fs::remove_file(&cfg_tmp);
    }
    written
}
