//! One decode step of the dense decoder skeleton (sglite.models.decoder) in one call: every
//! layer's norms, projections, rotary embedding, K/V writes, attention and MLP, then the
//! final norm, composed from the `cpu_attn` and `quant` kernels on f32 activations.
//!
//! A decode step of a small model is hundreds of short kernels; called one by one from
//! Python, each paid the interpreter, tensor allocation and a trip through torch (SmolLM2-135M:
//! ~6 ms of a 12 ms step at one row). Here the same kernels run back to back on scratch
//! buffers of this crate, with the same inputs in the same order, so the result is the
//! Python path's to the last bit but for torch's own ops it replaces (bias adds, a q/k norm
//! torch computed), which are within f32 rounding of it.
//!
//! What a step covers (`Layout`): the `pre` and `sandwich` layouts, RMS norms (the weight
//! holds `1 + w` for the offset kind), gated SiLU / tanh-GELU MLPs, optional biases of the
//! projections, a per-head RMS q/k norm, a scale on each branch, rotary tables per layer (or
//! none), and the attention variants of `cpu_attn` (windows, logit caps, sinks) over a pool
//! in f32, bf16 or fp8. Projections are `quant` panels. Python decides what qualifies
//! (sglite.models.native_step) and keeps every buffer alive across a call.

use cpu_attn::ops::{gated_mul, rms_norm, rope, Gate, HeadRows};
use cpu_attn::store::{store, Rows, StoreKind};
use cpu_attn::{Bf16, DecodePlan, Dims, E4m3, E5m2, KvElem, Layer, Variant};
use quant::{panel_matmul_segments, Isa, Panels, Precision};

mod scratch;

pub use scratch::{Scratch, ATTENTION, ELEMENTWISE, MATMUL};

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StepError(pub String);

impl std::fmt::Display for StepError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

fn fail<T>(what: &str, e: impl std::fmt::Display) -> Result<T, StepError> {
    Err(StepError(format!("{what}: {e}")))
}

/// Where the layer's norms sit (sglite.models.decoder_spec's table).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// `h += attn(n1(h)); h += mlp(n2(h))`
    Pre,
    /// `h += n3(attn(n1(h))); h += n4(mlp(n2(h)))`
    Sandwich,
}

/// A projection: panels side by side (`(weights, first output column)`), plus a bias.
pub struct Linear<'a> {
    pub segments: Vec<(Panels<'a>, usize)>,
    pub bias: Option<&'a [f32]>,
    pub out_features: usize,
}

/// One layer's weights, pool and attention variant.
pub struct LayerWeights<'a> {
    pub input_norm: &'a [f32],
    /// the MLP's input norm (`post_attention_layernorm`)
    pub mlp_norm: &'a [f32],
    /// sandwich only: the attention's and the MLP's output norms
    pub attn_out_norm: Option<&'a [f32]>,
    pub mlp_out_norm: Option<&'a [f32]>,
    /// per-head RMS norms of q and k (`[head_dim]` each)
    pub q_norm: Option<&'a [f32]>,
    pub k_norm: Option<&'a [f32]>,
    pub qkv: Linear<'a>,
    pub o: Linear<'a>,
    pub gate_up: Linear<'a>,
    pub down: Linear<'a>,
    /// index into the step's rotary inputs; None: no rotation (NoPE)
    pub rope: Option<usize>,
    /// index into the step's attention plans (one per distinct window)
    pub plan: usize,
    pub scale: f32,
    pub logit_cap: f32,
    pub sinks: Option<&'a [f32]>,
    /// this layer's K and V buffers, `[num_slots, num_kv_heads, head_dim]` of the pool's kind
    pub k_pool: &'a mut [u8],
    pub v_pool: &'a mut [u8],
}

/// The model's shape and the choices every layer shares.
pub struct Model<'a> {
    pub hidden: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub intermediate: usize,
    pub eps: f32,
    pub qk_eps: f32,
    pub layout: Layout,
    pub gate: Gate,
    /// each branch's output times this (1: none)
    pub residual_scale: f32,
    pub kv_kind: StoreKind,
    pub precision: Precision,
    pub layers: Vec<LayerWeights<'a>>,
    pub final_norm: &'a [f32],
}

/// A step's inputs besides the hidden states.
pub struct StepInputs<'a> {
    /// per rotary table: (the rows each token reads, the table `[rows, 2 head_dim]`)
    pub ropes: Vec<(&'a [i64], &'a [f32])>,
    /// the pool slot of each token's new K/V
    pub loc: &'a [i64],
    pub plans: Vec<&'a DecodePlan>,
}

