//! Plain CPU implementations of every kernel (f32; `linear` sums in f64): the oracle of the
//! kernel tests, and readable documentation of what each shader computes. Layouts match the WGSL
//! files. The kernel tests' own code, not part of the engine's API: each function takes slices of
//! the lengths its shapes give and panics on others, as test code does.

/// `y[m, n] = Σ_k x[m, k] · w[n, k]` (nn.Linear), each sum in f64 and rounded once. A
/// sequential f32 sum over k = 1,024 terms with cancellation errs by ~1e-4 of its terms' size
/// (seen: an output of −0.226 from terms summing to 253 in magnitude, off by 2.4e-5), more than
/// the GPU's blocked sums: the oracle's own rounding must stay below the kernels'.
pub fn linear(x: &[f32], w: &[f32], m: usize, n: usize, k: usize) -> Vec<f32> {
    let mut y = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            y[i * n + j] = (0..k).map(|t| f64::from(x[i * k + t]) * f64::from(w[j * k + t])).sum::<f64>() as f32;
        }
    }
    y
}

/// RMSNorm1p over rows of length `n`: `x · rsqrt(mean(x²) + eps) · (1 + w)`.
pub fn rms_norm(x: &[f32], w: &[f32], n: usize, eps: f32) -> Vec<f32> {
    x.chunks(n)
        .flat_map(|row| {
            let s = 1.0 / (row.iter().map(|v| v * v).sum::<f32>() / n as f32 + eps).sqrt();
            row.iter().zip(w).map(move |(v, w)| v * s * (1.0 + w))
        })
        .collect()
}

/// Gated RMSNorm over rows of length `n`: `v · rsqrt(mean(v²) + eps) · w · silu(z)`.
pub fn rms_norm_gated(v: &[f32], z: &[f32], w: &[f32], n: usize, eps: f32) -> Vec<f32> {
    v.chunks(n)
        .zip(z.chunks(n))
        .flat_map(|(row, zr)| {
            let s = 1.0 / (row.iter().map(|v| v * v).sum::<f32>() / n as f32 + eps).sqrt();
            row.iter().zip(zr).zip(w).map(move |((v, z), w)| v * s * w * silu(*z))
        })
        .collect()
}

/// `x · sigmoid(x)`.
pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// `1 / (1 + e^-x)`.
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// Causal depthwise conv + SiLU over `[T, C]` with history `[C, K-1]` (updated in place).
pub fn conv_silu(mixed: &[f32], state: &mut [f32], w: &[f32], t: usize, c: usize, k: usize) -> Vec<f32> {
    let mut y = vec![0.0; t * c];
    for ch in 0..c {
        let mut win: Vec<f32> = state[ch * (k - 1)..(ch + 1) * (k - 1)].to_vec();
        for step in 0..t {
            win.push(mixed[step * c + ch]);
            let acc: f32 = (0..k).map(|j| w[ch * k + j] * win[j]).sum();
            y[step * c + ch] = silu(acc);
            win.remove(0);
        }
        state[ch * (k - 1)..(ch + 1) * (k - 1)].copy_from_slice(&win);
    }
    y
}

/// Shapes of a GDN layer.
#[derive(Clone, Copy, Debug)]
pub struct GdnDims {
    /// Key heads.
    pub hk: usize,
    /// Value heads.
    pub hv: usize,
    /// Key head dim.
    pub dk: usize,
    /// Value head dim.
    pub dv: usize,
}

/// The gated delta rule (recurrent form) over `[T, C]` conv outputs; `state` is `[Hv, Dk, Dv]`,
/// `gate_p` is `[A_log; dt_bias]`. Returns `[T, Hv·Dv]`.
pub fn delta_rule(
    y: &[f32],
    b: &[f32],
    a: &[f32],
    gate_p: &[f32],
    state: &mut [f32],
    t: usize,
    d: GdnDims,
) -> Vec<f32> {
    let kd = d.hk * d.dk;
    let c = 2 * kd + d.hv * d.dv;
    let mut out = vec![0.0; t * d.hv * d.dv];
    for step in 0..t {
        for h in 0..d.hv {
            let kh = h / (d.hv / d.hk);
            let q = &y[step * c + kh * d.dk..][..d.dk];
            let k = &y[step * c + kd + kh * d.dk..][..d.dk];
            let v = &y[step * c + 2 * kd + h * d.dv..][..d.dv];
            let qn = 1.0 / (q.iter().map(|x| x * x).sum::<f32>() + 1e-6).sqrt() / (d.dk as f32).sqrt();
            let kn = 1.0 / (k.iter().map(|x| x * x).sum::<f32>() + 1e-6).sqrt();
            let beta = sigmoid(b[step * d.hv + h]);
            let u = a[step * d.hv + h] + gate_p[d.hv + h];
            let softplus = if u > 20.0 { u } else { (1.0 + u.exp()).ln() };
            let decay = (-gate_p[h].exp() * softplus).exp();
            let s = &mut state[h * d.dk * d.dv..(h + 1) * d.dk * d.dv];
            s.iter_mut().for_each(|x| *x *= decay);
            for j in 0..d.dv {
                let mem: f32 = (0..d.dk).map(|i| s[i * d.dv + j] * k[i] * kn).sum();
                let delta = beta * (v[j] - mem);
                for i in 0..d.dk {
                    s[i * d.dv + j] += k[i] * kn * delta;
                }
                out[step * d.hv * d.dv + h * d.dv + j] = (0..d.dk).map(|i| s[i * d.dv + j] * q[i] * qn).sum();
            }
        }
    }
    out
}

