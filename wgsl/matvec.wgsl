// y[n] (+)= sum_k w[n, k] * x[k]  [+ s * sum_j t[j] * B[n, j]]   (one token: decode)
//
// nn.Linear for a single row of x, with the LoRA expand optionally fused in (the shrink t = x A^T
// is a separate dispatch shared by the projections of an input group, or summed here from the
// parts the dispatch before wrote: per head by the token mixer's decode kernel, per workgroup by
// a shrink out: linear.wgsl).
//
// Layout: a workgroup of 64 invocations is 64 / LANES row groups of LANES invocations. Each
// invocation owns TM = 8 consecutive rows; the LANES invocations of a row group stride along K
// together, each loading one vec4<u32> of weights per row and step (8 bf16/f16 or 4 f32 weights,
// 16 contiguous bytes, neighbouring invocations reading neighbouring 16 bytes), so the x chunk it
// loads is kept in registers and reused for its 8 rows. Rows per workgroup = 8 * 64 / LANES
// (LANES 8: 64 rows, 16: 32, 32: 16, 64: 8), chosen per shape by the host. Rows past the end are
// clamped to the last row (computed, never stored), so the loop has no bound tests. The partial
// sums of a row are reduced through workgroup memory after one barrier; the invocation that
// stores a row adds its LoRA expand s * t . B[row] (matvec_lora; each row finds its segment of a
// concatenated weight, linear.wgsl). With out_rank > 0 the workgroup then writes its part of the
// next projections' shrink from the outputs it stored (shrink out, linear.wgsl).
//
// Rows are 16-byte aligned when K is a multiple of 8 (one vec4<u32> of 16-bit weights, two of
// f32, per group of 8); other K (and an x offset that is not a multiple of 4) take an
// element-wise path with the same layout. Affine weights (weights.wgsl) step by blocks of one
// vec4<u32> per row (32 4-bit or 16 8-bit codes) with their group's scale and bias.
//
// x: f32 [K] from element x_offset. w: this weight chunk [N, K] in its checkpoint dtype, packed in
// u32 words. y: f32, this chunk's row 0 lands at y_offset. t, B as in linear.wgsl.

override LANES: u32 = 32u;       // invocations along K per row group: 8, 16, 32 or 64
// What the kernel fuses in (the dispatches this saves):
// NORM: RMSNorm1p of x with weight aux[0..K] first: x * rsqrt(mean(x^2) + eps) * (1 + aux) (the
//    block's input norm: the product runs on x * (1 + aux), each row group sums x^2 on the way,
//    and the row's sum is scaled by rsqrt(mean + eps) after the reduction); with ssq_parts > 0
//    (prenormed) x is already times (1 + aux) and its sum of squares is in parts (a residual
//    projection's norm out, linear.wgsl): the product runs on x as it is and each row group sums
//    the parts instead;
// GLU: SwiGLU on the way out, over a concatenated [gate; up] weight: the dispatch's rows are the
//    n gate rows, then the n up rows; an invocation owns 4 gate rows and the same 4 up rows, and
//    the storing invocation writes y[o] = silu(gate[o]) * up[o] (n outputs, half as many per
//    workgroup).
override NORM: bool = false;
override GLU: bool = false;

const WG: u32 = 64u;
const TM: u32 = 8u;

// Parameters, bindings 0-3 and the weight decoder: linear.wgsl (t is bound to x when unused).
@group(0) @binding(4) var<storage, read> aux: array<vec4<f32>>; // NORM, out_norm: a norm weight (x when unused)
@group(0) @binding(5) var<storage, read> out_a: array<f32>;      // shrink out: A (x when unused)

var<workgroup> red: array<f32, 512>; // [rows of the workgroup][LANES] = TM * WG floats
var<workgroup> ssq: array<f32, 64>;  // NORM: [row group][LANES] partial sums of x^2 (or of a prenormed x's parts)
var<workgroup> tsum: array<vec4<f32>, 64>; // staged t (stage_t; at most 4 * TSUM_VECS columns)
var<workgroup> outs: array<f32, 64>; // shrink out: the workgroup's outputs as stored (times 1 + aux with out_norm)
var<workgroup> outs_sq: array<f32, 64>; // norm out: the squares of the workgroup's outputs

