// The weight decoder of every kernel that reads checkpoint weights (prepended by the loader to
// matmul, matvec, matvec_batch, embed and matmul_dx): the dtype overrides, the group-1 weight
// binding and element access.
//
// W_DTYPE 0 = f32, 1 = bf16, 2 = f16 (two per u32, element 2i in the low half), 3 = affine
// (MLX's layout): a row of K weights is K * Q_BITS / 32 u32 words of Q_BITS-bit codes, packed low
// bits first along K; after the codes of all the chunk's rows, from u32 index `sb` (a multiple of
// 4, passed by each kernel), one u32 per (row, group of Q_GROUP weights) holds the group's scale
// (low 16 bits) and bias (high 16 bits) in bf16, or f16 with Q_F16: w = scale * q + bias. Rows of
// affine weights are 16-byte aligned (K is a multiple of the group, so of 32).

override W_DTYPE: u32 = 0u;
override Q_BITS: u32 = 4u;     // 4 or 8
override Q_GROUP: u32 = 64u;   // 32, 64 or 128
override Q_F16: bool = false;

@group(1) @binding(0) var<storage, read> w: array<vec4<u32>>;

fn w_word(i: u32) -> u32 {
    return w[i >> 2u][i & 3u];
}

// The (scale, bias) of a packed group word.
fn scale_bias(v: u32) -> vec2<f32> {
    if (Q_F16) {
        return unpack2x16float(v);
    }
    return vec2<f32>(bitcast<f32>(v << 16u), bitcast<f32>(v & 0xffff0000u));
}

// The u32 word of a chunk holding flat element e (row * K + column; its code for affine weights).
fn weight_word_index(e: u32) -> u32 {
    if (W_DTYPE == 3u) {
        return e / (32u / Q_BITS);
    }
    if (W_DTYPE == 0u) {
        return e;
    }
    return e >> 1u;
}

// Flat element e widened to f32 from its word and, for affine weights, its group's scale and
// bias word (unused otherwise): exact for the float dtypes, one f32 fma for affine codes.
fn weight_from_words(e: u32, word: u32, sb_word: u32) -> f32 {
    if (W_DTYPE == 3u) {
        let per = 32u / Q_BITS;
        let q = (word >> ((e % per) * Q_BITS)) & ((1u << Q_BITS) - 1u);
        let g = scale_bias(sb_word);
        return fma(g.x, f32(q), g.y);
    }
    if (W_DTYPE == 0u) {
        return bitcast<f32>(word);
    }
    if (W_DTYPE == 1u) {
        return bitcast<f32>(select(word << 16u, word & 0xffff0000u, (e & 1u) == 1u));
    }
    return unpack2x16float(word)[e & 1u];
}

// Flat element e of the chunk bound at group 1 widened to f32 (sb: where the chunk's scales
// start; unused for the float dtypes).
fn weight_elem(e: u32, sb: u32) -> f32 {
    var sb_word = 0u;
    if (W_DTYPE == 3u) {
        sb_word = w_word(sb + e / Q_GROUP);
    }
    return weight_from_words(e, w_word(weight_word_index(e)), sb_word);
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

// The codes of one u32 word as f32: elements 0-3 and 4-7 of a 4-bit word (x, y), or 0-3 of an
// 8-bit word (x; y unused).
fn codes(word: u32) -> array<vec4<f32>, 2> {
    let v = vec4<u32>(word);
    if (Q_BITS == 8u) {
        return array<vec4<f32>, 2>(vec4<f32>((v >> vec4<u32>(0u, 8u, 16u, 24u)) & vec4<u32>(255u)), vec4<f32>(0.0));
    }
    return array<vec4<f32>, 2>(
        vec4<f32>((v >> vec4<u32>(0u, 4u, 8u, 12u)) & vec4<u32>(15u)),
        vec4<f32>((v >> vec4<u32>(16u, 20u, 24u, 28u)) & vec4<u32>(15u)),
    );
}
