//! Writes of a step's K or V rows into the KV pool, converted to the pool's dtype on the way.
//!
//! torch takes three to four ops per tensor for an fp8 pool (saturate, convert, view as
//! bytes, `index_copy_`: it has no float8 `index_copy_` on the CPU); on a batch-1 decode
//! step of a 7B that was ~70 us per layer, most of it dispatch. The roundings are torch's,
//! to the bit (tested against it from Python): round to nearest even; fp8 saturates to the
//! format's finite max first (`sglite.mem_cache.kv_dtype.to_store`), NaN stays NaN.

use crate::{err, pool, AttnError, Elem};

/// The pool's element type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StoreKind {
    F32,
    Bf16,
    /// fp8 e4m3fn (finite max 448, NaN = S.1111.111)
    E4m3,
    /// fp8 e5m2 (finite max 57344)
    E5m2,
}

impl StoreKind {
    pub fn from_name(name: &str) -> Option<StoreKind> {
        Some(match name {
            "float32" => StoreKind::F32,
            "bfloat16" => StoreKind::Bf16,
            "float8_e4m3fn" => StoreKind::E4m3,
            "float8_e5m2" => StoreKind::E5m2,
            _ => return None,
        })
    }

    pub fn size(self) -> usize {
        match self {
            StoreKind::F32 => 4,
            StoreKind::Bf16 => 2,
            StoreKind::E4m3 | StoreKind::E5m2 => 1,
        }
    }
}

/// bfloat16 bits of `x`, rounded to nearest even (NaN: the quiet NaN 0x7fc0).
#[inline(always)]
pub fn bf16_bits(x: f32) -> u16 {
    let b = x.to_bits();
    let rounded = (b.wrapping_add(0x7fff + ((b >> 16) & 1)) >> 16) as u16;
    if x.is_nan() {
        0x7fc0
    } else {
        rounded
    }
}

/// The fp8 byte of `x` with `M` mantissa bits and exponent bias `BIAS` (e4m3: 3, 7; e5m2:
/// 2, 15), saturated to `max` and rounded to nearest even; NaN -> sign | 0x7f.
/// Branch-free, so that a row of them vectorizes.
#[inline(always)]
fn fp8_bits<const M: u32, const BIAS: u32>(x: f32, max: f32) -> u8 {
    let bits = x.to_bits();
    let sign = ((bits >> 24) & 0x80) as u8;
    let a = x.abs().min(max); // NaN -> max: replaced below
    let a_bits = a.to_bits();
    // below the smallest normal, 2^(1 - BIAS): one f32 add rounds a to a whole number of
    // the subnormal step 2^(1 - BIAS - M) (the step is the ulp of `magic`), which is then
    // the byte; the top of the range rounds to the smallest normal's byte, 1 << M
    let magic = f32::from_bits((127 + 23 + 1 - BIAS - M) << 23);
    let sub = (a + magic).to_bits().wrapping_sub(magic.to_bits());
    // normal: round the mantissa to M bits (ties to even), then rebias the exponent
    let shift = 23 - M;
    let odd = (a_bits >> shift) & 1;
    let rounded = a_bits.wrapping_add((1 << (shift - 1)) - 1 + odd) >> shift;
    let normal = rounded.wrapping_sub((127 - BIAS) << M);
    let min_normal = (127 + 1 - BIAS) << 23;
    let byte = (if a_bits < min_normal { sub } else { normal }) as u8;
    if x.is_nan() {
        sign | 0x7f
    } else {
        sign | byte
    }
}

#[inline(always)]
pub fn e4m3_bits(x: f32) -> u8 {
    fp8_bits::<3, 7>(x, 448.0)
}

#[inline(always)]
pub fn e5m2_bits(x: f32) -> u8 {
    fp8_bits::<2, 15>(x, 57344.0)
}

/// Rows of a step's K or V: `tokens` rows of `width` elements, `row_stride` apart.
pub struct Rows<'a, T> {
    pub data: &'a [T],
    pub row_stride: usize,
    pub width: usize,
}

/// `pool[slots[t]] = rows[t]` (converted to `kind`) for each token t; `pool` is the layer's
/// buffer as bytes, `num_slots` rows of `width` elements of `kind`. Checks every size and
/// slot first and writes nothing when one is off.
pub fn store<T: Elem>(
    rows: &Rows<'_, T>,
    slots: &[i64],
    pool: &mut [u8],
    kind: StoreKind,
    threads: usize,
) -> Result<(), AttnError> {
    let (tokens, width) = (slots.len(), rows.width);
    if tokens > 0 && (tokens - 1) * rows.row_stride + width > rows.data.len() {
        return err(format!(
            "kv store: {tokens} rows of {width}, {} apart, need more than the {} elements given",
            rows.row_stride,
            rows.data.len()
        ));
    }
    let row_bytes = width * kind.size();
    let num_slots = pool.len() / row_bytes.max(1);
    if let Some(&bad) = slots.iter().find(|&&s| s < 0 || s as usize >= num_slots) {
        return err(format!(
            "kv store: slot {bad} is outside the pool's {num_slots} slots"
        ));
    }
    let base = crate::ops::Shared(pool.as_mut_ptr());
    let threads = if tokens * width < (1 << 16) {
        1
    } else {
        threads.max(1)
    };
    let per = tokens.div_ceil(threads).max(1);
    pool::for_each(tokens.div_ceil(per), threads, &|c| {
        let first = c * per;
        for (t, &slot) in slots
            .iter()
            .enumerate()
            .take((first + per).min(tokens))
            .skip(first)
        {
            let src = &rows.data[t * rows.row_stride..][..width];
            // SAFETY: the slot is inside the pool (checked above); slots of one call are
            // distinct rows (a step writes each of its tokens' slots once).
            let dst = unsafe { base.rows(slot as usize * row_bytes, row_bytes) };
            convert_row(src, dst, kind);
        }
    });
    Ok(())
}

fn convert_row<T: Elem>(src: &[T], dst: &mut [u8], kind: StoreKind) {
    #[cfg(target_arch = "x86_64")]
    {
        if crate::isa_cap::avx512()
            && std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bw")
        {
            // SAFETY: the CPU has AVX-512F and BW (checked just above).
            return unsafe { convert_row_avx512(src, dst, kind) };
        }
        if crate::isa_cap::avx2() && std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2 (checked just above).
            return unsafe { convert_row_avx2(src, dst, kind) };
        }
    }
    convert_row_any(src, dst, kind)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn convert_row_avx512<T: Elem>(src: &[T], dst: &mut [u8], kind: StoreKind) {
    convert_row_any(src, dst, kind)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn convert_row_avx2<T: Elem>(src: &[T], dst: &mut [u8], kind: StoreKind) {
    convert_row_any(src, dst, kind)
}

#[inline(always)]
fn convert_row_any<T: Elem>(src: &[T], dst: &mut [u8], kind: StoreKind) {
    match kind {
        StoreKind::F32 => {
            for (d, s) in dst.chunks_exact_mut(4).zip(src) {
                d.copy_from_slice(&s.to_f32().to_ne_bytes());
            }
        }
        StoreKind::Bf16 => {
            for (d, s) in dst.chunks_exact_mut(2).zip(src) {
                d.copy_from_slice(&bf16_bits(s.to_f32()).to_ne_bytes());
            }
        }
        StoreKind::E4m3 => {
            for (d, s) in dst.iter_mut().zip(src) {
                *d = e4m3_bits(s.to_f32());
            }
        }
        StoreKind::E5m2 => {
            for (d, s) in dst.iter_mut().zip(src) {
                *d = e5m2_bits(s.to_f32());
            }
        }
    }
}
