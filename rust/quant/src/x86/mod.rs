//! The x86 kernels: feature checks, and the entry points that pick the format's decoder and
//! the register blocking for `n`, compiled once per instruction set (`#[target_feature]`
//! functions, generic over the format and the blocking).

mod decode;
mod gemm;
mod gemv;
mod gemv_k;
mod kfmt;
mod lanes;
mod panel;
mod simd;

use std::ops::Range;

use decode::{with_fmt, Fmt};
use kfmt::{with_kfmt, KFmt};
use simd::{Avx2, Avx512, F32Lanes};

use crate::panel::Panels;
use crate::panel_act::{PanelActs, Precision};
use crate::run::TILE_ROWS;
use crate::{Isa, Problem, Weights};

pub(crate) fn has_avx2() -> bool {
    std::arch::is_x86_feature_detected!("avx2")
        && std::arch::is_x86_feature_detected!("fma")
        && std::arch::is_x86_feature_detected!("f16c")
}

pub(crate) fn has_avx2_vnni() -> bool {
    has_avx2() && std::arch::is_x86_feature_detected!("avxvnni")
}

pub(crate) fn has_avx512() -> bool {
    has_avx2()
        && std::arch::is_x86_feature_detected!("avx512f")
        && std::arch::is_x86_feature_detected!("avx512bw")
        && std::arch::is_x86_feature_detected!("avx512vl")
        && std::arch::is_x86_feature_detected!("avx512vnni")
}

/// Calls `$f::<..., N, ...>` for `$n` in 1..=8 (`$n` is at most 8).
macro_rules! with_n {
    ($n:expr, $N:ident => $body:expr) => {
        match $n {
            1 => {
                const $N: usize = 1;
                $body
            }
            2 => {
                const $N: usize = 2;
                $body
            }
            3 => {
                const $N: usize = 3;
                $body
            }
            4 => {
                const $N: usize = 4;
                $body
            }
            5 => {
                const $N: usize = 5;
                $body
            }
            6 => {
                const $N: usize = 6;
                $body
            }
            7 => {
                const $N: usize = 7;
                $body
            }
            _ => {
                const $N: usize = 8;
                $body
            }
        }
    };
}

