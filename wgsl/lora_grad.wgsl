// g[i, j] (+)= scale * sum_t a[t, i] * b[t, j]: a LoRA weight gradient as a sum over tokens of
// outer products (dB = s * dy^T (x A^T), dA = s * (dy B)^T x). One invocation per element of g;
// the rank side is small, so g is small and the token loop is short. f32 throughout.

struct Params {
    rows: u32,      // i range
    cols: u32,      // j range
    tokens: u32,
    a_offset: u32,
    a_stride: u32,
    b_offset: u32,
    b_stride: u32,
    g_offset: u32,
    g_stride: u32,
    accumulate: u32,
    scale: f32,
    _pad: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> a: array<f32>;
@group(0) @binding(2) var<storage, read> b: array<f32>;
@group(0) @binding(3) var<storage, read_write> g: array<f32>;

@compute @workgroup_size(64)
fn lora_grad(@builtin(global_invocation_id) gid: vec3<u32>) {
    let j = gid.x;
    let i = gid.y;
    if (i >= p.rows || j >= p.cols) {
        return;
    }
    var acc = 0.0;
    for (var t = 0u; t < p.tokens; t++) {
        acc = fma(a[p.a_offset + t * p.a_stride + i], b[p.b_offset + t * p.b_stride + j], acc);
    }
    let o = p.g_offset + i * p.g_stride + j;
    var v = acc * p.scale;
    if (p.accumulate != 0u) {
        v += g[o];
    }
    g[o] = v;
}
