// y[m, n] (+)= sum_k w[n, k] * x[m, k]  [+ s * sum_j t[m, j] * B[n, j]]   (2 to 8 tokens)
//
// nn.Linear for a few rows of x (a short prompt, or one token of each of a batch's sessions): the
// matvec layout with every weight read once for all the tokens. A workgroup of 64 invocations is
// 64 / LANES row groups of LANES invocations; each invocation owns TR = 8 consecutive rows, loads
// one vec4<u32> of weights per row and step (8 bf16/f16 weights, two vec4 for f32), widens them
// once and multiplies them with the same 8 elements of each of the TOK token rows of x: every x
// value loaded serves 8 rows (TOK * 8 loads of x per 64 weights). Registers: 2 * TOK vec4
// accumulators and the 8 rows' words. Partial sums are reduced through workgroup memory in two
// halves of 4 rows (8 KB at TOK 8, as for 4 rows per invocation; a barrier after each half is
// staged and after it is summed). The LoRA expand goes into the partials before the reduction:
// each lane takes every LANES-th rank column, one B element per row and one t value per token.
// Every accumulator index is a constant (the tokens are spelled out, not looped over): a
// dynamically indexed private array would leave registers for memory or select ladders on
// compilers that do not unroll the loop (Mesa's NIR among them).
//
// GLU: SwiGLU on the way out over a concatenated [gate; up] weight (the dispatch's n outputs are
// the gate rows; up row o is row n + o): an invocation owns 4 gate rows and their 4 up rows, and
// stores silu(gate) * up. Its half 0 (the gate sums) goes to y, and its half 1 reads them back
// from there (the same invocation stores and reads each output: no barrier needed for that).
//
// NORM: the block's RMSNorm1p of x with weight aux first, x * rsqrt(mean(x^2) + eps) * (1 + aux)
// (a batched step's block input, read only by its projections and their shrink): the product
// runs on x * (1 + aux), row group 0's lanes sum x^2 of every token on the way (every row group
// reads all of x) and hand their sums over workgroup memory, and each token's scale multiplies
// its partials before the expand is added (t is the shrink of the normed rows). Two barriers.
//
// Split shrink: with lora_parts > 0, t is summed from parts in x (a batched step's token mixers
// write each row's o_proj / out_proj shrink split by head after all the rows' outputs): token tk's
// part q, column c at x element lora_parts_at + (tk * lora_parts + q) * (lora_t_stride rounded up
// to 4) + c. The workgroup sums them for every token, times the scale table, into workgroup
// memory before anything else (one barrier), and the expand reads t from there. Host contract:
// m * lora_t_stride <= TSUM, no NORM, no GLU.
//
// Host contract: K a multiple of 8, x rows 16-byte aligned (x_offset and x_stride multiples of 4),
// m <= TOK (token rows past m are skipped: not loaded, computed or stored), aux bound (x when
// unused), up to 4 LoRA segments (the projections of a concatenated weight, as the single-token
// matvec takes them; with GLU two: gate and up, n rows each, lora_row0 0). Parameters, bindings
// and the helpers: linear.wgsl.

override LANES: u32 = 16u;       // invocations along K per row group: 8, 16, 32 or 64
override TOK: u32 = 4u;          // token rows per dispatch: 2, 4 or 8
override GLU: bool = false;
override NORM: bool = false;

const WG: u32 = 64u;
const TR: u32 = 8u;
const MAX_TOK: u32 = 8u;
const ACC: u32 = 16u; // vec4 accumulators: two per token
const_assert ACC == 2u * MAX_TOK && TR == 8u;

@group(0) @binding(4) var<storage, read> aux: array<vec4<f32>>; // NORM: the norm weight [K]

// One half of the partials: [4 rows of each row group][TOK][LANES] = 4 * WG * TOK floats.
var<workgroup> red: array<f32, 2048>;
// NORM: row group 0's partial sums of x^2, [TOK][LANES], then each token's norm scale.
var<workgroup> sq_red: array<f32, 512>;
var<workgroup> norm_scale: array<f32, MAX_TOK>;
// Split shrink: every token's t, [m][lora_t_stride], summed from its parts (stage_t).
const TSUM: u32 = 1024u;
var<workgroup> tsum: array<f32, TSUM>;