macro_rules! avx512 {
    ($(#[$doc:meta])* fn $name:ident<$($g:ident: $b:path),*; $(const $c:ident: usize),*>($($arg:ident: $ty:ty),*) $body:block) => {
        $(#[$doc])*
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
        unsafe fn $name<$($g: $b,)* $(const $c: usize,)*>($($arg: $ty),*) $body
    };
}

macro_rules! avx2 {
    ($(#[$doc:meta])* fn $name:ident<$($g:ident: $b:path),*; $(const $c:ident: usize),*>($($arg:ident: $ty:ty),*) $body:block) => {
        $(#[$doc])*
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn $name<$($g: $b,)* $(const $c: usize,)*>($($arg: $ty),*) $body
    };
}

avx512! { fn gemv_f32_512<F: Fmt; const N: usize>(p: &Problem<'_>, rows: Range<usize>, x0: usize) {
    gemv::gemv_f32::<Avx512, F, N>(p, rows, x0)
}}
avx512! { fn gemv_f32_k512<F: KFmt; const N: usize>(p: &Problem<'_>, rows: Range<usize>, x0: usize) {
    gemv_k::gemv_f32_k::<F, N>(p, rows, x0)
}}
avx2! { fn gemv_f32_256<F: Fmt; const N: usize>(p: &Problem<'_>, rows: Range<usize>, x0: usize) {
    gemv::gemv_f32::<Avx2, F, N>(p, rows, x0)
}}
/// SAFETY: `p` checked by `matmul`, `isa` available (AVX2 or AVX-512), no other thread
/// writes columns `rows` of y.
pub(crate) unsafe fn gemv_f32(p: &Problem<'_>, rows: Range<usize>, isa: Isa) {
    let mut x0 = 0;
    while x0 < p.n {
        let n = (p.n - x0).min(gemv::MAX_N);
        if isa == Isa::Avx512 {
            with_kfmt!(p.w.qtype, F => with_n!(n, N => gemv_f32_k512::<F, N>(p, rows.clone(), x0)),
                _ => with_fmt!(p.w.qtype, F => with_n!(n, N => gemv_f32_512::<F, N>(p, rows.clone(), x0))))
        } else {
            with_fmt!(p.w.qtype, F => with_n!(n, N => gemv_f32_256::<F, N>(p, rows.clone(), x0)));
        }
        x0 += n;
    }
}

#[inline(always)]
unsafe fn gemm_f32_body<L: F32Lanes, F: Fmt, const MR: usize>(p: &Problem<'_>, rows: Range<usize>) {
    let cols = p.w.cols;
    let mut panel = vec![0f32; gemm::KC.min(cols) * TILE_ROWS];
    let mut out = vec![0f32; p.n * TILE_ROWS];
    let mut k0 = 0;
    while k0 < cols {
        let kc = gemm::KC.min(cols - k0);
        gemm::pack_f32::<L, F>(p, rows.clone(), k0, kc, &mut panel);
        let mut x0 = 0;
        while x0 + MR <= p.n {
            gemm::tile_f32::<L, MR>(p, &panel, k0, kc, x0, &mut out);
            x0 += MR;
        }
        with_n!(p.n - x0, N => {
            if N < MR && x0 < p.n {
                gemm::tile_f32::<L, N>(p, &panel, k0, kc, x0, &mut out)
            }
        });
        k0 += kc;
    }
    gemm::write_out(p, rows, &out);
}

avx512! { fn gemm_f32_512<F: Fmt;>(p: &Problem<'_>, rows: Range<usize>) {
    gemm_f32_body::<Avx512, F, 6>(p, rows)
}}
avx2! { fn gemm_f32_256<F: Fmt;>(p: &Problem<'_>, rows: Range<usize>) {
    gemm_f32_body::<Avx2, F, 2>(p, rows)
}}

/// SAFETY: as `gemv_f32`; `rows` is one tile (at most 32 rows).
pub(crate) unsafe fn gemm_f32(p: &Problem<'_>, rows: Range<usize>, isa: Isa) {
    with_fmt!(p.w.qtype, F => if isa == Isa::Avx512 {
        gemm_f32_512::<F>(p, rows)
    } else {
        gemm_f32_256::<F>(p, rows)
    })
}

/// SAFETY: AVX2, FMA and F16C available; `out` holds `w.cols` values.
pub(crate) unsafe fn dequantize_row(w: &Weights<'_>, r: usize, out: &mut [f32]) {
    with_fmt!(w.qtype, F => decode::dequantize_row::<F>(w, r, out))
}

/// Rows of x per pass of the panel kernels: 8 while there are (the chunk-major kernel keeps
/// one accumulator per row), then 4, then the rest.
pub(crate) const PANEL_MAX_N: usize = 8;

/// Calls `$body` with `$N` = `$n`, one of 1, 2, 3, 4 and 8.
macro_rules! with_n_panel {
    ($n:expr, $N:ident => $body:expr) => {
        match $n {
            1 => {
                const $N: usize = 1;
                $body
            }
            2 => {
                const $N: usize = 2;
                $body
            }
            3 => {
                const $N: usize = 3;
                $body
            }
            4 => {
                const $N: usize = 4;
                $body
            }
            _ => {
                const $N: usize = 8;
                $body
            }
        }
    };
}

macro_rules! panel_isa {
    ($name:ident, $lanes:ty, $features:literal) => {
        #[target_feature(enable = $features)]
        unsafe fn $name<F: panel::PFmt, const N: usize, const WIDE: bool>(
            w: &Panels<'_>,
            a: &PanelActs,
            panels: Range<usize>,
            x0: usize,
            y: *mut f32,
            ld_y: usize,
        ) {
            for p in panels {
                panel::panel_rows::<$lanes, F, N, WIDE>(w, a, p, x0, y, ld_y)
            }
        }
    };
}
panel_isa!(
    panels_512,
    panel::Zmm,
    "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c"
);
panel_isa!(panels_vnni256, panel::Ymm<true>, "avx2,fma,f16c,avxvnni");
panel_isa!(panels_256, panel::Ymm<false>, "avx2,fma,f16c");

/// `y[r, 16 p ..] = x[r] . W[panel p]^T` for every row r of x (`n`) and panel p in `panels`.
/// SAFETY: `isa` (not Scalar) available; `w`, `a`, y checked by the caller; no other thread
/// writes these panels' columns of y.
pub(crate) unsafe fn panel_task(
    w: &Panels<'_>,
    a: &PanelActs,
    panels: Range<usize>,
    n: usize,
    y: *mut f32,
    ld_y: usize,
    isa: Isa,
) {
    let wide = a.precision == Precision::Int16;
    let mut x0 = 0;
    while x0 < n {
        let rows = match n - x0 {
            left if left >= PANEL_MAX_N => PANEL_MAX_N,
            left => left.min(4),
        };
        let p = panels.clone();
        panel::with_pfmt!(w.qtype, F => with_n_panel!(rows, N => match (isa, wide) {
            (Isa::Avx512, true) => panels_512::<F, N, true>(w, a, p, x0, y, ld_y),
            (Isa::Avx512, false) => panels_512::<F, N, false>(w, a, p, x0, y, ld_y),
            (Isa::Avx2Vnni, true) => panels_vnni256::<F, N, true>(w, a, p, x0, y, ld_y),
            (Isa::Avx2Vnni, false) => panels_vnni256::<F, N, false>(w, a, p, x0, y, ld_y),
            (_, true) => panels_256::<F, N, true>(w, a, p, x0, y, ld_y),
            (_, false) => panels_256::<F, N, false>(w, a, p, x0, y, ld_y),
        }));
        x0 += rows;
    }
}