const TSUM_VECS: u32 = 64u;
const_assert TSUM_VECS == WG; // stage_t: an invocation per staged column

// Whether lora_row reads t from tsum (staged by stage_t in the prologue; the reduction's barrier,
// or the subgroup kernels' own, comes before lora_row reads it): a split shrink
// (linear.wgsl) summed from its parts, or t's row times its scale table where t fits in tsum.
// Staging multiplies the table in once per workgroup; lora_row would load a factor beside every
// t value of every output row (a stacked set's expand read 3 values per rank column, not 2).
fn t_staged() -> bool {
    return p.lora_parts > 0u || (p.lora_sc != NO_TABLE && p.lora_t_stride <= 4u * TSUM_VECS);
}

// Invocations stage t's columns 4 at a time (the parts start 16-byte aligned, each rank rounded
// up to 4 floats), times the scale table's factors when there is one. A split shrink's parts are
// summed by the whole workgroup: WG / cols invocations per column each add every (WG / cols)-th
// part and leave the sum in tsum, then after a barrier the column's own invocation adds those
// (a down_proj of the 0.8B layout has hundreds of parts: summed by one invocation per column they
// were a chain of that many dependent loads in every workgroup). The callers' barrier orders tsum
// before lora_row reads it.
fn stage_t(li: u32) {
    let cols = max((p.lora_t_stride + 3u) / 4u, 1u);
    var v = vec4<f32>(0.0);
    if (p.lora_parts > 0u) {
        let at = p.lora_parts_at / 4u;
        let groups = WG / cols;
        let c = li % cols;
        for (var q = li / cols; q < p.lora_parts && li < groups * cols; q += groups) {
            v += x[at + q * cols + c];
        }
        tsum[li] = v;
        workgroupBarrier();
        if (li < cols) {
            v = tsum[li];
            for (var g = 1u; g < groups; g++) {
                v += tsum[li + g * cols];
            }
        }
    } else if (li < cols) {
        v = t[li];
    }
    if (li < cols) {
        if (p.lora_sc != NO_TABLE) {
            let s = p.lora_sc + 4u * li;
            v *= vec4<f32>(t_elem(s), t_elem(s + 1u), t_elem(s + 2u), t_elem(s + 3u));
        }
        tsum[li] = v;
    }
}

// The t values lora_row reads: the staged ones, or t's buffer.
fn t_vec(i: u32) -> vec4<f32> {
    if (t_staged()) {
        return tsum[i];
    }
    return t[i];
}

fn t_one(e: u32) -> f32 {
    if (t_staged()) {
        return tsum[e >> 2u][e & 3u];
    }
    return t_elem(e);
}

// s * t . B[row] for row `row` of the dispatch (added by the invocation that stores the
// output), with the rank, t columns, B rows and scale of the segment the row falls in (the
// segments: linear.wgsl), and the scale table's factors where staging has not multiplied them in.
fn lora_row(row: u32) -> f32 {
    let g = p.lora_row0 + row;
    let j = min(u32(g >= p.seg_end.x) + u32(g >= p.seg_end.y) + u32(g >= p.seg_end.z), 3u);
    let start = seg_start(j);
    let rank = p.seg_rank[j];
    let b0 = p.seg_b[j] + (g - start) * rank;
    let t0 = p.seg_t[j];
    let table = p.lora_sc != NO_TABLE && !t_staged();
    let s0 = select(0u, p.lora_sc + p.seg_t[j], table);
    var acc = 0.0;
    if (((rank | b0 | t0 | s0) & 3u) == 0u) {
        // B row, t columns and factors 16-byte aligned (rank a multiple of 4): one vec4 load of
        // each per 4 rank columns.
        let b4 = b0 >> 2u;
        let t4 = t0 >> 2u;
        let s4 = s0 >> 2u;
        for (var c = 0u; c < rank / 4u; c++) {
            var tv = t_vec(t4 + c);
            if (table) {
                tv *= t[s4 + c];
            }
            acc += dot(lora_b[b4 + c], tv);
        }
    } else {
        for (var c = 0u; c < rank; c++) {
            var tv = t_one(t0 + c);
            if (table) {
                tv *= t_elem(s0 + c);
            }
            acc = fma(b_elem(b0 + c), tv, acc);
        }
    }
    return acc * p.seg_scale[j];
}