struct Slot {
    row0: u32,  // first row of the workgroup
    group: u32, // row group of this invocation
    lane: u32,  // position along K within the row group
}

// Output rows per invocation: TR, or 4 (gate, up) pairs with GLU.
fn per_invocation() -> u32 {
    return select(TR, TR / 2u, GLU);
}

fn slot(wg: vec3<u32>, nwg: vec3<u32>, li: u32) -> Slot {
    return Slot((wg.y * nwg.x + wg.x) * per_invocation() * (WG / LANES), li / LANES, li % LANES);
}

// Row i (0 to 7) of the invocation whose first output row is `first`, rows past the outputs
// clamped to the last (computed, never stored); with GLU rows 4-7 are the up rows of rows 0-3.
fn slot_row(first: u32, i: u32) -> u32 {
    if (GLU) {
        return min(first + i % 4u, p.n - 1u) + select(0u, p.n, i >= 4u);
    }
    return min(first + i, p.n - 1u);
}

// The 8 weights of row vector `rv`, step j, as (even, odd) elements for 16-bit weights or the two
// halves for f32, matching how x is split below.
fn weights8(rv: u32, j: u32) -> array<vec4<f32>, 2> {
    if (W_DTYPE == 0u) {
        return array<vec4<f32>, 2>(bitcast<vec4<f32>>(w[rv + 2u * j]), bitcast<vec4<f32>>(w[rv + 2u * j + 1u]));
    }
    return even_odd(w[rv + j]);
}

// The dot products of the 8 rows' weights at step j (`wv`, as weights8 gives them) with token
// row tk's 8 x values (times `nw`, 1 + the norm weight's 8 values, with NORM): rows 0-3, rows 4-7,
// and when `sums` the sum of the 8 x values' squares (0 otherwise).
struct Dots {
    lo: vec4<f32>,
    hi: vec4<f32>,
    sq: f32,
}

fn token_dots(tk: u32, j: u32, wv: array<array<vec4<f32>, 2>, TR>, nw: array<vec4<f32>, 2>, sums: bool) -> Dots {
    let x4 = (p.x_offset + tk * p.x_stride) >> 2u;
    var xa = x[x4 + 2u * j];
    var xb = x[x4 + 2u * j + 1u];
    var sq = 0.0;
    if (sums) {
        sq = dot(xa, xa) + dot(xb, xb);
    }
    if (NORM) {
        xa *= nw[0];
        xb *= nw[1];
    }
    var xe = xa;
    var xo = xb;
    if (W_DTYPE != 0u) {
        xe = vec4<f32>(xa.x, xa.z, xb.x, xb.z);
        xo = vec4<f32>(xa.y, xa.w, xb.y, xb.w);
    }
    return Dots(
        vec4<f32>(dot(wv[0][0], xe) + dot(wv[0][1], xo), dot(wv[1][0], xe) + dot(wv[1][1], xo),
            dot(wv[2][0], xe) + dot(wv[2][1], xo), dot(wv[3][0], xe) + dot(wv[3][1], xo)),
        vec4<f32>(dot(wv[4][0], xe) + dot(wv[4][1], xo), dot(wv[5][0], xe) + dot(wv[5][1], xo),
            dot(wv[6][0], xe) + dot(wv[6][1], xo), dot(wv[7][0], xe) + dot(wv[7][1], xo)),
        sq);
}

// Partial sums of an invocation's 8 rows for each token: acc[2 * token] = rows 0-3,
// acc[2 * token + 1] = rows 4-7; with NORM, in row group 0, its share of each token's sum of x^2
// (tokens 0-3 in sq_lo, 4-7 in sq_hi; every row group reads all of x, one of them sums it).
struct Partials {
    acc: array<vec4<f32>, ACC>,
    sq_lo: vec4<f32>,
    sq_hi: vec4<f32>,
}

