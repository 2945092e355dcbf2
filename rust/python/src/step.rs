//! `sglite._core.DecodeStep`: the Python face of `decode_step` (one decode step of the dense
//! decoder skeleton in one call).
//!
//! Built once per model and KV pool from dicts of `(address, element count)` pairs (the
//! caller, `sglite.models.native_step`, checks dtypes, devices and contiguity, and keeps every
//! tensor alive as long as this object); each size is checked here at construction, and the
//! kernels check the rest at every run (a ValueError, before anything is written when the
//! layout is off). A run releases the GIL.

use std::sync::Mutex;

use cpu_attn::ops::Gate;
use cpu_attn::store::StoreKind;
use decode_step::{decode_step, LayerWeights, Layout, Linear, Model, Scratch, StepInputs};
use pyo3::prelude::*;
use quant::{Panels, Precision, QType};

use crate::attn::{PyDecodePlan, Raw};
use crate::convert::value_error;

type RawPair = (usize, usize);

#[derive(FromPyObject)]
#[pyo3(from_item_all)]
struct LinearDesc {
    /// (qtype name, panels, rows, first column)
    segments: Vec<(String, RawPair, usize, usize)>,
    bias: Option<RawPair>,
    out_features: usize,
    in_features: usize,
}

#[derive(FromPyObject)]
#[pyo3(from_item_all)]
struct LayerDesc {
    input_norm: RawPair,
    mlp_norm: RawPair,
    attn_out_norm: Option<RawPair>,
    mlp_out_norm: Option<RawPair>,
    q_norm: Option<RawPair>,
    k_norm: Option<RawPair>,
    qkv: LinearDesc,
    o: LinearDesc,
    gate_up: LinearDesc,
    down: LinearDesc,
    rope: Option<usize>,
    scale: f32,
    logit_cap: f32,
    sinks: Option<RawPair>,
    k_pool: RawPair,
    v_pool: RawPair,
}

#[derive(FromPyObject)]
#[pyo3(from_item_all)]
struct ModelDesc {
    hidden: usize,
    num_heads: usize,
    num_kv_heads: usize,
    head_dim: usize,
    intermediate: usize,
    eps: f32,
    qk_eps: f32,
    layout: String,
    gate: String,
    residual_scale: f32,
    kv_dtype: String,
    precision: String,
    final_norm: RawPair,
    layers: Vec<LayerDesc>,
}

/// One model's decode step (module doc).
#[pyclass(name = "DecodeStep", module = "sglite._core", frozen)]
pub struct PyDecodeStep {
    desc: ModelDesc,
    layout: Layout,
    gate: Gate,
    kv_kind: StoreKind,
    precision: Precision,
    scratch: Mutex<Scratch>,
}

fn f32s(name: &str, raw: RawPair, want: Option<usize>) -> PyResult<Raw> {
    if let Some(want) = want {
        if raw.1 != want {
            return Err(value_error(format!(
                "{name}: {} values, want {want}",
                raw.1
            )));
        }
    }
    Raw::new(name, raw, 4)
}

/// SAFETY: `desc`'s addresses are live for `'a` (the caller's contract).
unsafe fn linear<'a>(name: &str, desc: &LinearDesc) -> PyResult<Linear<'a>> {
    let mut segments = Vec::with_capacity(desc.segments.len());
    for (qtype, data, rows, col) in &desc.segments {
        let qtype = QType::from_name(qtype)
            .ok_or_else(|| value_error(format!("{name}: quant type {qtype:?}")))?;
        let data = Raw::new(name, *data, 1)?;
        let panels = Panels::new(qtype, data.slice::<u8>(), *rows, desc.in_features)
            .map_err(|e| value_error(format!("{name}: {}", e.0)))?;
        segments.push((panels, *col));
    }
    let bias = match desc.bias {
        Some(b) => Some(f32s(name, b, Some(desc.out_features))?.slice::<f32>()),
        None => None,
    };
    Ok(Linear {
        segments,
        bias,
        out_features: desc.out_features,
    })
}