/// `x` (`[n, hidden]`, the embeddings) becomes the final norm's output: `n` one-token rows
/// through every layer, their K/V written to `loc`.
pub fn decode_step(
    model: &mut Model<'_>,
    inputs: &StepInputs<'_>,
    x: &mut [f32],
    scratch: &mut Scratch,
    threads: usize,
) -> Result<(), StepError> {
    let n = inputs.loc.len();
    if x.len() != n * model.hidden {
        return fail(
            "decode step",
            format!("x has {} values, not {n} x {}", x.len(), model.hidden),
        );
    }
    match model.kv_kind {
        StoreKind::F32 => run_layers::<f32>(model, inputs, x, scratch, threads),
        StoreKind::Bf16 => run_layers::<Bf16>(model, inputs, x, scratch, threads),
        StoreKind::E4m3 => run_layers::<E4m3>(model, inputs, x, scratch, threads),
        StoreKind::E5m2 => run_layers::<E5m2>(model, inputs, x, scratch, threads),
    }
}

fn run_layers<K: KvElem>(
    model: &mut Model<'_>,
    inputs: &StepInputs<'_>,
    x: &mut [f32],
    s: &mut Scratch,
    threads: usize,
) -> Result<(), StepError> {
    let n = inputs.loc.len();
    let (h, d) = (model.hidden, model.head_dim);
    let (q_width, kv_width) = (model.num_heads * d, model.num_kv_heads * d);
    let qkv_width = q_width + 2 * kv_width;
    s.size(n, h, qkv_width, q_width, model.intermediate);
    s.residual[..n * h].copy_from_slice(x);
    let eps = model.eps;
    let first_norm = model
        .layers
        .first()
        .map(|l| l.input_norm)
        .unwrap_or(model.final_norm);
    s.clock.start();
    rms_norm(x, None, first_norm, &mut s.normed[..n * h], eps, threads)
        .or_else(|e| fail("norm", e))?;
    s.clock.lap(ELEMENTWISE);
    let num_layers = model.layers.len();
    for i in 0..num_layers {
        let next_norm = match model.layers.get(i + 1) {
            Some(next) => next.input_norm,
            None => model.final_norm,
        };
        let layer = &mut model.layers[i];
        // attention
        linear(
            &layer.qkv,
            &s.normed[..n * h],
            n,
            &mut s.qkv,
            model.precision,
            threads,
        )?;
        s.clock.lap(MATMUL);
        let (mut q_src, mut k_src) = (
            HeadRows {
                data: &s.qkv[..],
                row_stride: qkv_width,
                heads: model.num_heads,
            },
            HeadRows {
                data: &s.qkv[q_width..],
                row_stride: qkv_width,
                heads: model.num_kv_heads,
            },
        );
        if let (Some(qn), Some(kn)) = (layer.q_norm, layer.k_norm) {
            for t in 0..n {
                let row = &s.qkv[t * qkv_width..];
                s.q_normed[t * q_width..][..q_width].copy_from_slice(&row[..q_width]);
                s.k_normed[t * kv_width..][..kv_width]
                    .copy_from_slice(&row[q_width..q_width + kv_width]);
            }
            norm_heads(&mut s.q_normed[..n * q_width], qn, model.qk_eps, &mut s.tmp)?;
            norm_heads(
                &mut s.k_normed[..n * kv_width],
                kn,
                model.qk_eps,
                &mut s.tmp,
            )?;
            q_src = HeadRows {
                data: &s.q_normed[..n * q_width],
                row_stride: q_width,
                heads: model.num_heads,
            };
            k_src = HeadRows {
                data: &s.k_normed[..n * kv_width],
                row_stride: kv_width,
                heads: model.num_kv_heads,
            };
        }
        let (q_rot, k_rot) = (&mut s.q_rot[..n * q_width], &mut s.k_rot[..n * kv_width]);
        match layer.rope {
            Some(r) => {
                let (rows, table) = inputs.ropes[r];
                rope(rows, table, &q_src, &k_src, q_rot, k_rot, d, threads)
                    .or_else(|e| fail("rope", e))?;
            }
            None => {
                copy_rows(&q_src, n, q_width, q_rot);
                copy_rows(&k_src, n, kv_width, k_rot);
            }
        }
        s.clock.lap(ELEMENTWISE);
        let k_rows = Rows {
            data: &k_rot[..],
            row_stride: kv_width,
            width: kv_width,
        };
        let v_rows = Rows {
            data: &s.qkv[q_width + kv_width..],
            row_stride: qkv_width,
            width: kv_width,
        };
        store(&k_rows, inputs.loc, layer.k_pool, model.kv_kind, threads)
            .or_else(|e| fail("k store", e))?;
        store(&v_rows, inputs.loc, layer.v_pool, model.kv_kind, threads)
            .or_else(|e| fail("v store", e))?;
        let attn_layer = Layer {
            q: &q_rot[..],
            k: as_kv::<K>(layer.k_pool),
            v: as_kv::<K>(layer.v_pool),
            dims: Dims::same(model.num_heads, model.num_kv_heads, d),
            scale: layer.scale,
            variant: Variant {
                logit_cap: layer.logit_cap,
                sinks: layer.sinks,
            },
        };
        let plan = inputs
            .plans
            .get(layer.plan)
            .ok_or_else(|| StepError(format!("layer {i}: no plan {}", layer.plan)))?;
        plan.run(&attn_layer, &mut s.attn[..n * q_width], threads)
            .or_else(|e| fail("attention", e))?;
        s.clock.lap(ATTENTION);
        linear(
            &layer.o,
            &s.attn[..n * q_width],
            n,
            &mut s.branch,
            model.precision,
            threads,
        )?;
        s.clock.lap(MATMUL);
        finish_branch(
            model.residual_scale,
            layer.attn_out_norm,
            &mut s.branch[..n * h],
            eps,
            &mut s.tmp,
        )?;
        rms_norm(
            &s.branch[..n * h],
            Some(&mut s.residual[..n * h]),
            layer.mlp_norm,
            &mut s.normed[..n * h],
            eps,
            threads,
        )
        .or_else(|e| fail("norm", e))?;
        // MLP
        s.clock.lap(ELEMENTWISE);
        let inter = model.intermediate;
        linear(
            &layer.gate_up,
            &s.normed[..n * h],
            n,
            &mut s.gate_up,
            model.precision,
            threads,
        )?;
        s.clock.lap(MATMUL);
        gated_mul(
            model.gate,
            &s.gate_up[..n * 2 * inter],
            &mut s.act[..n * inter],
            inter,
            threads,
        )
        .or_else(|e| fail("gated mul", e))?;
        s.clock.lap(ELEMENTWISE);
        linear(
            &layer.down,
            &s.act[..n * inter],
            n,
            &mut s.branch,
            model.precision,
            threads,
        )?;
        s.clock.lap(MATMUL);
        finish_branch(
            model.residual_scale,
            layer.mlp_out_norm,
            &mut s.branch[..n * h],
            eps,
            &mut s.tmp,
        )?;
        let out: &mut [f32] = if i + 1 < num_layers {
            &mut s.normed[..n * h]
        } else {
            &mut x[..]
        };
        rms_norm(
            &s.branch[..n * h],
            Some(&mut s.residual[..n * h]),
            next_norm,
            out,
            eps,
            threads,
        )
        .or_else(|e| fail("norm", e))?;
        s.clock.lap(ELEMENTWISE);
    }
    if num_layers == 0 {
        x.copy_from_slice(&s.normed[..n * h]);
    }
    Ok(())
}

