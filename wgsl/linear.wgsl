// What every nn.Linear kernel shares (prepended to matmul.wgsl and matvec.wgsl by the loader):
// the overrides, the parameters, the bindings and the weight decoder.
//
// x: f32 activations [M, K] (row stride x_stride, starting x_offset).
// w: one row-chunk of a weight in its checkpoint dtype, packed in u32 words, [N, K] row-major.
// y: f32 [M, *] (row stride y_stride, starting y_offset; a chunk's first row lands at column
//    y_offset % y_stride, so a weight split across bindings writes into one output).
// w_row0: the weight row (of the binding) where this dispatch's row 0 is (a dispatch computes a
//    row range of a chunk: one projection of a concatenated weight).
// LoRA: the dispatch's rows, numbered from lora_row0, fall in up to 4 segments of consecutive
//    rows (the projections of a concatenated weight), segment j ending at seg_end[j]; each has
//    its rank, its first column in t (f32 [M, lora_t_stride]), the element of B (f32, every
//    segment's [rows, rank] in one buffer) of its row 0, and its scale. Rank 0: no adapter on
//    those rows. matmul.wgsl takes segment 0 only (one projection per prefill dispatch).
// Accumulation is f32. ACCUMULATE adds into y (the residual add of o_proj/out_proj/down_proj).

override W_DTYPE: u32 = 0u;      // 0 = f32, 1 = bf16, 2 = f16
override ACCUMULATE: bool = false;

struct Params {
    m: u32,
    n: u32,
    k: u32,
    x_offset: u32,
    x_stride: u32,
    y_offset: u32,
    y_stride: u32,
    w_row0: u32,
    lora_t_stride: u32,
    lora_row0: u32,
    eps: f32,        // matvec NORM
    _pad: u32,
    seg_end: vec4<u32>,
    seg_rank: vec4<u32>,
    seg_t: vec4<u32>,
    seg_b: vec4<u32>,
    seg_scale: vec4<f32>,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;
@group(0) @binding(3) var<storage, read> t: array<f32>;
@group(1) @binding(0) var<storage, read> w: array<vec4<u32>>;
@group(2) @binding(0) var<storage, read> lora_b: array<f32>;

// Flat element e of x.
fn x_elem(e: u32) -> f32 {
    return x[e >> 2u][e & 3u];
}

// Flat element e of the weight chunk, widened to f32 (exact).
fn weight_at(e: u32) -> f32 {
    if (W_DTYPE == 0u) {
        return bitcast<f32>(w[e >> 2u][e & 3u]);
    }
    let word = w[e >> 3u][(e >> 1u) & 3u];
    if (W_DTYPE == 1u) {
        return bitcast<f32>(select(word << 16u, word & 0xffff0000u, (e & 1u) == 1u));
    }
    return unpack2x16float(word)[e & 1u];
}
