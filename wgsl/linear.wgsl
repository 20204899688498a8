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

// Eight 16-bit weights of one vec4<u32>: even elements (low halves) and odd ones (high halves).
fn even_odd(v: vec4<u32>) -> array<vec4<f32>, 2> {
    if (W_DTYPE == 1u) {
        return array<vec4<f32>, 2>(bitcast<vec4<f32>>(v << vec4<u32>(16u)), bitcast<vec4<f32>>(v & vec4<u32>(0xffff0000u)));
    }
    let a = unpack2x16float(v.x);
    let b = unpack2x16float(v.y);
    let c = unpack2x16float(v.z);
    let d = unpack2x16float(v.w);
    return array<vec4<f32>, 2>(vec4<f32>(a.x, b.x, c.x, d.x), vec4<f32>(a.y, b.y, c.y, d.y));
}

// Dot product of 8 weights (one vec4<u32> of 16-bit weights, or two vec4 of f32 words) with
// the x chunk (xe: even elements, xo: odd elements for 16-bit; xe, xo: the two halves for f32).
fn dot8(row_vec: u32, j: u32, xe: vec4<f32>, xo: vec4<f32>) -> f32 {
    if (W_DTYPE == 0u) {
        return dot(bitcast<vec4<f32>>(w[row_vec + 2u * j]), xe) + dot(bitcast<vec4<f32>>(w[row_vec + 2u * j + 1u]), xo);
    }
    let wv = even_odd(w[row_vec + j]);
    return dot(wv[0], xe) + dot(wv[1], xo);
}

// s * t . B[row] for row `row` of the dispatch and the row of t from element t_row (added by the
// invocation that stores the output), with the rank, t columns, B rows and scale of the segment
// the row falls in (matvec kernels).
fn lora_row(row: u32, t_row: u32) -> f32 {
    let g = p.lora_row0 + row;
    let j = min(u32(g >= p.seg_end.x) + u32(g >= p.seg_end.y) + u32(g >= p.seg_end.z), 3u);
    var start = 0u;
    if (j > 0u) {
        start = p.seg_end[j - 1u];
    }
    let rank = p.seg_rank[j];
    let b0 = p.seg_b[j] + (g - start) * rank;
    let t0 = t_row + p.seg_t[j];
    var acc = 0.0;
    for (var c = 0u; c < rank; c++) {
        acc = fma(lora_b[b0 + c], t[t0 + c], acc);
    }
    return acc * p.seg_scale[j];
}
