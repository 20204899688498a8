//! Tier 1 (no GPU): every WGSL file parses and validates, and every pipeline variant the engine
//! creates translates to Metal (MSL 2.4 and 3.1) and SPIR-V with naga.

use naga::back::msl;
use naga::valid::{Capabilities, ValidationFlags, Validator};
use qwen35_wgpu::gpu::{Affine, HalfType};
use qwen35_wgpu::kernels::{Kernel, PipelineKey, Shader, KERNELS, SHADERS};
use qwen35_wgpu::model::Dtype;

fn parse(shader: Shader) -> (naga::Module, naga::valid::ModuleInfo) {
    check_source(&shader.source()).unwrap_or_else(|e| panic!("{}: {e}", shader.file_name()))
}

/// WGSL source parsed and validated as every shader of the suite is.
fn check_source(src: &str) -> Result<(naga::Module, naga::valid::ModuleInfo), String> {
    let module =
        naga::front::wgsl::parse_str(src).map_err(|e| format!("does not parse:\n{}", e.emit_to_string(src)))?;
    let info = Validator::new(ValidationFlags::all(), msl::supported_capabilities())
        .validate(&module)
        .map_err(|e| format!("does not validate: {e:?}"))?;
    Ok((module, info))
}

fn resource_map(module: &naga::Module, entry: &str) -> msl::EntryPointResourceMap {
    let mut resources = msl::BindingMap::new();
    let mut slots = [0u8; 3];
    for (_, var) in module.global_variables.iter() {
        let Some(binding) = var.binding else { continue };
        let mutable =
            matches!(var.space, naga::AddressSpace::Storage { access } if access.contains(naga::StorageAccess::STORE));
        let slot = &mut slots[binding.group as usize % 3];
        let buffer = (binding.group as u8) * 16 + *slot;
        *slot += 1;
        resources.insert(binding, msl::BindTarget { buffer: Some(buffer), mutable, ..Default::default() });
    }
    let mut map = msl::EntryPointResourceMap::new();
    map.insert(entry.to_string(), msl::EntryPointResources { resources, sizes_buffer: Some(30), ..Default::default() });
    map
}

/// Every weight dtype the decoder takes: the float ones, affine at each bit width and group
/// size with bf16 scales, and with f16 scales once.
fn dtypes() -> Vec<Dtype> {
    let mut d = vec![Dtype::F32, Dtype::BF16, Dtype::F16];
    for bits in Affine::BITS {
        for group in Affine::GROUPS {
            d.push(Dtype::Affine(Affine { bits, group, scales: HalfType::BF16 }));
        }
    }
    d.push(Dtype::Affine(Affine { bits: 4, group: 64, scales: HalfType::F16 }));
    d
}

fn keys() -> Vec<PipelineKey> {
    let mut keys = Vec::new();
    for kernel in Kernel::all() {
        for dtype in dtypes() {
            for accumulate in [false, true] {
                for &variant in kernel.variants() {
                    let key = PipelineKey { kernel, dtype, accumulate, variant };
                    if !keys.iter().any(|k: &PipelineKey| k.constants() == key.constants() && k.kernel == kernel) {
                        keys.push(key);
                    }
                }
            }
        }
    }
    keys
}

#[test]
fn every_shader_parses_and_validates() {
    for shader in Shader::all() {
        parse(shader);
    }
}

/// The files the loader prepends to shaders (`Shader::source`): no entry points of their own.
const INCLUDES: [&str; 6] =
    ["prelude.wgsl", "weights.wgsl", "linear.wgsl", "attention_common.wgsl", "attention_cached.wgsl", "reduce.wgsl"];

#[test]
fn the_kernel_table_lists_every_entry_point_of_every_shader_once() {
    for (i, d) in KERNELS.iter().enumerate() {
        assert_eq!(d.kernel as usize, i, "{:?} is out of place in KERNELS", d.kernel);
    }
    for (i, d) in SHADERS.iter().enumerate() {
        assert_eq!(d.shader as usize, i, "{:?} is out of place in SHADERS", d.shader);
    }
    for shader in Shader::all() {
        let (module, _) = parse(shader);
        // A shader appended to another's file has that file's entry points in its module too.
        let inherited: Vec<&str> = shader
            .extends()
            .map_or(Vec::new(), |b| KERNELS.iter().filter(|d| d.shader == b).map(|d| d.entry).collect());
        let mut in_file: Vec<&str> =
            module.entry_points.iter().map(|e| e.name.as_str()).filter(|e| !inherited.contains(e)).collect();
        let mut in_table: Vec<&str> = KERNELS.iter().filter(|d| d.shader == shader).map(|d| d.entry).collect();
        in_file.sort_unstable();
        in_table.sort_unstable();
        assert_eq!(in_table, in_file, "{}: entry points in KERNELS vs in the file", shader.file_name());
    }
    let files: Vec<String> = std::fs::read_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/wgsl"))
        .expect("wgsl/")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .filter(|f| f.ends_with(".wgsl") && !INCLUDES.contains(&f.as_str()))
        .collect();
    for f in &files {
        assert!(SHADERS.iter().any(|d| d.file == f), "wgsl/{f} is not in SHADERS");
    }
}

