//! The element types of q, K, V and the output: f32, bfloat16, and fp8 (e4m3fn, e5m2) for
//! K/V only. Loads widen each to f32 (`KvElem::to_f32`; the vector loads in kernel/x86.rs
//! switch on `KvElem::KIND`); only q's and the output's types narrow back (`Elem::from_f32`).

use crate::fp8;

/// How an element type is widened to f32 (the vector loads switch on it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    F32,
    Bf16,
    /// fp8 e4m3 ("fn": no infinities, NaN = S.1111.111, finite max 448)
    E4m3,
    /// fp8 e5m2 (the top byte of an f16: infinities and NaNs as IEEE)
    E5m2,
}

/// An element type K and V may be stored in (the KV pool's dtype); math is in f32.
pub trait KvElem: Copy + Send + Sync + 'static {
    const KIND: Kind;
    fn to_f32(self) -> f32;
}

/// An element type of q and the output (and of K/V when they share it).
pub trait Elem: KvElem {
    /// bfloat16 bits (loaded by widening to f32), else f32 itself.
    const IS_BF16: bool;
    fn from_f32(x: f32) -> Self;
}

impl KvElem for f32 {
    const KIND: Kind = Kind::F32;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
}

impl Elem for f32 {
    const IS_BF16: bool = false;
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        x
    }
}

/// bfloat16 as its bit pattern (the top half of an f32).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(transparent)]
pub struct Bf16(pub u16);

impl KvElem for Bf16 {
    const KIND: Kind = Kind::Bf16;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f32::from_bits(u32::from(self.0) << 16)
    }
}

impl Elem for Bf16 {
    const IS_BF16: bool = true;
    /// Round to nearest, ties to even (what torch does); NaN stays NaN.
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        let bits = x.to_bits();
        if x.is_nan() {
            return Bf16(((bits >> 16) as u16) | 0x40);
        }
        let round = 0x7fff + ((bits >> 16) & 1);
        Bf16((bits.wrapping_add(round) >> 16) as u16)
    }
}

/// fp8 e4m3fn as its byte (torch.float8_e4m3fn).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(transparent)]
pub struct E4m3(pub u8);

/// fp8 e5m2 as its byte (torch.float8_e5m2).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(transparent)]
pub struct E5m2(pub u8);

impl KvElem for E4m3 {
    const KIND: Kind = Kind::E4m3;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f32::from_bits(fp8::E4M3[self.0 as usize])
    }
}

impl KvElem for E5m2 {
    const KIND: Kind = Kind::E5m2;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f32::from_bits(fp8::E5M2[self.0 as usize])
    }
}