// The factor of the expand given the norm's scale: with NORM, split-shrink parts are of the
// input times (1 + aux) before the scale (a residual projection's shrink out), so the expand
// takes the scale the row's reduction found; a t from its buffer is of the normed input already.
fn expand_scale(norm_scale: f32) -> f32 {
    return select(1.0, norm_scale, NORM && p.lora_parts > 0u);
}

struct Slot {
    row0: u32, // first output row of the workgroup
    group: u32, // row group of this invocation
    lane: u32, // position along K within the row group
    stride: u32, // invocations along K in the row group: LANES (matvec_subgroup.wgsl without
                 // SPLIT: fewer when the subgroup is narrower than LANES)
}

// Output rows per invocation: TM, or 4 (gate, up) pairs with GLU.
fn outputs() -> u32 {
    return select(TM, TM / 2u, GLU);
}

fn slot(wg: vec3<u32>, nwg: vec3<u32>, li: u32) -> Slot {
    return Slot((wg.y * nwg.x + wg.x) * outputs() * (WG / LANES), li / LANES, li % LANES, LANES);
}

// The weight row (of the binding) of row slot i (0-7) of an invocation whose first output is
// `first`: rows past the end clamped to the last; with GLU slots 4-7 are the up rows of slots 0-3.
fn wrow(first: u32, i: u32) -> u32 {
    if (GLU) {
        let o = min(first + (i & 3u), p.n - 1u);
        return p.w_row0 + select(o, p.n + o, i >= 4u);
    }
    return p.w_row0 + min(first + i, p.n - 1u);
}

// Whether x is the norm's input already times (1 + aux), with its sum of squares in parts.
fn prenormed() -> bool {
    return NORM && p.ssq_parts > 0u;
}

// Whether the row group sums x^2 as it reads x (NORM, not prenormed).
fn sums_x2() -> bool {
    return NORM && p.ssq_parts == 0u;
}

// A prenormed x's sum of squares, lane `lane`'s share of it: parts lane, lane + stride, ...
fn ssq_share(lane: u32, stride: u32) -> f32 {
    var sq = 0.0;
    for (var q = lane; q < p.ssq_parts; q += stride) {
        sq += x_elem(p.ssq_parts_at + q);
    }
    return sq;
}

// x[e] times the norm weight for NORM, before the norm scale (element e of the row, flat
// element xe).
fn x_at(xe: u32, e: u32) -> f32 {
    let v = x_elem(xe);
    if (sums_x2()) {
        return v * (1.0 + aux[e >> 2u][e & 3u]);
    }
    return v;
}

// The x vec4 at vec4 index q of the row (element 4 q), likewise.
fn x_vec(x4: u32, q: u32) -> vec4<f32> {
    let v = x[x4 + q];
    if (sums_x2()) {
        return v * (1.0 + aux[q]);
    }
    return v;
}


// What an invocation hands to the reduction: its 8 rows' partial sums (rows 0-3, 4-7) and, for
// NORM, its partial sum of x^2.
struct Partials {
    lo: vec4<f32>,
    hi: vec4<f32>,
    ssq: f32,
}