/// `y = x W^T (+ bias)` into `y`'s first `n * out_features` values.
fn linear(
    l: &Linear<'_>,
    x: &[f32],
    n: usize,
    y: &mut [f32],
    precision: Precision,
    threads: usize,
) -> Result<(), StepError> {
    let width = l.out_features;
    let y = &mut y[..n * width];
    panel_matmul_segments(&l.segments, x, n, y, width, precision, Isa::best(), threads)
        .or_else(|e| fail("matmul", e))?;
    if let Some(bias) = l.bias {
        for row in y.chunks_exact_mut(width) {
            row.iter_mut().zip(bias).for_each(|(v, b)| *v += b);
        }
    }
    Ok(())
}

/// A branch's output before it joins the residual: times the residual scale, then its
/// output norm (sandwich).
fn finish_branch(
    scale: f32,
    norm: Option<&[f32]>,
    out: &mut [f32],
    eps: f32,
    tmp: &mut Vec<f32>,
) -> Result<(), StepError> {
    if scale != 1.0 {
        out.iter_mut().for_each(|v| *v *= scale);
    }
    if let Some(w) = norm {
        tmp.clear();
        tmp.extend_from_slice(out);
        rms_norm(&tmp[..], None, w, out, eps, 1).or_else(|e| fail("norm", e))?;
    }
    Ok(())
}

/// RMS norm of each head row (`[.., head_dim]`) in place.
fn norm_heads(
    rows: &mut [f32],
    weight: &[f32],
    eps: f32,
    tmp: &mut Vec<f32>,
) -> Result<(), StepError> {
    tmp.clear();
    tmp.extend_from_slice(rows);
    rms_norm(&tmp[..], None, weight, rows, eps, 1).or_else(|e| fail("q/k norm", e))
}

fn copy_rows(src: &HeadRows<'_, f32>, n: usize, width: usize, out: &mut [f32]) {
    for t in 0..n {
        out[t * width..][..width].copy_from_slice(&src.data[t * src.row_stride..][..width]);
    }
}

/// A pool layer's bytes as its element type (the pool's kind is `K`'s: checked by the
/// caller, the buffer's length a multiple of its size).
fn as_kv<K: KvElem>(bytes: &[u8]) -> &[K] {
    let size = std::mem::size_of::<K>();
    // SAFETY: K is a plain value type of `size` bytes with no invalid bit patterns (f32,
    // u16 or u8 wrappers); the pool buffers come from torch, aligned for their element.
    unsafe { std::slice::from_raw_parts(bytes.as_ptr() as *const K, bytes.len() / size) }
}