/// Shapes and position of an attention step.
#[derive(Clone, Copy, Debug)]
pub struct AttnDims {
    /// Query heads.
    pub hq: usize,
    /// KV heads.
    pub hkv: usize,
    /// Head dim.
    pub hd: usize,
    /// Rotary dims R.
    pub rot: usize,
    /// Position of the first token.
    pub pos0: usize,
    /// Norm epsilon.
    pub eps: f32,
}

/// Apply RMSNorm1p then NeoX RoPE (first R dims) to one head row in place.
pub fn norm_rope(x: &mut [f32], w: &[f32], rope: &[f32], pos: usize, rot: usize, eps: f32) {
    let n = x.len();
    let normed = rms_norm(x, w, n, eps);
    let half = rot / 2;
    for d in 0..n {
        x[d] = if d < half {
            let (c, s) = (rope[(pos * half + d) * 2], rope[(pos * half + d) * 2 + 1]);
            normed[d] * c - normed[d + half] * s
        } else if d < rot {
            let i = d - half;
            let (c, s) = (rope[(pos * half + i) * 2], rope[(pos * half + i) * 2 + 1]);
            normed[d] * c + normed[i] * s
        } else {
            normed[d]
        };
    }
}

/// Gated attention for `T` new tokens: `qg` `[T, Hq, 2hd]`, `k`/`v` `[T, Hkv·hd]` (raw
/// projections), appended to caches `kc`/`vc` (`Vec` per kv head of `[S, hd]` rows). Returns
/// `[T, Hq·hd]` gated outputs.
#[allow(clippy::too_many_arguments)]
pub fn attention(
    qg: &[f32],
    k: &[f32],
    v: &[f32],
    q_norm: &[f32],
    k_norm: &[f32],
    rope: &[f32],
    kc: &mut [Vec<f32>],
    vc: &mut [Vec<f32>],
    t: usize,
    d: AttnDims,
) -> Vec<f32> {
    let hd = d.hd;
    for step in 0..t {
        for h in 0..d.hkv {
            let mut kr = k[(step * d.hkv + h) * hd..][..hd].to_vec();
            norm_rope(&mut kr, k_norm, rope, d.pos0 + step, d.rot, d.eps);
            kc[h].extend(kr);
            vc[h].extend_from_slice(&v[(step * d.hkv + h) * hd..][..hd]);
        }
    }
    let mut out = vec![0.0; t * d.hq * hd];
    let scale = (hd as f32).powf(-0.5);
    for step in 0..t {
        let n_keys = d.pos0 + step + 1;
        for h in 0..d.hq {
            let kvh = h / (d.hq / d.hkv);
            let base = (step * d.hq + h) * 2 * hd;
            let mut q = qg[base..base + hd].to_vec();
            norm_rope(&mut q, q_norm, rope, d.pos0 + step, d.rot, d.eps);
            let scores: Vec<f32> =
                (0..n_keys).map(|s| (0..hd).map(|i| q[i] * kc[kvh][s * hd + i]).sum::<f32>() * scale).collect();
            let m = scores.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
            let e: Vec<f32> = scores.iter().map(|s| (s - m).exp()).collect();
            let z: f32 = e.iter().sum();
            for i in 0..hd {
                let o: f32 = (0..n_keys).map(|s| e[s] * vc[kvh][s * hd + i]).sum::<f32>() / z;
                out[(step * d.hq + h) * hd + i] = o * sigmoid(qg[base + hd + i]);
            }
        }
    }
    out
}