// Partial sums of this invocation's 8 rows over its share of K. The 8 rows are written out (no
// loop over a private array), so every accumulator stays in a register on every compiler.
fn base_partials(s: Slot) -> Partials {
    var lo = vec4<f32>(0.0);
    var hi = vec4<f32>(0.0);
    var sq = 0.0;
    if (prenormed()) {
        sq = ssq_share(s.lane, s.stride);
    }
    let first = s.row0 + s.group * outputs();
    if (W_DTYPE == 3u && (p.x_offset & 3u) == 0u) {
        return affine_partials(s);
    }
    if (W_DTYPE != 3u && (p.k % 8u) == 0u && (p.x_offset & 3u) == 0u) {
        // 16-byte aligned rows of 8-weight groups (two vec4 per group for f32).
        let groups = p.k / 8u;
        let row_vecs = select(groups, 2u * groups, W_DTYPE == 0u);
        let r0 = wrow(first, 0u) * row_vecs;
        let r1 = wrow(first, 1u) * row_vecs;
        let r2 = wrow(first, 2u) * row_vecs;
        let r3 = wrow(first, 3u) * row_vecs;
        let r4 = wrow(first, 4u) * row_vecs;
        let r5 = wrow(first, 5u) * row_vecs;
        let r6 = wrow(first, 6u) * row_vecs;
        let r7 = wrow(first, 7u) * row_vecs;
        let x4 = p.x_offset >> 2u;
        for (var j = s.lane; j < groups; j += s.stride) {
            if (sums_x2()) {
                let ra = x[x4 + 2u * j];
                let rb = x[x4 + 2u * j + 1u];
                sq += dot(ra, ra) + dot(rb, rb);
            }
            let xa = x_vec(x4, 2u * j);
            let xb = x_vec(x4, 2u * j + 1u);
            var xe = xa;
            var xo = xb;
            if (W_DTYPE != 0u) {
                xe = vec4<f32>(xa.x, xa.z, xb.x, xb.z);
                xo = vec4<f32>(xa.y, xa.w, xb.y, xb.w);
            }
            lo += vec4<f32>(dot8(r0, j, xe, xo), dot8(r1, j, xe, xo), dot8(r2, j, xe, xo), dot8(r3, j, xe, xo));
            hi += vec4<f32>(dot8(r4, j, xe, xo), dot8(r5, j, xe, xo), dot8(r6, j, xe, xo), dot8(r7, j, xe, xo));
        }
        return Partials(lo, hi, sq);
    }
    for (var e = s.lane; e < p.k; e += s.stride) {
        if (sums_x2()) {
            let r = x_elem(p.x_offset + e);
            sq = fma(r, r, sq);
        }
        let xv = x_at(p.x_offset + e, e);
        let k = p.k;
        lo = fma(vec4<f32>(weight_at(wrow(first, 0u) * k + e), weight_at(wrow(first, 1u) * k + e),
            weight_at(wrow(first, 2u) * k + e), weight_at(wrow(first, 3u) * k + e)), vec4<f32>(xv), lo);
        hi = fma(vec4<f32>(weight_at(wrow(first, 4u) * k + e), weight_at(wrow(first, 5u) * k + e),
            weight_at(wrow(first, 6u) * k + e), weight_at(wrow(first, 7u) * k + e)), vec4<f32>(xv), hi);
    }
    return Partials(lo, hi, sq);
}

// Codes read in place: each field of a code word masked, not shifted down, so the code at position
// i of the word comes out as q * 2^(Q_BITS * i) (at most 4 or 8 significant bits: exact in f32);
// elements 0-3 and 4-7 of a 4-bit word (x, y), or 0-3 of an 8-bit word (x; y unused). A dot with
// x values scaled by 2^(-Q_BITS * i) (field_scale) gives q . x with every product exactly as
// codes() would give it, for one AND, one conversion and one FMA per weight instead of a shift
// more (MLX's qdot does the same): bit-identical while |x| >= 2^-98, where the scaled x stays
// normal (below, the product is under 2^-94 and flushing it to zero is within any tolerance).
fn code_fields(word: u32) -> array<vec4<f32>, 2> {
    let v = vec4<u32>(word);
    if (Q_BITS == 8u) {
        return array<vec4<f32>, 2>(vec4<f32>(v & vec4<u32>(0xffu, 0xff00u, 0xff0000u, 0xff000000u)), vec4<f32>(0.0));
    }
    return array<vec4<f32>, 2>(
        vec4<f32>(v & vec4<u32>(0xfu, 0xf0u, 0xf00u, 0xf000u)),
        vec4<f32>(v & vec4<u32>(0xf0000u, 0xf00000u, 0xf000000u, 0xf0000000u)),
    );
}

// The factors of x vec4 i of a block that cancel code_fields' positions: the word's positions
// (i % 2) * 4 .. + 3 for 4-bit codes, 0-3 for 8-bit (powers of two: the scaling is exact).
fn field_scale(i: u32) -> vec4<f32> {
    if (Q_BITS == 8u) {
        return vec4<f32>(1.0, 0x1p-8, 0x1p-16, 0x1p-24);
    }
    if ((i & 1u) == 0u) {
        return vec4<f32>(1.0, 0x1p-4, 0x1p-8, 0x1p-12);
    }
    return vec4<f32>(0x1p-16, 0x1p-20, 0x1p-24, 0x1p-28);
}

