// What every nn.Linear kernel shares (prepended to matmul.wgsl, matvec.wgsl and
// matvec_batch.wgsl by the loader, after weights.wgsl): the parameters, the bindings and the
// LoRA expand's layout (each kernel adds the expand its own way: matvec.wgsl's lora_row,
// matvec_batch.wgsl's add_expand, matmul.wgsl's lora_tile).
//
// x: f32 activations [M, K] (row stride x_stride, starting x_offset).
// w: one row-chunk of a weight in its checkpoint dtype (weights.wgsl), [N, K] row-major.
// y: f32 [M, *] (row stride y_stride, starting y_offset; a chunk's first row lands at column
//    y_offset % y_stride, so a weight split across bindings writes into one output).
// w_row0: the weight row (of the binding) where this dispatch's row 0 is (a dispatch computes a
//    row range of a chunk: one projection of a concatenated weight).
// q_sb: affine weights: the u32 index of the chunk's scales and biases.
// LoRA: the dispatch's rows, numbered from lora_row0, fall in up to 4 segments of consecutive
//    rows (the projections of a concatenated weight), segment j ending at seg_end[j]; each has
//    its rank, its first column in t (f32 [M, lora_t_stride]), the element of B (f32, every
//    segment's [rows, rank] in one buffer) of its row 0, and its scale. Rank 0: no adapter on
//    those rows. matvec.wgsl and matvec_batch.wgsl take all of them; matmul.wgsl takes segment
//    0 only (one projection per tiled dispatch).
// Scale table: unless lora_sc is NO_TABLE, every t element is also multiplied by the element of
//    t's buffer at lora_sc + m * lora_sc_stride + (its column): one factor per rank column (an
//    adapter set stacks several adapters' ranks in one segment, each with its own scale), per row
//    of t when lora_sc_stride > 0. The single-token matvec multiplies them in once per workgroup
//    while staging t of at most 256 columns (t_staged), not once per output row.
// Split shrink (the matvecs): when lora_parts > 0, t is not read from its buffer but summed from
//    lora_parts parts in x, part q's column c at x element lora_parts_at + q * (lora_t_stride
//    rounded up to 4) + c (the token mixers' decode kernels write them per head after their
//    output row, a shrink out per workgroup); the kernel sums them into workgroup memory in its
//    prologue. With NORM the parts are of x * (1 + aux) before the norm's scale (a residual
//    projection's shrink out) and the expand is multiplied by that scale. The batched matvec
//    takes them for each token (token tk's parts after token tk - 1's) without NORM or GLU.
// Shrink out (matvec only): when out_rank > 0, the dispatch also writes the LoRA shrink of its
//    output for the projections that read it next, split by workgroup: part w's column r at y
//    element out_at + w * (out_rank rounded up to 4) + r, the sum over the workgroup's outputs o
//    of y[o] * out_a[r, o] (out_a f32 [out_rank, n]; y[o] as stored, after SwiGLU or the residual
//    add); those projections sum the parts as a split shrink. A SwiGLU layer writes down_proj's;
//    a residual projection (o_proj, out_proj, down_proj) writes the next block's input group's,
//    whose input is the residual through the block's RMSNorm1p: with out_norm = 1 each output is
//    taken times (1 + aux[o]) (the norm's weight, bound where a fused norm's would be), and the
//    reading projection, which fuses that norm (NORM), multiplies its expand by the norm's scale
//    rsqrt(mean(y^2) + eps) that only the whole row gives.
// Norm out (matvec only): when xw_at > 0, a residual projection also writes its outputs times
//    (1 + aux[o]) (the next block's RMSNorm1p weight, bound as for out_norm) at y element
//    xw_at + o, and each workgroup the sum of its outputs' squares at y element ssq_at + (its
//    index): the next block's projections read that input as it is (NORM with ssq_parts > 0: no
//    norm weight loaded beside every x value, no x^2 summed) and sum the ssq_parts parts from x
//    element ssq_parts_at for the norm's scale.
// Accumulation is f32. ACCUMULATE adds into y (the residual add of o_proj/out_proj/down_proj).

override ACCUMULATE: bool = false;

// lora_sc when the expand has no scale table.
const NO_TABLE: u32 = 0xffffffffu;

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
    q_sb: u32,
    lora_sc: u32,
    lora_sc_stride: u32,
    lora_parts: u32,
    lora_parts_at: u32,
    out_rank: u32,
    out_at: u32,
    out_norm: u32,
    xw_at: u32,
    ssq_at: u32,
    ssq_parts: u32,
    ssq_parts_at: u32,
    k_span: u32,     // matmul: inputs one slice of a split reduction takes (k: unsplit)
    seg_end: vec4<u32>,
    seg_rank: vec4<u32>,
    seg_t: vec4<u32>,
    seg_b: vec4<u32>,
    seg_scale: vec4<f32>,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;
@group(0) @binding(3) var<storage, read> t: array<vec4<f32>>;
@group(2) @binding(0) var<storage, read> lora_b: array<vec4<f32>>;

// Flat element e of x, of t and of B.
fn x_elem(e: u32) -> f32 {
    return x[e >> 2u][e & 3u];
}

fn t_elem(e: u32) -> f32 {
    return t[e >> 2u][e & 3u];
}

// LoRA segment j's first row, numbered from lora_row0 (segment j ends at seg_end[j]).
fn seg_start(j: u32) -> u32 {
    if (j == 0u) {
        return 0u;
    }
    return p.seg_end[j - 1u];
}

fn b_elem(e: u32) -> f32 {
    return lora_b[e >> 2u][e & 3u];
}

// Flat element e of the weight chunk, widened to f32.
fn weight_at(e: u32) -> f32 {
    return weight_elem(e, p.q_sb);
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