impl PyDecodeStep {
    fn scratch_guard(&self) -> PyResult<std::sync::MutexGuard<'_, Scratch>> {
        self.scratch
            .lock()
            .map_err(|_| value_error("DecodeStep: a previous run panicked".to_owned()))
    }

    /// The borrowed model. SAFETY: as `linear`; one run at a time (the pools are written).
    unsafe fn model<'a>(&'a self) -> PyResult<Model<'a>> {
        let d = &self.desc;
        let (h, hd) = (d.hidden, d.head_dim);
        let norm = |name: &str, raw: RawPair, len: usize| -> PyResult<&'a [f32]> {
            Ok(f32s(name, raw, Some(len))?.slice::<f32>())
        };
        let opt = |name: &str, raw: Option<RawPair>, len: usize| -> PyResult<Option<&'a [f32]>> {
            raw.map(|r| norm(name, r, len)).transpose()
        };
        let mut layers = Vec::with_capacity(d.layers.len());
        for l in &d.layers {
            let pool = |name: &str, raw: RawPair| Raw::new(name, raw, self.kv_kind.size());
            layers.push(LayerWeights {
                input_norm: norm("input_norm", l.input_norm, h)?,
                mlp_norm: norm("mlp_norm", l.mlp_norm, h)?,
                attn_out_norm: opt("attn_out_norm", l.attn_out_norm, h)?,
                mlp_out_norm: opt("mlp_out_norm", l.mlp_out_norm, h)?,
                q_norm: opt("q_norm", l.q_norm, hd)?,
                k_norm: opt("k_norm", l.k_norm, hd)?,
                qkv: linear("qkv", &l.qkv)?,
                o: linear("o", &l.o)?,
                gate_up: linear("gate_up", &l.gate_up)?,
                down: linear("down", &l.down)?,
                rope: l.rope,
                plan: 0,
                scale: l.scale,
                logit_cap: l.logit_cap,
                sinks: opt("sinks", l.sinks, d.num_heads)?,
                k_pool: pool("k_pool", l.k_pool)?.slice_mut::<u8>(),
                v_pool: pool("v_pool", l.v_pool)?.slice_mut::<u8>(),
            });
        }
        Ok(Model {
            hidden: h,
            num_heads: d.num_heads,
            num_kv_heads: d.num_kv_heads,
            head_dim: hd,
            intermediate: d.intermediate,
            eps: d.eps,
            qk_eps: d.qk_eps,
            layout: self.layout,
            gate: self.gate,
            residual_scale: d.residual_scale,
            kv_kind: self.kv_kind,
            precision: self.precision,
            layers,
            final_norm: norm("final_norm", d.final_norm, h)?,
        })
    }
}

#[pymethods]
impl PyDecodeStep {
    /// `desc`: a dict (see `sglite.models.native_step` for its keys).
    #[new]
    fn new(desc: ModelDesc) -> PyResult<Self> {
        let layout = match desc.layout.as_str() {
            "pre" => Layout::Pre,
            "sandwich" => Layout::Sandwich,
            other => return Err(value_error(format!("layout {other:?}: pre or sandwich"))),
        };
        let gate = Gate::from_name(&desc.gate).map_err(|e| value_error(e.0))?;
        let kv_kind = StoreKind::from_name(&desc.kv_dtype)
            .ok_or_else(|| value_error(format!("kv_dtype {:?}", desc.kv_dtype)))?;
        let precision = Precision::from_name(&desc.precision)
            .ok_or_else(|| value_error(format!("precision {:?}: int8 or int16", desc.precision)))?;
        let step = Self {
            desc,
            layout,
            gate,
            kv_kind,
            precision,
            scratch: Mutex::new(Scratch::default()),
        };
        // SAFETY: the caller's contract (module doc); nothing runs yet.
        unsafe { step.model()? };
        Ok(step)
    }

    /// Time the parts of every run from now on (`on`), or stop; the totals restart at 0.
    fn profile(&self, on: bool) -> PyResult<()> {
        self.scratch_guard()?.profile(on);
        Ok(())
    }

    /// Nanoseconds spent while profiling: (matmuls, attention with the K/V writes,
    /// element-wise steps).
    fn spent(&self) -> PyResult<(u64, u64, u64)> {
        let [m, a, e] = self.scratch_guard()?.spent();
        Ok((m, a, e))
    }

    /// `x` float32 `[n, hidden]` (the embeddings; on return, the final norm's output),
    /// `ropes` per rotary table `(int64 rows [n], float32 table)`, `loc` int64 `[n]` (the new
    /// K/V slots), `plans` the step's attention plans and `layer_plans` the one each layer
    /// runs (an index into `plans`).
    #[allow(clippy::too_many_arguments)]
    fn run(
        &self,
        py: Python<'_>,
        x: RawPair,
        ropes: Vec<(RawPair, RawPair)>,
        loc: RawPair,
        plans: Vec<PyRef<'_, PyDecodePlan>>,
        layer_plans: Vec<usize>,
        num_threads: usize,
    ) -> PyResult<()> {
        if layer_plans.len() != self.desc.layers.len() {
            return Err(value_error(format!(
                "layer_plans has {} entries for {} layers",
                layer_plans.len(),
                self.desc.layers.len()
            )));
        }
        let x = Raw::new("x", x, 4)?;
        let loc = Raw::new("loc", loc, 8)?;
        let mut rope_raws = Vec::with_capacity(ropes.len());
        for (rows, table) in ropes {
            rope_raws.push((
                Raw::new("rope rows", rows, 8)?,
                Raw::new("rope table", table, 4)?,
            ));
        }
        let plans: Vec<&cpu_attn::DecodePlan> = plans.iter().map(|p| p.inner()).collect();
        let mut scratch = self.scratch_guard()?;
        // SAFETY: the caller's contract (module doc); the mutex keeps runs one at a time.
        let result = unsafe {
            let mut model = self.model()?;
            for (layer, &plan) in model.layers.iter_mut().zip(&layer_plans) {
                layer.plan = plan;
            }
            let inputs = StepInputs {
                ropes: rope_raws
                    .iter()
                    .map(|(r, t)| (r.slice::<i64>(), t.slice::<f32>()))
                    .collect(),
                loc: loc.slice::<i64>(),
                plans,
            };
            let (x, scratch): (&mut [f32], &mut Scratch) = (x.slice_mut::<f32>(), &mut scratch);
            py.allow_threads(|| decode_step(&mut model, &inputs, x, scratch, num_threads))
        };
        result.map_err(|e| value_error(e.0))
    }
}