// Block j of affine weight row `row` (one vec4<u32>: 32 4-bit or 16 8-bit codes, all in one
// group) times the x block xb (8 or 4 vec4, each times its field_scale) whose plain sum is xs:
// scale * (q . x) + bias * sum(x).
fn affine_dot(row: u32, j: u32, xb: array<vec4<f32>, 8>, xs: f32) -> f32 {
    let v = w[row * (p.k * Q_BITS / 128u) + j];
    let g = scale_bias(w_word(p.q_sb + (row * p.k + j * (128u / Q_BITS)) / Q_GROUP));
    var d = 0.0;
    if (Q_BITS == 4u) {
        for (var i = 0u; i < 4u; i++) {
            let c = code_fields(v[i]);
            d += dot(c[0], xb[2u * i]) + dot(c[1], xb[2u * i + 1u]);
        }
    } else {
        for (var i = 0u; i < 4u; i++) {
            d += dot(code_fields(v[i])[0], xb[i]);
        }
    }
    return fma(g.x, d, g.y * xs);
}

// Partial sums of this invocation's 8 rows over its blocks for affine weights (x 16-byte
// aligned): the LANES invocations of a row group stride along K by blocks of one vec4<u32> per
// row (16 bytes: 32 or 16 weights), the x block in registers for the 8 rows (scaled once for
// code_fields), one scale and bias word per row and block.
fn affine_partials(s: Slot) -> Partials {
    var lo = vec4<f32>(0.0);
    var hi = vec4<f32>(0.0);
    var sq = 0.0;
    if (prenormed()) {
        sq = ssq_share(s.lane, s.stride);
    }
    let first = s.row0 + s.group * outputs();
    let nx = 32u / Q_BITS; // x vec4 per block: 8 or 4
    let blocks = p.k / (4u * nx);
    let r0 = wrow(first, 0u);
    let r1 = wrow(first, 1u);
    let r2 = wrow(first, 2u);
    let r3 = wrow(first, 3u);
    let r4 = wrow(first, 4u);
    let r5 = wrow(first, 5u);
    let r6 = wrow(first, 6u);
    let r7 = wrow(first, 7u);
    let x4 = p.x_offset >> 2u;
    for (var j = s.lane; j < blocks; j += s.stride) {
        var xb: array<vec4<f32>, 8>;
        var xs = 0.0;
        for (var i = 0u; i < nx; i++) {
            let q = j * nx + i;
            if (sums_x2()) {
                let r = x[x4 + q];
                sq += dot(r, r);
            }
            let xv = x_vec(x4, q);
            xs += dot(xv, vec4<f32>(1.0));
            xb[i] = xv * field_scale(i);
        }
        lo += vec4<f32>(affine_dot(r0, j, xb, xs), affine_dot(r1, j, xb, xs), affine_dot(r2, j, xb, xs), affine_dot(r3, j, xb, xs));
        hi += vec4<f32>(affine_dot(r4, j, xb, xs), affine_dot(r5, j, xb, xs), affine_dot(r6, j, xb, xs), affine_dot(r7, j, xb, xs));
    }
    return Partials(lo, hi, sq);
}

// The LANES partials of row slot `at` (of the workgroup) summed.
fn lane_sum(at: u32) -> f32 {
    var sum = 0.0;
    for (var l = 0u; l < LANES; l++) {
        sum += red[at * LANES + l];
    }
    return sum;
}

// A stored row's sums (x; with GLU the gate row in x, the up row in y), scaled by the norm for
// NORM, and that scale (1 without NORM).
struct Reduced {
    v: vec2<f32>,
    scale: f32,
}