// This invocation's partials (token rows past m and TOK skipped).
fn partials(s: Slot) -> Partials {
    var acc: array<vec4<f32>, ACC>;
    var sq_lo = vec4<f32>(0.0);
    var sq_hi = vec4<f32>(0.0);
    let first = s.row0 + s.group * per_invocation();
    let groups = p.k / 8u;
    let row_vecs = select(groups, 2u * groups, W_DTYPE == 0u);
    let sums = NORM && s.group == 0u;
    var r: array<u32, TR>;
    for (var i = 0u; i < TR; i++) {
        r[i] = (p.w_row0 + slot_row(first, i)) * row_vecs;
    }
    for (var j = s.lane; j < groups; j += LANES) {
        let wv = array<array<vec4<f32>, 2>, TR>(weights8(r[0], j), weights8(r[1], j), weights8(r[2], j),
            weights8(r[3], j), weights8(r[4], j), weights8(r[5], j), weights8(r[6], j), weights8(r[7], j));
        var nw = array<vec4<f32>, 2>(vec4<f32>(1.0), vec4<f32>(1.0));
        if (NORM) {
            nw = array<vec4<f32>, 2>(1.0 + aux[2u * j], 1.0 + aux[2u * j + 1u]);
        }
        var d = token_dots(0u, j, wv, nw, sums);
        acc[0] += d.lo;
        acc[1] += d.hi;
        sq_lo.x += d.sq;
        if (p.m > 1u) {
            d = token_dots(1u, j, wv, nw, sums);
            acc[2] += d.lo;
            acc[3] += d.hi;
            sq_lo.y += d.sq;
        }
        if (TOK > 2u && p.m > 2u) {
            d = token_dots(2u, j, wv, nw, sums);
            acc[4] += d.lo;
            acc[5] += d.hi;
            sq_lo.z += d.sq;
        }
        if (TOK > 2u && p.m > 3u) {
            d = token_dots(3u, j, wv, nw, sums);
            acc[6] += d.lo;
            acc[7] += d.hi;
            sq_lo.w += d.sq;
        }
        if (TOK > 4u && p.m > 4u) {
            d = token_dots(4u, j, wv, nw, sums);
            acc[8] += d.lo;
            acc[9] += d.hi;
            sq_hi.x += d.sq;
        }
        if (TOK > 4u && p.m > 5u) {
            d = token_dots(5u, j, wv, nw, sums);
            acc[10] += d.lo;
            acc[11] += d.hi;
            sq_hi.y += d.sq;
        }
        if (TOK > 4u && p.m > 6u) {
            d = token_dots(6u, j, wv, nw, sums);
            acc[12] += d.lo;
            acc[13] += d.hi;
            sq_hi.z += d.sq;
        }
        if (TOK > 4u && p.m > 7u) {
            d = token_dots(7u, j, wv, nw, sums);
            acc[14] += d.lo;
            acc[15] += d.hi;
            sq_hi.w += d.sq;
        }
    }
    return Partials(acc, sq_lo, sq_hi);
}