#[test]
fn every_pipeline_variant_translates_to_msl_and_spirv() {
    for key in keys() {
        let shader = key.kernel.shader();
        let entry = key.kernel.entry();
        let (module, info) = parse(shader);
        let mut constants = naga::back::PipelineConstants::default();
        for (name, value) in key.constants() {
            constants.insert(name.to_string(), value);
        }
        let (module, info) = naga::back::pipeline_constants::process_overrides(
            &module,
            &info,
            Some((naga::ShaderStage::Compute, entry)),
            &constants,
        )
        .unwrap_or_else(|e| panic!("{key:?}: overrides: {e:?}"));
        for lang_version in [(2, 4), (3, 1)] {
            let options = msl::Options {
                lang_version,
                per_entry_point_map: resource_map(&module, entry),
                fake_missing_bindings: false,
                bounds_check_policies: naga::proc::BoundsCheckPolicies {
                    index: naga::proc::BoundsCheckPolicy::Restrict,
                    buffer: naga::proc::BoundsCheckPolicy::Restrict,
                    image_load: naga::proc::BoundsCheckPolicy::Restrict,
                    binding_array: naga::proc::BoundsCheckPolicy::Unchecked,
                },
                zero_initialize_workgroup_memory: false,
                ..Default::default()
            };
            let pipeline = msl::PipelineOptions {
                entry_point: Some((naga::ShaderStage::Compute, entry.to_string())),
                ..Default::default()
            };
            let (text, _) = msl::write_string(&module, &info, &options, &pipeline)
                .unwrap_or_else(|e| panic!("{key:?}: MSL {lang_version:?}: {e:?}"));
            assert!(text.contains("kernel void"), "{key:?}: no kernel in MSL");
        }
        let spv_options = naga::back::spv::Options { lang_version: (1, 3), ..Default::default() };
        let spv_pipeline = naga::back::spv::PipelineOptions {
            shader_stage: naga::ShaderStage::Compute,
            entry_point: entry.to_string(),
        };
        let words = naga::back::spv::write_vec(&module, &info, &spv_options, Some(&spv_pipeline))
            .unwrap_or_else(|e| panic!("{key:?}: SPIR-V: {e:?}"));
        assert_eq!(words[0], 0x0723_0203, "{key:?}: not a SPIR-V module");
    }
}

/// The portable shaders need no subgroup capability (they run on any WebGPU device); the ones
/// that use subgroups say so, so the engine compiles them only where the device has them.
#[test]
fn only_the_subgroup_shaders_use_subgroup_operations() {
    let portable = msl::supported_capabilities() - Capabilities::SUBGROUP - Capabilities::SUBGROUP_BARRIER;
    for shader in Shader::all() {
        let src = shader.source();
        let module = naga::front::wgsl::parse_str(&src).expect("parses");
        let valid = Validator::new(ValidationFlags::all(), portable).validate(&module).is_ok();
        assert_eq!(valid, !shader.needs_subgroups(), "{}: validates without subgroups", shader.file_name());
    }
}

/// The suite's check refuses a type error and, past the parser, a type Metal cannot run (f64:
/// validated with the MSL backend's capabilities, not naga's defaults), and takes the f32 one.
#[test]
fn the_suite_check_rejects_broken_shaders() {
    let type_error = "@compute @workgroup_size(64) fn main() { let x: f32 = 1u; }";
    let e = check_source(type_error).expect_err("a type error");
    assert!(e.contains("does not parse"), "{e}");
    let shader = |decl: &str| format!("{decl} @compute @workgroup_size(64) fn main() {{ _ = x; }}");
    let e = check_source(&shader("var<private> x: f64 = 1.0lf;")).expect_err("f64 on Metal");
    assert!(e.contains("does not validate") && e.contains("FLOAT64"), "{e}");
    assert!(check_source(&shader("var<private> x: f32 = 1.0;")).is_ok(), "the same in f32");
}

/// The value of the `u32` constant `name` declared in `shader`.
fn shader_const(shader: Shader, name: &str) -> u32 {
    let (module, _) = parse(shader);
    let (_, c) = module
        .constants
        .iter()
        .find(|(_, c)| c.name.as_deref() == Some(name))
        .unwrap_or_else(|| panic!("{} declares no {name}", shader.file_name()));
    match module.global_expressions[c.init] {
        naga::Expression::Literal(naga::Literal::U32(v)) => v,
        ref e => panic!("{name} in {} is not a u32 literal: {e:?}", shader.file_name()),
    }
}

#[test]
fn the_config_limits_are_the_shaders_limits() {
    let attention = shader_const(Shader::Attention, "WG") * shader_const(Shader::Attention, "MAX_DIMS");
    assert_eq!(attention as usize, qwen35_wgpu::kernels::attention::MAX_HEAD_DIM);
    assert_eq!(shader_const(Shader::GdnConv, "MAX_K") as usize, qwen35_wgpu::kernels::gdn::MAX_CONV_K);
}