// One barrier, then the invocation li < outputs (of an output inside the chunk) sums its row's
// LANES partials; the entry point adds the LoRA expand and stores.
fn reduce(s: Slot, part: Partials, li: u32) -> Reduced {
    let at = s.group * TM * LANES + s.lane;
    red[at] = part.lo.x;
    red[at + LANES] = part.lo.y;
    red[at + 2u * LANES] = part.lo.z;
    red[at + 3u * LANES] = part.lo.w;
    red[at + 4u * LANES] = part.hi.x;
    red[at + 5u * LANES] = part.hi.y;
    red[at + 6u * LANES] = part.hi.z;
    red[at + 7u * LANES] = part.hi.w;
    if (NORM) {
        ssq[s.group * LANES + s.lane] = part.ssq;
    }
    workgroupBarrier();
    var sum = vec2<f32>(0.0);
    var scale = 1.0;
    if (stores(s, li)) {
        let g = li / outputs();
        let q = li % outputs();
        sum.x = lane_sum(g * TM + q);
        if (GLU) {
            sum.y = lane_sum(g * TM + TM / 2u + q);
        }
        if (NORM) {
            var total = 0.0;
            for (var l = 0u; l < LANES; l++) {
                total += ssq[g * LANES + l];
            }
            scale = inverseSqrt(total / f32(p.k) + p.eps);
            sum *= scale;
        }
    }
    return Reduced(sum, scale);
}

// Whether invocation li stores an output (output li of the workgroup, inside the chunk).
fn stores(s: Slot, li: u32) -> bool {
    return li < outputs() * (WG / LANES) && s.row0 + li < p.n;
}

// Store output li of the workgroup (and keep it in outs for a shrink out, times 1 + the norm
// weight with out_norm; with a norm out also store it times 1 + the norm weight and keep its
// square in outs_sq).
fn store(s: Slot, li: u32, v: vec2<f32>) {
    let idx = p.y_offset + s.row0 + li;
    var h = v.x;
    if (GLU) {
        h = silu(v.x) * v.y;
    } else if (ACCUMULATE) {
        h += y[idx];
    }
    y[idx] = h;
    // The output through the next norm's weight (a norm out, or a shrink out with out_norm).
    let e = s.row0 + li;
    var hw = h;
    if (p.xw_at > 0u || p.out_norm != 0u) {
        hw = h * (1.0 + aux[e >> 2u][e & 3u]);
    }
    if (p.xw_at > 0u) {
        y[p.xw_at + e] = hw;
        outs_sq[li] = h * h;
    }
    if (p.out_rank > 0u) {
        outs[li] = select(h, hw, p.out_norm != 0u);
    }
}

// Whether the workgroup writes more than its outputs (a shrink out or a norm out): the callers'
// condition for write_out (uniform).
fn writes_out() -> bool {
    return p.out_rank > 0u || p.xw_at > 0u;
}

// Shrink out and norm out (linear.wgsl): after one barrier, invocation r sums the workgroup's
// outputs as kept by store times row r of A over their columns and stores the workgroup's part
// (the rank's padding as zeros); invocation 0 stores the sum of the outputs' squares.
fn write_out(row0: u32, part: u32, li: u32) {
    if (row0 >= p.n) {
        return; // a workgroup past the rows (a two-dimensional grid's last row)
    }
    workgroupBarrier();
    let n = min(outputs() * (WG / LANES), p.n - row0);
    if (p.xw_at > 0u && li == 0u) {
        var sq = 0.0;
        for (var o = 0u; o < n; o++) {
            sq += outs_sq[o];
        }
        y[p.ssq_at + part] = sq;
    }
    let pad = (p.out_rank + 3u) & ~3u;
    for (var r = li; r < pad; r += WG) {
        var sum = 0.0;
        if (r < p.out_rank) {
            let a0 = r * p.n + row0;
            for (var o = 0u; o < n; o++) {
                sum = fma(outs[o], out_a[a0 + o], sum);
            }
        }
        y[p.out_at + part * pad + r] = sum;
    }
}

@compute @workgroup_size(64)
fn matvec(
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let s = slot(wg, nwg, li);
    let r = reduce(s, base_partials(s), li);
    if (stores(s, li)) {
        store(s, li, r.v);
    }
    if (writes_out()) {
        write_out(s.row0, wg.y * nwg.x + wg.x, li);
    }
}

@compute @workgroup_size(64)
fn matvec_lora(
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let s = slot(wg, nwg, li);
    if (t_staged()) {
        stage_t(li);
    }
    let r = reduce(s, base_partials(s), li);
    if (stores(s, li)) {
        let o = s.row0 + li;
        let f = expand_scale(r.scale);
        var v = r.v;
        v.x += f * lora_row(o);
        if (GLU) {
            v.y += f * lora_row(p.n + o);
        }
        store(s, li, v);
    }
    if (writes_out()) {
        write_out(s.row0, wg.y * nwg.x + wg.x, li);
    }
}