// NORM: each token's scale rsqrt(mean(x^2) + eps) from row group 0's lanes' sums (staged, one
// barrier, invocation tk < TOK sums token tk's, one barrier), multiplied into the partials.
fn apply_norm(s: Slot, part: ptr<function, Partials>, li: u32) {
    if (s.group == 0u) {
        for (var tk = 0u; tk < TOK; tk++) {
            sq_red[tk * LANES + s.lane] = select((*part).sq_lo, (*part).sq_hi, tk >= 4u)[tk % 4u];
        }
    }
    workgroupBarrier();
    if (li < TOK) {
        var sum = 0.0;
        for (var l = 0u; l < LANES; l++) {
            sum += sq_red[li * LANES + l];
        }
        norm_scale[li] = inverseSqrt(sum / f32(p.k) + p.eps);
    }
    workgroupBarrier();
    let lo = vec4<f32>(norm_scale[0], norm_scale[1], norm_scale[2], norm_scale[3]);
    let hi = vec4<f32>(norm_scale[4], norm_scale[5], norm_scale[6], norm_scale[7]);
    (*part).acc[0] *= lo.x;
    (*part).acc[1] *= lo.x;
    (*part).acc[2] *= lo.y;
    (*part).acc[3] *= lo.y;
    (*part).acc[4] *= lo.z;
    (*part).acc[5] *= lo.z;
    (*part).acc[6] *= lo.w;
    (*part).acc[7] *= lo.w;
    (*part).acc[8] *= hi.x;
    (*part).acc[9] *= hi.x;
    (*part).acc[10] *= hi.y;
    (*part).acc[11] *= hi.y;
    (*part).acc[12] *= hi.z;
    (*part).acc[13] *= hi.z;
    (*part).acc[14] *= hi.w;
    (*part).acc[15] *= hi.w;
}

// Split shrink: t of every token summed from its parts in x, times the scale table, into tsum.
// The parts start 16-byte aligned and each is the rank rounded up to 4 columns, so invocation li
// sums column quads li, li + WG, ... (token v / quads, columns 4 (v % quads) to + 3), one vec4
// load per part. Then one barrier.
fn stage_t(li: u32) {
    let stride = p.lora_t_stride;
    let quads = (stride + 3u) / 4u;
    for (var v = li; v < p.m * quads; v += WG) {
        let tk = v / quads;
        let q4 = v % quads;
        let first = p.lora_parts_at / 4u + tk * p.lora_parts * quads + q4;
        var sum = vec4<f32>(0.0);
        for (var q = 0u; q < p.lora_parts; q++) {
            sum += x[first + q * quads];
        }
        for (var i = 0u; i < 4u; i++) {
            let c = 4u * q4 + i;
            if (c < stride) {
                var tv = sum[i];
                if (p.lora_sc != NO_TABLE) {
                    tv *= t_elem(p.lora_sc + tk * p.lora_sc_stride + c);
                }
                tsum[tk * stride + c] = tv;
            }
        }
    }
    workgroupBarrier();
}

// Token row tk's t value of rank column c of segment seg, times its scale-table factor.
fn t_at(tk: u32, seg: u32, c: u32) -> f32 {
    let col = p.seg_t[seg] + c;
    if (p.lora_parts > 0u) {
        return tsum[tk * p.lora_t_stride + col];
    }
    var v = t_elem(tk * p.lora_t_stride + col);
    if (p.lora_sc != NO_TABLE) {
        v *= t_elem(p.lora_sc + tk * p.lora_sc_stride + col);
    }
    return v;
}

// The first B element of row slot i (slot_row) in segment seg: without GLU the row's number
// (from lora_row0) clamped into the segment, so a row outside it indexes a row of the segment's
// block (loaded and masked off); with GLU rows are numbered from lora_row0 within segment 0 and
// rows 4-7 are up rows, numbered from output n (segment 1's rows; segment 0 does not load them,
// but their index stays inside its block).
fn b_row(first: u32, i: u32, seg: u32) -> u32 {
    let rank = p.seg_rank[seg];
    if (GLU) {
        let up = select(0u, p.n, i >= 4u);
        return p.seg_b[seg] + (p.lora_row0 + slot_row(first, i) - up) * rank;
    }
    let start = seg_start(seg);
    let g = clamp(p.lora_row0 + slot_row(first, i), start, p.seg_end[seg] - 1u);
    return p.seg_b[seg] + (g - start) * rank;
}

// Whether row slots (0-3, 4-7) of the invocation whose first output row is `first` are rows of
// segment seg: with GLU the gate half is segment 0's and the up half segment 1's.
fn in_segment(first: u32, seg: u32) -> array<vec4<bool>, 2> {
    if (GLU) {
        return array<vec4<bool>, 2>(vec4<bool>(seg == 0u), vec4<bool>(seg == 1u));
    }
    let start = seg_start(seg);
    let end = p.seg_end[seg];
    let lo = p.lora_row0 + vec4<u32>(slot_row(first, 0u), slot_row(first, 1u), slot_row(first, 2u), slot_row(first, 3u));
    let hi = p.lora_row0 + vec4<u32>(slot_row(first, 4u), slot_row(first, 5u), slot_row(first, 6u), slot_row(first, 7u));
    return array<vec4<bool>, 2>((lo >= vec4<u32>(start)) & (lo < vec4<u32>(end)),
        (hi >= vec4<u32>(start)) & (hi < vec4<u32>(end)));
}

// Adds s * t . B[row] of this invocation's rows in segment seg for every token into its
// partials, before the reduction: lane l takes rank columns l, l + LANES, ..., loading per
// column one B element of each row and one t value of each token. Each half of the 8 rows (0-3,
// 4-7) whose rows all lie outside the segment loads nothing (with GLU: the gate half is segment
// 0's, the up half segment 1's); a half that straddles the segment's edge loads its outside rows
// from inside the segment's block and masks them off. Rows past n are clamped as their weights
// are (never stored).
fn add_expand(s: Slot, acc: ptr<function, array<vec4<f32>, ACC>>, seg: u32) {
    let rank = p.seg_rank[seg];
    let first = s.row0 + s.group * per_invocation();
    let member = in_segment(first, seg);
    let has_lo = any(member[0]);
    let has_hi = any(member[1]);
    if (rank == 0u || !(has_lo || has_hi)) {
        return;
    }
    let b0 = b_row(first, 0u, seg);
    let b1 = b_row(first, 1u, seg);
    let b2 = b_row(first, 2u, seg);
    let b3 = b_row(first, 3u, seg);
    let b4 = b_row(first, 4u, seg);
    let b5 = b_row(first, 5u, seg);
    let b6 = b_row(first, 6u, seg);
    let b7 = b_row(first, 7u, seg);
    for (var c = s.lane; c < rank; c += LANES) {
        let sc = p.seg_scale[seg];
        var lo = vec4<f32>(0.0);
        var hi = vec4<f32>(0.0);
        if (has_lo) {
            lo = select(lo, sc * vec4<f32>(b_elem(b0 + c), b_elem(b1 + c), b_elem(b2 + c), b_elem(b3 + c)), member[0]);
        }
        if (has_hi) {
            hi = select(hi, sc * vec4<f32>(b_elem(b4 + c), b_elem(b5 + c), b_elem(b6 + c), b_elem(b7 + c)), member[1]);
        }
        var v = t_at(0u, seg, c);
        (*acc)[0] += lo * v;
        (*acc)[1] += hi * v;
        if (p.m > 1u) {
            v = t_at(1u, seg, c);
            (*acc)[2] += lo * v;
            (*acc)[3] += hi * v;
        }
        if (TOK > 2u && p.m > 2u) {
            v = t_at(2u, seg, c);
            (*acc)[4] += lo * v;
            (*acc)[5] += hi * v;
        }
        if (TOK > 2u && p.m > 3u) {
            v = t_at(3u, seg, c);
            (*acc)[6] += lo * v;
            (*acc)[7] += hi * v;
        }
        if (TOK > 4u && p.m > 4u) {
            v = t_at(4u, seg, c);
            (*acc)[8] += lo * v;
            (*acc)[9] += hi * v;
        }
        if (TOK > 4u && p.m > 5u) {
            v = t_at(5u, seg, c);
            (*acc)[10] += lo * v;
            (*acc)[11] += hi * v;
        }
        if (TOK > 4u && p.m > 6u) {
            v = t_at(6u, seg, c);
            (*acc)[12] += lo * v;
            (*acc)[13] += hi * v;
        }
        if (TOK > 4u && p.m > 7u) {
            v = t_at(7u, seg, c);
            (*acc)[14] += lo * v;
            (*acc)[15] += hi * v;
        }
    }
}

// Half h of the partials (rows 4h to 4h + 3 of every token), picked with constant indices.
fn half(acc: array<vec4<f32>, ACC>, h: u32) -> array<vec4<f32>, MAX_TOK> {
    let hi = h == 1u;
    return array<vec4<f32>, MAX_TOK>(select(acc[0], acc[1], hi), select(acc[2], acc[3], hi),
        select(acc[4], acc[5], hi), select(acc[6], acc[7], hi), select(acc[8], acc[9], hi),
        select(acc[10], acc[11], hi), select(acc[12], acc[13], hi), select(acc[14], acc[15], hi));
}

// A half of the partials (`half`) into workgroup memory, then one barrier.
fn stage(s: Slot, part: array<vec4<f32>, MAX_TOK>) {
    for (var tk = 0u; tk < TOK; tk++) {
        let base = ((s.group * 4u) * TOK + tk) * LANES + s.lane;
        let a = part[tk];
        red[base] = a.x;
        red[base + TOK * LANES] = a.y;
        red[base + 2u * TOK * LANES] = a.z;
        red[base + 3u * TOK * LANES] = a.w;
    }
    workgroupBarrier();
}

// Outputs of a half: output o is (row group (o / TOK) / 4, its row 4h + (o / TOK) % 4, token
// o % TOK); invocation li sums o = li, li + 64, ...
fn outputs() -> u32 {
    return 4u * (WG / LANES) * TOK;
}

// The output row of half h's output o, within the workgroup (with GLU both halves' rows are
// the same output rows: gate, then up).
fn out_row(o: u32, h: u32) -> u32 {
    let r = o / TOK;
    if (GLU) {
        return r;
    }
    return (r / 4u) * TR + 4u * h + r % 4u;
}

fn inside(s: Slot, row: u32, o: u32) -> bool {
    return s.row0 + row < p.n && o % TOK < p.m;
}

fn lane_sum(o: u32) -> f32 {
    var sum = 0.0;
    for (var l = 0u; l < LANES; l++) {
        sum += red[o * LANES + l];
    }
    return sum;
}

// Half h's sum v of output o (row `row`): with GLU half 0 leaves the gate sum in y for half 1.
fn store(s: Slot, row: u32, o: u32, h: u32, v: f32) {
    let idx = p.y_offset + (o % TOK) * p.y_stride + s.row0 + row;
    if (GLU) {
        if (h == 0u) {
            y[idx] = v;
        } else {
            y[idx] = silu(y[idx]) * v;
        }
    } else if (ACCUMULATE) {
        y[idx] = y[idx] + v;
    } else {
        y[idx] = v;
    }
}

// The invocation's partials, through the norm with NORM (before any expand is added).
fn normed_partials(s: Slot, li: u32) -> array<vec4<f32>, ACC> {
    var part = partials(s);
    if (NORM) {
        apply_norm(s, &part, li);
    }
    return part.acc;
}

// Both halves of the partials reduced across the lanes and stored (a barrier after each).
fn reduce_and_store(s: Slot, acc: array<vec4<f32>, ACC>, li: u32) {
    for (var h = 0u; h < 2u; h++) {
        stage(s, half(acc, h));
        for (var o = li; o < outputs(); o += WG) {
            let row = out_row(o, h);
            if (inside(s, row, o)) {
                store(s, row, o, h, lane_sum(o));
            }
        }
        workgroupBarrier();
    }
}

@compute @workgroup_size(64)
fn matvec_batch(
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let s = slot(wg, nwg, li);
    reduce_and_store(s, normed_partials(s, li), li);
}

@compute @workgroup_size(64)
fn matvec_batch_lora(
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let s = slot(wg, nwg, li);
    if (p.lora_parts > 0u) {
        stage_t(li);
    }
    var acc = normed_partials(s, li);
    for (var seg = 0u; seg < select(4u, 2u, GLU); seg++) {
        add_expand(s, &acc, seg);
    }
    reduce_and_store(s, acc, li);
}
